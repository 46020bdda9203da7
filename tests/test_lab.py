"""The real Jupyter client: JupyterLab (started by the same command line `shardkit lab` uses) on 127.0.0.1 with a
token, Debian's headless Chromium driven by selenium opens a notebook, runs every cell through the Run menu, and
the test checks what a person would see: every cell executed, no traceback, every figure drawn.

The notebook is copied into a temporary root folder with its outputs removed, so a figure on the page can only
come from this run. JupyterLab gets its own settings, workspace and runtime folders: the news prompt and update
check are off (nothing leaves 127.0.0.1; the browser's requests are checked), and notebook windowing is off so
every cell is in the page. Everything started is stopped at the end, kernels first.
Skips when Chromium, chromedriver or JupyterLab is missing, unless SHARDKIT_REQUIRE_BROWSER=1."""
import contextlib, json, os, signal, socket, subprocess, sys, time, urllib.error, urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a browser and JupyterLab
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "_out"
# A small notebook that draws figures (a few seconds of work): what is tested is the client, JupyterLab in a browser,
# not the notebook (every tutorial runs in stock Jupyter in tests/test_jupyter.py). SHARDKIT_LAB_NOTEBOOK picks
# another, relative to nbs/ (e.g. tutorials/04_webdataset_fundamentals.ipynb).
TUTORIAL = ROOT / "nbs" / os.environ.get("SHARDKIT_LAB_NOTEBOOK", "08_synth.ipynb")
from conftest import CHROMEDRIVER, CHROMIUM, headless_chromium
RUN_LIMIT_S = 900  # the notebook takes seconds on a quiet 2-core machine; a tutorial about a minute, several times that under load


