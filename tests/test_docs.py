"""The docs site: `shardkit docs` builds it offline, and headless Chromium finds a page for every notebook,
every image loaded, and nothing fetched from another host. Also `shardkit docs execute`."""
import base64, functools, http.server, io, json, os, re, shutil, subprocess, sys, threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from shardkit import docs

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
OUT = ROOT / "tests" / "_out"
from conftest import CHROMEDRIVER, CHROMIUM, headless_chromium

# the site is built once, in a module fixture: under pytest-xdist every test of it runs on one worker, or each
# worker that takes one would build the site again (about a minute of the suite)
pytestmark = pytest.mark.xdist_group("docs")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    "The site, built offline from the repository's notebooks, and what the build printed."
    site = tmp_path_factory.mktemp("docs") / "site"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = docs.docs_cli(out=str(site), nbs=str(NBS), offline=True, execute=False)
    assert rc == 0, f"shardkit docs failed ({rc}):\n{out.getvalue()}\n{err.getvalue()}"
    return site, out.getvalue(), err.getvalue()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope="module")
def server(built):
    "The site served on 127.0.0.1 (a free port) for the test's duration."
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(built[0])))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_port}/"
    httpd.shutdown(); httpd.server_close(); t.join(5)


@pytest.fixture(scope="module")
def browser():
    "Debian's headless Chromium, driven by selenium through Debian's chromedriver (no driver download)."
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"the docs test needs headless Chromium, but {' and '.join(missing)} is missing: "
                    "install it with `apt-get install -y chromium chromium-driver`")
    with headless_chromium(page_load_timeout=30, extra_args=["--hide-scrollbars"]) as drv: yield drv


def _open(browser, url):
    "Load `url` and wait until its images have loaded or failed."
    browser.get(url)
    browser.execute_async_script("""const done = arguments[arguments.length - 1];
        Promise.all([...document.images].map(i => i.complete ? 0 : new Promise(r => { i.onload = i.onerror = r; })))
               .then(() => done());""")


def _images(browser):
    "(src, naturalWidth) of every <img> on the page."
    return browser.execute_script("return [...document.images].map(i => [i.currentSrc.slice(0, 80), i.naturalWidth]);")


def _requests(browser):
    "URLs the browser requested since the last call (from Chromium's performance log)."
    urls = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent": urls.append(msg["params"]["request"]["url"])
    return urls


@pytest.mark.slow
def test_build_processes_every_notebook(built):
    "nbdev's processing worked on every notebook (a failure here would stop `nbdev_docs` too)."
    site, out, err = built
    assert "could not process" not in err, err[err.find("warning:"):]
    assert f"the site is in {site}" in out and "python -m http.server" in out


@pytest.fixture(scope="module")
def visits(server, browser):
    """Every notebook's page, opened once: {notebook: (page, h1 text, [(img src, naturalWidth)], [requested URLs])}.
    The search box's index is left out of these visits: the theme's search worker builds a lunr index of the whole
    site (1.7 MB) on every page load, half a second of CPU a page here, so test_search_finds_pages tries it once."""
    _requests(browser)  # start the request log here
    res = {}
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": SEARCH_ASSETS})
    try:
        for rel in docs.find_notebooks(NBS):
            page = docs.page_path(rel).as_posix()
            _open(browser, server + page)
            h1 = browser.execute_script("const h = document.querySelector('article h1'); return h ? h.textContent : null;")
            res[rel] = (page, (h1 or "").strip().rstrip("¶").strip(), _images(browser), _requests(browser))
    finally: browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
    return res


SEARCH_ASSETS = ["*/search/search_index.json", "*/assets/javascripts/workers/search.*"]


