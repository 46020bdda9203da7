"""The notebooks are the other half of the suite: each runs from a fresh kernel, as `nbdev_test` does (directives
honoured), and each runs once per suite.

Two cell flags decide how (both listed in settings.ini `tst_flags`, so a plain `nbdev_test` skips them):
- `#| slow`: heavy work (a benchmark, a training run, a cluster of workers);
- `#| ais`: a cell that talks to AIStore. It is written to run anywhere (it guards on `AIS_ENDPOINT`, or starts what
  it needs), and the suite runs it against the one local cluster it starts for the session.

A library notebook has a *light* run (no `AIS_ENDPOINT`, flagged cells skipped): part of the fast tier. A notebook
with flagged cells also has a *full* run (marked slow): every cell, on the session's AIStore when it has `ais`
cells. Its light run is a subset of that, so when both are selected (the whole suite) only the full one runs
(tests/conftest.py). Whether a notebook runs on AIStore is decided by its `ais` cells, never by a word in its text.

The tutorials run in full twice, because each runs all of its steps on one backend or the other: on AIStore here,
and on the embedded default in stock Jupyter (tests/test_jupyter.py). Each runs from a copy in a temporary folder,
so the two never share a `data/` folder. A tutorial cell flagged `#| no_store` reads no store (it trains from the
ImageFolder tree, or times local files): it does the same on either backend, so the AIStore run skips it and the
stock-Jupyter run proves it. `test_no_store_cells_read_no_store` holds them to that.

Every run is test-sized with `SHARDKIT_QUICK=1`: the notebooks that do heavy work read it in their first cells and
use fewer images, epochs or rounds (a reader gets the full size); every step and every check still runs."""
import ast, json, os, re, shutil
from pathlib import Path
import pytest
from notebook_runner import run_notebook_process

ROOT = Path(__file__).resolve().parents[1]
NBS_DIR = ROOT / "nbs"
NBS = sorted(p for p in NBS_DIR.rglob("*.ipynb")
             if not any(part.startswith((".", "_")) or part == "data" for part in p.relative_to(NBS_DIR).parts))
FLAG = re.compile(r"^#\|\s*(slow|ais)\s*$", re.M)


def cell_flags(nb: Path) -> set[str]:
    "The `slow`/`ais` flags used by the notebook's code cells."
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return {m for c in cells if c["cell_type"] == "code" for m in FLAG.findall("".join(c["source"]))}


def _id(p: Path) -> str: return p.relative_to(NBS_DIR).as_posix()


LIBRARY = [p for p in NBS if "tutorials" not in p.relative_to(NBS_DIR).parts]
TUTORIALS = [p for p in NBS if "tutorials" in p.relative_to(NBS_DIR).parts]
FLAGS = {p: cell_flags(p) for p in NBS}
FULL = [p for p in LIBRARY if FLAGS[p]]