def _need(ok: bool, what: str):
    if ok: return
    if os.environ.get("SHARDKIT_REQUIRE_BROWSER") == "1": pytest.fail(what)
    pytest.skip(what + " (set SHARDKIT_REQUIRE_BROWSER=1 to make this a failure)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}/api/{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
        return json.loads(body) if body else None


def _settings(folder: Path):
    "JupyterLab user settings: no news prompt or update check (no traffic off this machine), every cell in the DOM."
    for plugin, values in {"@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
                           "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"}}.items():
        f = folder / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    "JupyterLab serving a copy of the notebook: (base URL, token, notebook name); stopped, kernels too, afterwards."
    from importlib.util import find_spec
    _need(find_spec("jupyterlab") is not None and find_spec("ipykernel") is not None,
          "JupyterLab is not installed: pip install -e '.[lab]'")
    from shardkit.apps.lab import lab_command, write_kernel
    import nbformat
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"; root.mkdir()
    nb = nbformat.read(TUTORIAL, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code": c.outputs, c.execution_count = [], None
    nbformat.write(nb, root / TUTORIAL.name)
    _settings(tmp / "settings")
    port, token = _free_port(), "shardkit-test-" + os.urandom(8).hex()
    argv, env = lab_command(root, port, token=token, kernels=write_kernel(tmp / "data"))
    env.update(JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore:pkg_resources is deprecated:UserWarning")
    log = open(tmp / "jupyterlab.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited ({proc.returncode}):\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
            try:
                _api(base, token, "status"); break
            except OSError:
                if time.time() > deadline: raise AssertionError("JupyterLab did not answer on /api/status within 180 s")
                time.sleep(1)
        yield base, token, TUTORIAL.name
    finally:
        try:
            for k in _api(base, token, "kernels") or []: _api(base, token, f"kernels/{k['id']}", "DELETE")
        except OSError: pass
        proc.terminate()  # Jupyter stops cleanly on SIGTERM (SIGINT may be ignored when started in the background)
        try: proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL); proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def browser():
    "Debian's headless Chromium through Debian's chromedriver (selenium never downloads a driver)."
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    _need(not missing, f"{' and '.join(missing)} missing: apt-get install -y chromium chromium-driver")
    with headless_chromium(page_load_timeout=120) as drv: yield drv


def _wait(what: str, fn, limit: float, every: float = 1.0):
    "Call `fn` until it returns something truthy; fail after `limit` seconds saying what did not happen."
    deadline = time.time() + limit
    while time.time() < deadline:
        v = fn()
        if v: return v
        time.sleep(every)
    raise AssertionError(f"{what} did not happen within {limit:.0f} s")


def _dismiss_prompts(drv):
    "Close the 'get notified about official Jupyter news?' toast if JupyterLab shows it anyway."
    drv.execute_script("""for (const b of document.querySelectorAll('.Toastify button, .jp-toast-button'))
                              if (/^\\s*no\\s*$/i.test(b.textContent)) b.click();""")


def _click_menu(drv, menu: str, label: str):
    "Open the top menu `menu` and click its item `label`, as a person would."
    from selenium.webdriver.common.by import By
    items = [e for e in drv.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item") if e.text.strip() == menu]
    assert items, f"no {menu!r} menu in JupyterLab's menu bar"
    items[0].click()
    labels = lambda: {e.text.strip(): e for e in drv.find_elements(By.CSS_SELECTOR, ".lm-Menu-content > .lm-Menu-item")
                      if e.text.strip()}
    try: _wait(f"the {menu} menu showing {label!r}", lambda: any(t.startswith(label) for t in labels()), 20, 0.2)
    except AssertionError as e: raise AssertionError(f"{e}; it shows {sorted(labels())}") from None
    next(el for t, el in labels().items() if t.startswith(label)).click()


_STATE = """return [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].map(c => {
    const p = c.querySelector('.jp-InputPrompt');
    return p ? p.textContent.trim() : '';
});"""


def test_run_all_in_jupyterlab(jupyterlab, browser):
    base, token, name = jupyterlab
    nb = json.loads(TUTORIAL.read_text(encoding="utf-8"))
    n_code = sum(1 for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip())
    n_figures = sum(1 for c in nb["cells"] for o in c.get("outputs", []) if any(k.startswith("image/") for k in o.get("data", {})))
    t0 = time.time()
    browser.get_log("performance")
    browser.get(f"{base}/lab/tree/{name}?token={token}")
    _wait("the notebook opening", lambda: len(browser.execute_script(_STATE)) >= n_code, 180)
    def kernel_idle():  # a notebook without kernel metadata asks which kernel: the default (this Python's) is fine
        browser.execute_script("document.querySelectorAll('.jp-Dialog .jp-mod-accept').forEach(b => b.click());")
        return any(s["kernel"]["execution_state"] == "idle" for s in _api(base, token, "sessions"))
    _wait("the kernel starting (idle)", kernel_idle, 180)
    _dismiss_prompts(browser)
    _click_menu(browser, "Run", "Run All Cells")

    def errors():
        return browser.execute_script("""return [...document.querySelectorAll(
            '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
            .map(e => e.textContent).filter(t => /Traceback|^\\s*\\S*Error\\b/m.test(t)).map(t => t.slice(0, 600));""")

    def executed():
        prompts = browser.execute_script(_STATE)  # "[ ]:" not run, "[*]:" running or queued, "[7]:" done
        if any("*" in p for p in prompts): return None
        return sum(1 for p in prompts if p.strip("[]: ").isdigit())

    def finished():  # JupyterLab stops Run All at the first error, so an error also ends the wait
        n = executed()
        idle = all(s["kernel"]["execution_state"] == "idle" for s in _api(base, token, "sessions"))
        return n is not None and idle and (n >= n_code or errors())
    _wait("every cell executed and the kernel idle", finished, RUN_LIMIT_S, 2)
    took = time.time() - t0
    print(f"{name}: opened and run in JupyterLab in {took:.0f} s")
    assert not errors(), f"{name}: cells failed in JupyterLab:\n" + "\n---\n".join(errors())
    assert executed() >= n_code, f"{name}: {executed()} of {n_code} cells executed"
    imgs = browser.execute_script("""return [...document.querySelectorAll('.jp-OutputArea-output img')].map(
        i => [i.naturalWidth, i.naturalHeight]);""")
    assert len(imgs) >= n_figures > 0, f"{name}: {len(imgs)} figures on the page, the notebook draws {n_figures}"
    assert all(w > 0 and h > 0 for w, h in imgs), f"{name}: figures that did not render: {imgs}"

    OUT.mkdir(parents=True, exist_ok=True)
    browser.execute_script("""const imgs = document.querySelectorAll('.jp-OutputArea-output img');
        imgs[imgs.length - 1].scrollIntoView({block: 'center'});""")
    time.sleep(1)
    shot = OUT / f"lab-{TUTORIAL.stem}.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000

    urls = [json.loads(e["message"])["message"]["params"].get("request", {}).get("url", "")
            for e in browser.get_log("performance")
            if json.loads(e["message"])["message"]["method"] == "Network.requestWillBeSent"]
    foreign = [u for u in urls if u.startswith(("http:", "https:", "ws:", "wss:")) and not u.split("/")[2].startswith("127.0.0.1:")]
    assert any(u.startswith(base) for u in urls) and not foreign, f"requests off 127.0.0.1: {foreign[:5]}"


def test_lab_serves_with_token_and_stops(tmp_path):
    """`lab()` itself, as `shardkit lab` runs it: prints a URL with a token, serves the folder on 127.0.0.1 with this
    Python's kernel, refuses requests without the token, and a SIGTERM to it stops the server as well."""
    from importlib.util import find_spec
    _need(find_spec("jupyterlab") is not None, "JupyterLab is not installed: pip install -e '.[lab]'")
    (tmp_path / "nbs").mkdir()
    (tmp_path / "nbs" / "hello.ipynb").write_text(TUTORIAL.read_text(encoding="utf-8"))
    port = _free_port()
    code = f"import sys; from shardkit.apps.lab import lab; sys.exit(lab({str(tmp_path / 'nbs')!r}, port={port}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "PYTHONWARNINGS": "ignore"}
    log = tmp_path / "lab.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        url = _wait("the URL printed", lambda: next((w for w in log.read_text().split() if w.startswith(f"{base}/lab?token=")), None), 60)
        token = url.split("token=")[1]
        assert len(token) >= 32
        def up():
            try: return _api(base, token, "status") is not None
            except OSError: return False
        _wait("JupyterLab answering", up, 180)
        assert [c["name"] for c in _api(base, token, "contents")["content"]] == ["hello.ipynb"]
        spec = _api(base, token, "kernelspecs")["kernelspecs"]["python3"]["spec"]
        assert spec["argv"][0] == sys.executable, spec
        with pytest.raises(urllib.error.HTTPError) as e: _api(base, "wrong-token", "contents")
        assert e.value.code == 403
        proc.terminate()  # SIGTERM to `lab`, as a service manager or `kill` would send
        # `lab` forwards SIGTERM to Jupyter and exits with its status: 0 when it stopped cleanly; a `lab` that the
        # signal killed instead (no handler) exits with -15 and leaves the server running (caught just below, too)
        code = proc.wait(60)
        assert code == 0, f"`lab` exited {code} after SIGTERM (-15: killed by it):\n{log.read_text()[-2000:]}"
        def down():
            try: _api(base, token, "status"); return False
            except OSError: return True
        _wait("the server stopping with `lab`", down, 30)
    finally:  # the whole session: a `lab` killed by the signal leaves its Jupyter running in it
        with contextlib.suppress(ProcessLookupError): os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
