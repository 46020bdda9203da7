"""shardkit/*.py is generated from nbs/: exporting the committed notebooks must reproduce it exactly,
and the notebooks must already be clean (nbdev_clean changes nothing)."""
import filecmp, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copy_project(dst: Path) -> Path:
    for name in ("settings.ini", "setup.py", "README.md"): shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "nbs", dst / "nbs", ignore=shutil.ignore_patterns("data", ".ipynb_checkpoints", "_*"))
    shutil.copytree(ROOT / "shardkit", dst / "shardkit", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _nbdev(cmd: str, cwd: Path):
    exe = Path(sys.executable).parent / cmd  # the console script installed beside this Python
    r = subprocess.run([str(exe) if exe.exists() else cmd], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_modules_match_notebooks(tmp_path):
    proj = _copy_project(tmp_path)
    for py in (proj / "shardkit").glob("*.py"):
        if py.name != "__init__.py": py.unlink()  # export must recreate every module from the notebooks alone
    _nbdev("nbdev_export", proj)
    committed = sorted(p.name for p in (ROOT / "shardkit").glob("*.py"))
    exported = sorted(p.name for p in (proj / "shardkit").glob("*.py"))
    assert exported == committed, f"modules without a notebook or notebooks without a module: {set(committed) ^ set(exported)}"
    stale = [n for n in committed if not filecmp.cmp(ROOT / "shardkit" / n, proj / "shardkit" / n, shallow=False)]
    assert not stale, f"these modules differ from what their notebooks export (run nbdev_export and commit): {stale}"


def test_notebooks_are_clean(tmp_path):
    proj = _copy_project(tmp_path)
    _nbdev("nbdev_clean", proj)
    dirty = [str(p.relative_to(proj)) for p in (proj / "nbs").rglob("*.ipynb")
             if p.read_bytes() != (ROOT / p.relative_to(proj)).read_bytes()]
    assert not dirty, f"run nbdev_clean and commit: {dirty}"
