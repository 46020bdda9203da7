"""The repository's notebooks stay light: everyone who clones the project downloads them, and every docs reader
loads their figures. Budgets: no image output over 200 KB, no notebook over 1 MB, all of them under 6 MB, and
figures stored at the size they are shown (not at 2x, "retina"). `shardkit docs execute` keeps
to this by itself; `shardkit docs shrink NOTEBOOK...` brings committed outputs back under it.

Committed outputs are also what docs readers see, so they carry no path of the machine that executed them: no
checkout, temp or home folder, no site-packages path from a warning. And a library page that shows examples is
committed with their outputs: a reader sees what a cell prints or draws without running it."""
import ast, base64, io, json, re, tempfile
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
NBS = sorted(p for p in (ROOT / "nbs").rglob("*.ipynb")
             if not any(part.startswith((".", "_")) or part == "data" for part in p.relative_to(ROOT / "nbs").parts))
IMAGE_KB, NOTEBOOK_MB, TOTAL_MB = 200, 1, 6
FIX = "run `shardkit docs shrink NOTEBOOK.ipynb` (or re-execute it with `shardkit docs execute`)"


def _images(nb: Path):
    "(cell index, mime, bytes, metadata shown-size dict) of every bitmap output of the notebook at `nb`."
    for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
        for out in cell.get("outputs", []):
            for mime, data in out.get("data", {}).items():
                if mime in ("image/png", "image/jpeg", "image/gif", "image/webp"):
                    shown = out.get("metadata", {}).get(mime, {})
                    yield i, mime, base64.b64decode("".join(data) if isinstance(data, list) else data), shown


def test_notebooks_found():
    names = {p.relative_to(ROOT / "nbs").as_posix() for p in NBS}
    assert "index.ipynb" in names and any(n.startswith("tutorials/") for n in names)


def test_no_image_over_budget():
    big = [f"{nb.relative_to(ROOT)} cell {i}: {mime} {len(b) / 1e3:.0f} KB"
           for nb in NBS for i, mime, b, _ in _images(nb) if len(b) > IMAGE_KB * 1000]
    assert not big, f"image outputs over {IMAGE_KB} KB: {big}; {FIX}"


def test_figures_stored_at_the_size_shown():
    "A figure whose metadata says it is shown smaller than its pixels (retina) carries pixels nobody sees."
    big = []
    for nb in NBS:
        for i, mime, b, shown in _images(nb):
            w = Image.open(io.BytesIO(b)).width
            if isinstance(shown, dict) and shown.get("width") and w > int(shown["width"]):
                big.append(f"{nb.relative_to(ROOT)} cell {i}: {w} px shown at {shown['width']}")
    assert not big, f"figures stored larger than shown: {big}; {FIX}"


@pytest.mark.parametrize("nb", NBS, ids=[p.relative_to(ROOT / "nbs").as_posix() for p in NBS])
def test_notebook_under_budget(nb):
    size = nb.stat().st_size
    assert size <= NOTEBOOK_MB * 1e6, f"{nb.relative_to(ROOT)} is {size / 1e6:.2f} MB (budget {NOTEBOOK_MB} MB); {FIX}"


def test_all_notebooks_under_budget():
    sizes = {nb.relative_to(ROOT).as_posix(): nb.stat().st_size for nb in NBS}
    total = sum(sizes.values())
    heaviest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    assert total <= TOTAL_MB * 1e6, f"the notebooks weigh {total / 1e6:.1f} MB (budget {TOTAL_MB} MB); heaviest: {heaviest}"


def _texts(nb: Path):
    "(cell index, text) of every text a reader sees in the outputs of the notebook at `nb`: streams, results, errors."
    join = lambda x: "".join(x) if isinstance(x, list) else str(x)
    for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
        for out in cell.get("outputs", []):
            if "text" in out: yield i, join(out["text"])
            for mime, data in out.get("data", {}).items():
                if mime.startswith("text/"): yield i, join(data)
            if "evalue" in out: yield i, out["evalue"]
            if "traceback" in out: yield i, "\n".join(out["traceback"])


def _machine_paths() -> re.Pattern:
    "Paths that belong to one machine: this checkout, temp and home folders (here and elsewhere), site-packages."
    here = [str(ROOT), tempfile.gettempdir().rstrip("/") + "/", str(Path.home()).rstrip("/") + "/"]
    here = [re.escape(p) for p in here if p.strip("/")]  # a home or temp folder of "/" names nothing
    anywhere = [r"/tmp/", r"/var/folders/", r"/private/var/", r"/root/", r"/home/[^/\s]+/", r"/Users/[^/\s]+/", r"site-packages/"]
    return re.compile(r"(?<![\w.:/])(?:" + "|".join(here + anywhere) + ")")