@pytest.mark.slow
def test_search_finds_pages(server, browser):
    "The search box, offline: a word finds the pages that use it, and the search fetches nothing from another host."
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    _requests(browser)  # the log from here: the page, its search worker and the index it fetches
    _open(browser, server)
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    browser.execute_script("arguments[0].focus()", box)
    box.send_keys("dsort")
    found = WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a"))
    pages = {a.get_attribute("href")[len(server):].split("#")[0] for a in found}
    assert "shuffle.html" in pages, pages
    urls = _requests(browser)
    assert any(u.endswith("search_index.json") for u in urls), urls  # the index came from the site itself
    foreign = [u for u in urls if u.startswith(("http:", "https:", "ws:", "wss:", "//")) and not u.startswith(server)]
    assert not foreign, f"the search fetched from other hosts: {foreign[:5]}"


@pytest.mark.slow
def test_every_notebook_has_a_page(built, server, browser, visits):
    "A page per notebook, titled with the notebook's H1, and a link to each in the sidebar."
    site, rels = built[0], docs.find_notebooks(NBS)
    assert Path("index.ipynb") in rels and Path("98_docs.ipynb") in rels
    assert set(visits) == set(rels)
    _open(browser, server)
    sidebar = set(browser.execute_script(
        "return [...document.querySelectorAll('.md-sidebar--primary a.md-nav__link')].map(a => a.href);"))
    for rel, (page, h1, _, _) in visits.items():
        assert (site / page).is_file(), f"no page for {rel}"
        assert server + page in sidebar or (page == "index.html" and server in sidebar), f"{rel} is missing from the sidebar"
        assert h1 == docs.notebook_title(NBS / rel).replace("`", "").replace("*", ""), f"{page}: title {h1!r}"


@pytest.mark.slow
def test_images_load(visits):
    "Every <img> on every page has loaded (naturalWidth > 0): on the index and on docs.html at least one."
    with_figures = []
    for rel, (page, _, imgs, _) in visits.items():
        broken = [src for src, w in imgs if not w]
        assert not broken, f"{page}: images that did not load: {broken}"
        if imgs: with_figures.append(page)
    assert "index.html" in with_figures, "the index shows no image (the pipeline diagram)"
    assert "docs.html" in with_figures, "docs.html, the figure-bearing page, shows no image: was nbs/98_docs.ipynb committed executed?"
    display = next((v for rel, v in visits.items() if rel.as_posix() == "12_display.ipynb"), None)
    assert display is not None and display[1] == "Looking at shards"
    assert sum(1 for _, w in display[2] if w) >= 3, f"'Looking at shards' shows {len(display[2])} pictures: commit nbs/12_display.ipynb executed"


@pytest.mark.slow
def test_nothing_loads_from_other_hosts(built, server, visits):
    assert docs.external_refs(built[0]) == []
    urls = [u for v in visits.values() for u in v[3]]
    assert any(u.startswith(server) for u in urls)
    foreign = [u for u in urls if u.startswith(("http:", "https:", "ws:", "wss:", "//")) and not u.startswith(server)]
    assert not foreign, f"the pages fetched from other hosts: {foreign[:5]}"


PAGE_MB = 2
_IMG_SRC = re.compile(r"""<img\b[^>]*?\bsrc\s*=\s*["']([^"'#?]+)""", re.I)


def page_weight(site: Path, page: Path) -> int:
    "Bytes a browser loads for `page`: the HTML (mkdocs-jupyter inlines figures into it) and the local images it shows."
    html = page.read_text(encoding="utf-8")
    imgs = {(page.parent / src).resolve() for src in _IMG_SRC.findall(html) if not re.match(r"^[a-z]+:|^//", src, re.I)}
    return page.stat().st_size + sum(f.stat().st_size for f in imgs if f.is_file())


@pytest.mark.slow
def test_no_page_over_budget(built):
    "No page is heavier than 2 MB: figures are stored at the size shown, photos as JPEG (tests/test_budget.py)."
    site = built[0]
    weights = {p.relative_to(site).as_posix(): page_weight(site, p) for p in site.rglob("*.html")}
    assert len(weights) > 5 and max(weights.values()) > 10_000
    heavy = {p: f"{w / 1e6:.2f} MB" for p, w in weights.items() if w > PAGE_MB * 1e6}
    assert not heavy, f"pages over {PAGE_MB} MB: {heavy}; shrink the notebooks' figures: shardkit docs shrink NOTEBOOK.ipynb"