def run_notebook(nb: Path, env: dict, force: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
    """Run `nb` the nbdev way in a fresh process (forked warm: tests/notebook_runner.py), test-sized: flagged cells
    skipped unless their flag is in `force`; cells flagged with one in `skip` skipped too."""
    rc, out = run_notebook_process(nb, {**env, "SHARDKIT_QUICK": "1"}, skip=("slow", "ais", *skip), force=force)
    assert rc == 0, f"{nb.name} failed (exit status {rc}):\n{out[-12000:]}"


def _local_env() -> dict: return {k: v for k, v in os.environ.items() if k != "AIS_ENDPOINT"}


@pytest.mark.parametrize("nb", LIBRARY, ids=_id)
def test_notebook_light(nb):
    "Every cell but the flagged ones, on the embedded default."
    run_notebook(nb, _local_env())


@pytest.mark.slow
@pytest.mark.parametrize("nb", [p for p in FULL if "ais" not in FLAGS[p]], ids=_id)
def test_notebook_full(nb):
    "Every cell, `slow` ones too, on the embedded default (the notebook has no AIStore cells)."
    run_notebook(nb, _local_env(), ("slow",))


# The random-access notebooks' full runs are on AIStore while it rebalances, in tests/test_faults_ais.py
# (test_targets_leave_and_join_mid_epoch): the session's cluster never rebalances.
WHILE_REBALANCING = ("27_random_access.ipynb", "36_bench.access.ipynb")


@pytest.mark.slow
@pytest.mark.parametrize("nb", [p for p in FULL if "ais" in FLAGS[p] and p.name not in WHILE_REBALANCING], ids=_id)
def test_notebook_full_on_aistore(nb, ais_endpoint):
    "Every cell, `slow` and `ais` ones too, with AIS_ENDPOINT pointing at the session's cluster."
    run_notebook(nb, {**os.environ, "AIS_ENDPOINT": ais_endpoint}, ("slow", "ais"))


PICKS_BACKEND = re.compile(r"^(ON_AIS|AIS) = bool\(os\.environ\.get\(\"AIS_ENDPOINT\"\)\)", re.M)


def tutorial_backends(nb: Path) -> str:
    """How a tutorial uses AIStore: "per backend" when its first cells pick the backend for every step (`ON_AIS =
    bool(os.environ.get("AIS_ENDPOINT"))`), so each backend is a different run; "ais cells" when a few cells flagged
    `#| ais` add AIStore to local steps, so one run with the cluster covers both; "local" when it has neither."""
    cells = ["".join(c["source"]) for c in json.loads(nb.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    if any(PICKS_BACKEND.search(s) for s in cells[:4]): return "per backend"
    return "ais cells" if "ais" in cell_flags(nb) else "local"


PER_BACKEND = [p for p in TUTORIALS if tutorial_backends(p) == "per backend"]


@pytest.mark.slow
@pytest.mark.parametrize("nb", PER_BACKEND, ids=_id)
def test_tutorial_on_aistore(nb, ais_endpoint, tmp_path):
    """The tutorial's every step on AIStore, from a copy in a folder of its own (its data/ goes there too). Its local
    run, and the one run of a tutorial with only a few `#| ais` cells, are tests/test_jupyter.py's (stock Jupyter)."""
    shutil.copy(nb, tmp_path / nb.name)
    run_notebook(tmp_path / nb.name, {**os.environ, "AIS_ENDPOINT": ais_endpoint}, ("slow", "ais"), ("no_store",))


STORE_NAMES = re.compile(r"\b(AIS|ON_AIS|DEST|SOURCE|store|shards|open_store|BUCKET|SHARDS)\b|ais://")


def test_no_store_cells_read_no_store():
    """A `#| no_store` cell (skipped on AIStore) names none of the variables a tutorial keeps its store in, and nothing
    a later cell needs comes only from it unless that cell is `no_store` too: the AIStore run would fail or, worse,
    skip a step that reads the store."""
    flagged = {}
    for nb in TUTORIALS:
        cells = ["".join(c["source"]) for c in json.loads(nb.read_text(encoding="utf-8"))["cells"]
                 if c["cell_type"] == "code"]
        for i, s in enumerate(cells):
            if not re.search(r"^#\|\s*no_store\s*$", s, re.M): continue
            flagged.setdefault(_id(nb), []).append(i)
            code = re.sub(r"(?s)\"[^\"\n]*\"|'[^'\n]*'", "", s)  # names, not words in strings ("--shards")
            assert not STORE_NAMES.search(code), f"{_id(nb)} code cell {i} is `no_store` but names a store: {s[:300]}"
            made = set(re.findall(r"^(\w+)\s*=", s, re.M)) | set(re.findall(r"^def (\w+)", s, re.M))
            for j, later in enumerate(cells[i + 1:], i + 1):
                if re.search(r"^#\|\s*no_store\s*$", later, re.M): continue
                used = {m for m in made if re.search(rf"\b{m}\b", later)}
                assert not used, f"{_id(nb)} code cell {j} uses {used} from `no_store` cell {i}: flag it too"
    assert flagged.get("tutorials/05_imagenet_training.ipynb"), flagged


def test_flags_are_explicit():
    "A notebook's `ais` cells are flagged; an unflagged cell that reads AIS_ENDPOINT would run on AIStore only by chance."
    loose = []
    for nb in LIBRARY:
        for i, c in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            s = "".join(c["source"])
            if c["cell_type"] == "code" and "#| export" not in s and 'os.environ.get("AIS_ENDPOINT")' in s and "ais" not in FLAG.findall(s):
                loose.append(f"{_id(nb)} cell {i}")
    for nb in TUTORIALS:
        if tutorial_backends(nb) == "per backend": continue
        for i, c in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            s = "".join(c["source"])
            if c["cell_type"] == "code" and "AIS_ENDPOINT" in s and "ais" not in FLAG.findall(s):
                loose.append(f"{_id(nb)} cell {i}")
    assert not loose, f"cells that read AIS_ENDPOINT without the `#| ais` flag: {loose}"
    test_eq = lambda a, b: (a == b) or pytest.fail(f"{a} != {b}")
    test_eq({_id(p): tutorial_backends(p) for p in TUTORIALS},
            {"tutorials/01_pets_shards.ipynb": "per backend", "tutorials/02_offload_etl.ipynb": "per backend",
             "tutorials/03_training_loader.ipynb": "per backend", "tutorials/04_webdataset_fundamentals.ipynb": "ais cells",
             "tutorials/05_imagenet_training.ipynb": "per backend", "tutorials/06_where_time_goes.ipynb": "per backend",
             "tutorials/07_s3_buckets.ipynb": "ais cells"})
    assert {_id(p) for p in FULL} >= {"07_stores.ais_cluster.ipynb", "39_demo.ipynb"}, sorted(_id(p) for p in FULL)


def _only_defines(stmt) -> bool:
    "A statement that only defines: an import, a function or class, or a name bound to a constant or a lambda."
    if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return True
    value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
    if value is None: return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)  # a docstring
    if isinstance(value, ast.Lambda): return True
    try: ast.literal_eval(value); return True
    except ValueError: return False


def test_docs_build_runs_no_flagged_work():
    """nbdev's docs processor runs every cell of a library notebook that imports something, flags or not: a `slow` or
    `ais` cell with an import in it runs its work in every docs build (one in 38_bench.gpu cost the suite's build
    11 CPU-s), and an `ais` one fails where no cluster runs. Such cells keep their imports in the import cell, or
    only define things."""
    heavy = []
    for nb in LIBRARY:
        for i, c in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            s = "".join(c["source"])
            if c["cell_type"] != "code" or not FLAG.search(s) or re.search(r"^#\|\s*eval:\s*false", s, re.M): continue
            tree = ast.parse("\n".join(line for line in s.splitlines() if not line.lstrip().startswith(("%", "!"))))
            if (any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree))
                    and not all(_only_defines(stmt) for stmt in tree.body)):
                heavy.append(f"{_id(nb)} cell {i}")
    assert not heavy, f"flagged cells the docs build would run (an import in them): {heavy}; move their imports up"


def test_while_rebalancing_names_notebooks():
    "The notebooks run while a rebalance runs exist (a rename would otherwise leave them out of every full run)."
    assert [n for n in WHILE_REBALANCING if not any(p.name == n for p in FULL)] == []