MACHINE_PATHS = _machine_paths()
PATH_FIX = ("show paths with `shardkit.stores.shown_path` (relative to the working directory), write scratch data under "
            "the notebook's git-ignored data/ folder instead of a temp folder, fix or precisely silence warnings that print "
            "a library's path; then re-execute it with `shardkit docs execute NOTEBOOK.ipynb`")


@pytest.mark.parametrize("nb", NBS, ids=[p.relative_to(ROOT / "nbs").as_posix() for p in NBS])
def test_outputs_show_no_machine_paths(nb):
    "A committed output that shows /tmp/tmpab12cd/shards or the checkout's path tells readers about one machine only."
    found = [f"cell {i}: ...{t[max(0, m.start() - 40):m.end() + 40]!r}..."
             for i, t in _texts(nb) for m in [MACHINE_PATHS.search(t)] if m]
    assert not found, f"{nb.relative_to(ROOT)} shows paths of the machine that executed it: {found[:5]}; {PATH_FIX}"


# Library notebooks committed without outputs, each with why. Every other library notebook runs with no server and is
# committed executed (`shardkit docs execute nbs/NN_name.ipynb`: 1x figures, nbdev_clean's form), so that its
# page shows what its examples print and draw.
NEEDS_SERVER = {}  # (none today: 07_stores.ais_cluster runs its server cells only with `ais`, and shows the rest)
SHOWS_NOTHING = {}  # checked below: no cell of theirs prints, draws or ends in a value (none today)
TO_DO = {}  # notebooks still to execute (being edited elsewhere), with why: none today
LIBRARY = [p for p in NBS if p.parent == ROOT / "nbs" and p.name != "index.ipynb"]
_SHOW_CALLS = {"print", "display", "show_doc", "pprint", "imshow"}


def _has_outputs(nb: Path) -> bool:
    return any(c.get("outputs") for c in json.loads(nb.read_text(encoding="utf-8"))["cells"])


def _shows(source: str) -> bool:
    "Whether a code cell shows something when run: it prints, displays or plots, or ends in a value (not a call)."
    code = "\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("#|", "!", "%")))
    try: tree = ast.parse(code)
    except SyntaxError: return True  # cell magics and the like: assume it shows something
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in _SHOW_CALLS or name.startswith(("plot", "show_")): return True
    last = tree.body[-1] if tree.body else None
    return isinstance(last, ast.Expr) and not isinstance(last.value, (ast.Call, ast.Constant))


EXECUTED = [p for p in LIBRARY if p.name not in {**NEEDS_SERVER, **SHOWS_NOTHING, **TO_DO}]


@pytest.mark.parametrize("nb", EXECUTED, ids=[p.name for p in EXECUTED])
def test_library_notebook_committed_with_outputs(nb):
    "A library page whose examples need no server is committed executed; the exceptions are listed above, with why."
    rel = nb.relative_to(ROOT)
    assert _has_outputs(nb), (f"{rel} is committed without outputs, so its page shows none of its examples' results: "
                              f"run `shardkit docs execute {rel}` (test-sized where the full size is slow, "
                              f"saying so on the page) and commit it; a notebook that needs a server goes in "
                              f"NEEDS_SERVER in {Path(__file__).name}, with why")


def test_output_exceptions_hold():
    "Each exception names a library notebook and is still true: SHOWS_NOTHING shows nothing, TO_DO is still to do."
    names = {p.name for p in LIBRARY}
    assert not (set(NEEDS_SERVER) | set(SHOWS_NOTHING) | set(TO_DO)) - names, "an exception names no library notebook"
    for name in SHOWS_NOTHING:
        cells = json.loads((ROOT / "nbs" / name).read_text(encoding="utf-8"))["cells"]
        showing = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and _shows("".join(c["source"]))]
        assert not showing, f"{name} cells {showing} show something now: execute it and take it off SHOWS_NOTHING"
    done = [name for name in TO_DO if _has_outputs(ROOT / "nbs" / name)]
    assert not done, f"{done} are committed with outputs now: take them off TO_DO in {Path(__file__).name}"


def test_shows():
    assert _shows("print(1)") and _shows("x = 1\nx") and _shows("#| slow\nplot_bench(r);") and _shows("fig.axes")
    assert not _shows("test_eq(1, 1)") and not _shows("x = shown_path('a')") and not _shows("#| export\ndef f(): pass")
