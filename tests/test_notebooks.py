"""The notebooks are the other half of the suite: each one runs from a fresh kernel, as `nbdev_test` does
(directives honoured, `slow` cells included). A notebook that mentions AIS_ENDPOINT runs twice: on the
embedded default, and against the session's real local AIStore cluster. The tutorials' embedded-default run is
tests/test_jupyter.py's: it executes them from a fresh kernel in stock Jupyter (nbconvert), every cell, `slow`
ones too, which proves what a run here would and more, so they are not run a third time here."""
import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = sorted(p for p in (ROOT / "nbs").rglob("*.ipynb")
             if not any(part.startswith((".", "_")) for part in p.relative_to(ROOT / "nbs").parts))
AIS_NBS = [p for p in NBS if "AIS_ENDPOINT" in p.read_text()]


def _run_nb(nb: Path, env: dict) -> None:
    code = ("import sys; from pathlib import Path; from nbdev.test import test_nb; "
            "ok, t = test_nb(Path(sys.argv[1]), force_flags=['slow'], do_print=False); sys.exit(0 if ok else 1)")
    r = subprocess.run([sys.executable, "-c", code, str(nb)], capture_output=True, text=True, timeout=1500,
                       cwd=nb.parent, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{nb.relative_to(ROOT)} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


LOCAL_NBS = [p for p in NBS if "tutorials" not in p.relative_to(ROOT / "nbs").parts]


@pytest.mark.parametrize("nb", LOCAL_NBS, ids=[str(p.relative_to(ROOT / "nbs")) for p in LOCAL_NBS])
def test_notebook_local(nb):
    env = {k: v for k, v in os.environ.items() if k != "AIS_ENDPOINT"}
    _run_nb(nb, env)


@pytest.mark.parametrize("nb", AIS_NBS, ids=[str(p.relative_to(ROOT / "nbs")) for p in AIS_NBS])
def test_notebook_on_aistore(nb, ais_endpoint):
    _run_nb(nb, {**os.environ, "AIS_ENDPOINT": ais_endpoint})