@pytest.mark.slow
def test_no_broken_links(built):
    "Links between pages lead somewhere (the index links to every tutorial)."
    assert docs.broken_links(built[0]) == []


@pytest.mark.slow
def test_index_screenshot(server, browser):
    OUT.mkdir(parents=True, exist_ok=True)
    _open(browser, server)
    shot = OUT / "docs-index.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000
    assert browser.execute_script("return document.querySelector('.md-sidebar--primary').offsetWidth") > 100, "no sidebar"


def test_docs_cli_bad_out(tmp_path, capsys):
    "`shardkit docs` refuses an --out it would have to empty (a file, a folder of other things, the checkout)."
    from shardkit.apps.cli import main
    f = tmp_path / "a-file"
    f.write_text("x")
    assert main(["docs", "--out", str(f), "--offline"]) == 2
    assert "is a file" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    assert main(["docs", "--out", str(tmp_path / "mine")]) == 2
    assert "other files in it" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.md").read_text() == "keep me"
    assert main(["docs", "--out", str(ROOT), "--nbs", str(NBS)]) == 2
    assert "contains the notebooks" in capsys.readouterr().err
    assert main(["docs", "--nbs", str(tmp_path / "no-such-nbs")]) == 2
    assert "does not exist" in capsys.readouterr().err



def test_docs_cli_names_the_missing_install(tmp_path, monkeypatch, capsys):
    "Without mkdocs (blocked: `import mkdocs` fails), `shardkit docs` stops before any work and names the install."
    from shardkit.apps.cli import main
    monkeypatch.setitem(sys.modules, "mkdocs", None)
    assert main(["docs", "--offline", "--out", str(tmp_path / "site"), "--nbs", str(NBS)]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and ": mkdocs. Install the docs extra" in err, err  # mkdocs alone is missing
    assert 'pip install -e ".[docs]"' in err and 'pip install "shardkit[docs]"' in err, err
    assert not (tmp_path / "site").exists()


def test_docs_cli_fails_when_a_notebook_cannot_be_processed(tmp_path, capsys):
    "A notebook nbdev cannot process stops the build: exit 1, the count, the notebook and why; no site."
    proj = tmp_path / "proj"
    (proj / "nbs").mkdir(parents=True)
    shutil.copy(ROOT / "settings.ini", proj)
    import nbformat
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Fine")]), proj / "nbs" / "index.ipynb")
    _nb(proj / "nbs" / "01_broken.ipynb", "#| export\nraise ValueError('broken on purpose')")
    assert docs.docs_cli(out=str(tmp_path / "site"), nbs=str(proj / "nbs"), offline=True, execute=False) == 1
    err = capsys.readouterr().err
    assert "could not process 1 of 2 notebook(s)" in err and "01_broken.ipynb: " in err and "broken on purpose" in err, err
    assert not (tmp_path / "site").exists()

def _nb(path, *sources):
    import nbformat
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)


def _run_execute(*args):
    return subprocess.run([sys.executable, "-m", "shardkit", "docs", "execute", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_execute_in_place(tmp_path):
    """`shardkit docs execute` saves outputs (figures too), with the notebook's folder as working directory;
    a notebook with a failing cell is left as it was and the exit code says so."""
    (tmp_path / "data.txt").write_text("from the notebook's folder")
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    _nb(good, "print(open('data.txt').read())",
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3]); plt.title('a line');",
        "#| eval: false\nraise SystemExit('never run')")
    _nb(bad, "1 / 0")
    before = bad.read_text()
    r = _run_execute(bad, good)
    assert r.returncode == 1, r.stderr
    assert "ZeroDivisionError" in r.stderr and "FAILED: " in r.stderr
    assert bad.read_text() == before
    cells = json.loads(good.read_text())["cells"]
    assert cells[0]["outputs"][0]["text"] == ["from the notebook's folder\n"]
    pngs = [o["data"]["image/png"] for o in cells[1]["outputs"] if "image/png" in o.get("data", {})]
    assert pngs, cells[1]["outputs"]  # a line plot stays PNG
    from PIL import Image
    assert Image.open(io.BytesIO(base64.b64decode("".join(pngs[0])))).width < 800, "the figure was drawn at 2x (retina), not 1x"
    assert cells[2]["outputs"] == []


