"""Stock Jupyter runs every tutorial: `jupyter nbconvert --to notebook --execute` (nbclient, a fresh kernel, the
notebook's own folder as working directory: a copy in a temporary folder), and the executed notebook holds no error.

nbdev's runner is not the only way people run the tutorials: most open them in Jupyter and press Run All, which
knows nothing of nbdev's directives. So this test runs them the stock way:

- `#| slow` cells run, as they do under Run All (tests/test_notebooks.py runs them too, with `force_flags`).
- `#| eval: false` cells would run as well, since nbconvert ignores nbdev's directives. The house style keeps
  `eval: false` away from code that should work, so the tutorials have none; `test_no_eval_false_in_tutorials`
  keeps it that way, and says what to do if a tutorial ever needs one (mark it `#| slow`, or teach this test to
  skip it), rather than letting nbconvert run a cell the tutorial meant never to run.
- `SHARDKIT_QUICK=1`: each tutorial reads it in its first cell and runs test-sized (a reader gets the full size).
- Backends: a tutorial that picks its backend in its first cells (`ON_AIS = ...`) takes the local path here, and
  its AIStore run is tests/test_notebooks.py's. A tutorial with only a few `#| ais` cells runs once, here, with
  the session's cluster: that run covers its local steps and its AIStore cells.
- The kernel is `python3`, pointed at this interpreter with `shardkit.apps.lab.write_kernel`, so a kernel spec that
  another tool registered on the machine cannot change what is tested.
"""
import json, os, re, shutil, subprocess, sys, time
from pathlib import Path

import pytest
from test_notebooks import tutorial_backends

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "nbs" / "tutorials"
NBS = sorted(TUTORIALS.glob("*.ipynb"))
ON_AIS = [p for p in NBS if tutorial_backends(p) == "ais cells"]  # run once, on AIStore: covers both paths
LOCAL = [p for p in NBS if p not in ON_AIS]
EVAL_FALSE = re.compile(r"^\s*#\|\s*eval\s*:\s*false\s*$", re.M | re.I)


def _code_sources(nb: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(nb.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]


def test_tutorials_found():
    assert len(NBS) >= 5, f"expected the five tutorials in {TUTORIALS}, found {[p.name for p in NBS]}"


def test_no_eval_false_in_tutorials():
    "nbconvert would run `#| eval: false` cells: a tutorial must not have any (see the module docstring)."
    bad = [f"{nb.name}: {src.splitlines()[-1][:60]!r}" for nb in NBS for src in _code_sources(nb) if EVAL_FALSE.search(src)]
    assert not bad, ("tutorials with `#| eval: false` cells, which stock Jupyter (Run All, nbconvert) runs anyway: "
                     f"{bad}; make them work (mark slow ones `#| slow`) or skip them in tests/test_jupyter.py")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    "A Jupyter data folder whose `python3` kernel is this interpreter."
    pytest.importorskip("nbconvert", reason="the dev extra installs nbconvert: pip install -e '.[dev]'")
    pytest.importorskip("ipykernel", reason="the dev extra installs ipykernel: pip install -e '.[dev]'")
    from shardkit.apps.lab import write_kernel
    return write_kernel(tmp_path_factory.mktemp("jupyter-data"))


def _errors(nb: dict) -> list[str]:
    "Error outputs of an executed notebook, as `cell N: ename: evalue`."
    return [f"cell {i}: {o.get('ename')}: {o.get('evalue', '')[:200]}" for i, c in enumerate(nb["cells"])
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def _deprecations(nb: dict) -> list[str]:
    """DeprecationWarnings in an executed notebook's outputs, as `cell N: line`. Stock Jupyter shows those that the
    notebook's own calls trigger (shardkit warns with stacklevel=2, so a tutorial's `create_dataloader(shuffle=N)`
    is one): a tutorial must teach the current API, not print a warning at its reader."""
    return [f"cell {i}: {line.strip()[:200]}" for i, c in enumerate(nb["cells"]) for o in c.get("outputs", [])
            for line in "".join(o.get("text", "")).splitlines() if "DeprecationWarning" in line]


def _run_in_stock_jupyter(nb: Path, kernels: Path, tmp_path: Path, ais_endpoint: str | None = None):
    "Execute a copy of `nb` with nbconvert in a folder of its own; check it ran every cell without an error output."
    work = tmp_path / "work"  # a copy in a folder of its own: its data/ goes there, never shared with another run
    work.mkdir()
    shutil.copy(nb, work / nb.name)
    env = {k: v for k, v in os.environ.items() if k != "AIS_ENDPOINT"}
    env.update({"JUPYTER_PATH": os.pathsep.join(filter(None, [str(kernels), os.environ.get("JUPYTER_PATH")])),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "PYTHONWARNINGS": "ignore:pkg_resources is deprecated:UserWarning",
                "SHARDKIT_QUICK": "1"})  # test-sized: fewer images, fewer epochs and rounds; every step and check still runs
    if ais_endpoint: env["AIS_ENDPOINT"] = ais_endpoint
    cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--output-dir", str(tmp_path),
           "--ExecutePreprocessor.kernel_name=python3", "--ExecutePreprocessor.timeout=1200", str(work / nb.name)]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1700, stdin=subprocess.DEVNULL)
    took = time.time() - t0
    print(f"{nb.name}: {took:.0f} s under nbconvert")
    assert r.returncode == 0, f"{nb.name} failed under nbconvert after {took:.0f} s:\n{r.stderr[-8000:]}"
    out = tmp_path / nb.name
    assert out.is_file(), f"nbconvert wrote no {out}: {r.stderr[-2000:]}"
    executed = json.loads(out.read_text(encoding="utf-8"))
    assert not _errors(executed), f"{nb.name}: error outputs: {_errors(executed)}"
    assert not _deprecations(executed), f"{nb.name}: deprecated calls: {_deprecations(executed)}"
    code = [c for c in executed["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code and all(c.get("execution_count") for c in code), f"{nb.name}: cells left unexecuted"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nb", LOCAL, ids=[p.stem for p in LOCAL])
def test_tutorial_runs_in_stock_jupyter(nb, kernels, tmp_path):
    "On the embedded default: each step of a per-backend tutorial takes the local path (its AIStore run is test_notebooks')."
    _run_in_stock_jupyter(nb, kernels, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nb", ON_AIS, ids=[p.stem for p in ON_AIS])
def test_tutorial_runs_in_stock_jupyter_on_aistore(nb, kernels, tmp_path, ais_endpoint):
    "A tutorial with a few AIStore cells runs once, with the cluster: its local steps and its AIStore cells."
    _run_in_stock_jupyter(nb, kernels, tmp_path, ais_endpoint)
