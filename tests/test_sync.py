"""Everything under shardkit/ that nbdev writes is generated from nbs/: exporting the committed notebooks into an
empty copy of the package must reproduce every module of every subpackage exactly, with no file on one side only;
and the notebooks must already be clean (nbdev_clean changes nothing)."""
import filecmp, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The only files under shardkit/ that no notebook writes: the C source of the window decoder (22_jpeg reads it; setup.py
# compiles it), the reference pixels its loading checks it against (22_jpeg's write_jpeg_reference writes them, its tests
# check them against torchvision), every command's --help kept as data (99_cli's write_help_table writes it,
# tests/test_cli.py checks it) and the empty __init__.py that makes its folder a package (nbdev adds __init__.py
# only beside .py files).
HAND_WRITTEN = {"native/__init__.py", "native/jpeg_window.c", "native/jpeg_reference.npz", "apps/command_help.json"}
BUILT = ("__pycache__", "*.pyc", "*.so")  # what Python and `pip install -e .` leave in the tree; git ignores them


def _copy_project(dst: Path) -> Path:
    for name in ("settings.ini", "setup.py", "README.md"): shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "nbs", dst / "nbs", ignore=shutil.ignore_patterns("data", ".ipynb_checkpoints", "_*"))
    shutil.copytree(ROOT / "shardkit", dst / "shardkit", ignore=shutil.ignore_patterns(*BUILT))
    return dst


def _nbdev(cmd: str, cwd: Path):
    exe = Path(sys.executable).parent / cmd  # the console script installed beside this Python
    r = subprocess.run([str(exe) if exe.exists() else cmd], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def package_files(pkg: Path) -> set[str]:
    "Every file under `pkg`, recursively, as a path relative to it, without what Python and pip build there."
    skip = lambda p: "__pycache__" in p.parts or p.suffix in (".pyc", ".so")
    return {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file() and not skip(p)}


def export_fresh(tmp_path: Path) -> Path:
    "A copy of the project whose package holds only HAND_WRITTEN before `nbdev_export` runs in it; returns its package."
    proj = _copy_project(tmp_path)
    for rel in package_files(proj / "shardkit") - HAND_WRITTEN: (proj / "shardkit" / rel).unlink()
    _nbdev("nbdev_export", proj)
    return proj / "shardkit"


def compare_packages(committed: Path, exported: Path) -> list[str]:
    "What differs between two package trees: files on one side only, and files whose bytes differ."
    a, b = package_files(committed), package_files(exported)
    return ([f"{n}: committed, but no notebook exports it" for n in sorted(a - b)]
            + [f"{n}: a notebook exports it, but it is not committed" for n in sorted(b - a)]
            + [f"{n}: differs from what its notebook exports" for n in sorted(a & b)
               if not filecmp.cmp(committed / n, exported / n, shallow=False)])


def test_modules_match_notebooks(tmp_path):
    exported = export_fresh(tmp_path)
    some = {"apps/cli.py", "ingest/pets.py", "etl/shard_transform.py", "loading/stream.py", "shards/write.py", "bench/loader.py"}
    assert some <= package_files(exported), "nbdev_export wrote no modules into the subpackages: is it nbdev 2?"
    problems = "\n".join(compare_packages(ROOT / "shardkit", exported))
    assert not problems, f"shardkit/ differs from what the notebooks export (edit the notebook, export):\n{problems}"


def test_sync_sees_every_subpackage(tmp_path):
    "The comparison itself: a hand edit, a stray module and a missing module, each in a subpackage, are all reported."
    committed = shutil.copytree(ROOT / "shardkit", tmp_path / "committed", ignore=shutil.ignore_patterns(*BUILT))
    exported = shutil.copytree(committed, tmp_path / "exported")
    assert compare_packages(committed, exported) == []
    with open(committed / "etl" / "shard_transform.py", "a") as f: f.write("\nx = 1  # a hand edit\n")
    (committed / "loading" / "stray.py").write_text("")
    (exported / "shards" / "write.py").unlink()
    assert compare_packages(committed, exported) == [
        "loading/stray.py: committed, but no notebook exports it",
        "shards/write.py: committed, but no notebook exports it",
        "etl/shard_transform.py: differs from what its notebook exports"]


def test_notebooks_are_clean(tmp_path):
    proj = _copy_project(tmp_path)
    _nbdev("nbdev_clean", proj)
    dirty = [str(p.relative_to(proj)) for p in (proj / "nbs").rglob("*.ipynb")
             if p.read_bytes() != (ROOT / p.relative_to(proj)).read_bytes()]
    assert not dirty, f"run nbdev_clean and commit: {dirty}"