def test_execute_bad_input(tmp_path, capsys):
    "`shardkit docs execute` refuses a path that is not a notebook before executing anything; a wrong word is a usage error."
    from shardkit.apps.cli import main
    assert main(["docs", "execute", str(tmp_path / "missing.ipynb")]) == 2
    assert "shardkit docs execute: no such notebook" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e: main(["docs", "run", "x.ipynb"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "shardkit docs: unexpected 'run x.ipynb' (`shardkit docs --help` lists its options)\n", err


def test_quarto_renderer_when_quarto_exists(tmp_path, monkeypatch, capsys):
    """With `quarto` on PATH, `shardkit docs` runs nbdev's pipeline and `quarto render` in `_proc/`, then copies the
    site to --out. Quarto itself cannot be installed here, so a stand-in `quarto` on PATH records how it was called."""
    proj = tmp_path / "proj"
    (proj / "nbs").mkdir(parents=True)
    shutil.copy(ROOT / "settings.ini", proj)
    shutil.copytree(ROOT / "shardkit", proj / "shardkit", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ["index.ipynb", "99_cli.ipynb", "_quarto.yml", "nbdev.yml", "styles.css"]: shutil.copy(NBS / f, proj / "nbs")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "quarto").write_text('#!/bin/sh\necho "$@" > called.txt\nmkdir -p _docs && ls > _docs/inputs.txt && '
                                 'echo "<html>rendered by quarto</html>" > _docs/index.html\n')
    (bin_ / "quarto").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    assert docs.docs_cli(out=str(tmp_path / "site"), nbs=str(proj / "nbs"), offline=False, execute=False) == 0
    assert "rendering with Quarto" in capsys.readouterr().out
    assert (proj / "_proc" / "called.txt").read_text().split() == ["render", "--no-cache"]
    assert "rendered by quarto" in (tmp_path / "site" / "index.html").read_text()
    inputs = (tmp_path / "site" / "inputs.txt").read_text().split()
    assert {"index.ipynb", "99_cli.ipynb", "_quarto.yml", "sidebar.yml"} <= set(inputs)
    assert (proj / "nbs" / "sidebar.yml").exists()


def test_shrink_cli(tmp_path):
    "`shardkit docs shrink` brings a committed retina photo figure down to its shown size, as JPEG, in place."
    import nbformat
    import numpy as np
    from PIL import Image
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (12, 16, 3), dtype=np.uint8)).resize((800, 600), Image.BICUBIC)
    b = io.BytesIO(); photo.convert("RGBA").save(b, "PNG")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("show()")])
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(b.getvalue()).decode()},
                                                  metadata={"image/png": {"width": 400, "height": 300}})]
    p = tmp_path / "retina.ipynb"
    nbformat.write(nb, p)
    before = p.stat().st_size
    r = subprocess.run([sys.executable, "-m", "shardkit", "docs", "shrink", str(p)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "MB ->" in r.stdout
    out = nbformat.read(p, as_version=4).cells[0].outputs[0]
    assert list(out.data) == ["image/jpeg"] and out.metadata == {"image/jpeg": {"width": 400, "height": 300}}
    assert Image.open(io.BytesIO(base64.b64decode(out.data["image/jpeg"]))).size == (400, 300)
    assert p.stat().st_size < before / 3
