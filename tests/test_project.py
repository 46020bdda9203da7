"""Project-level promises: the installed set is consistent, and the README's two commands are what CI runs."""
import re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pip_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_nbdev_2_pins():
    import nbdev, fastcore, execnb
    assert nbdev.__version__.startswith("2.3."), nbdev.__version__
    assert fastcore.__version__.startswith("1.8."), fastcore.__version__
    assert execnb.__version__.startswith("0.1."), execnb.__version__


def test_readme_quick_start_has_two_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    cmds = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert len(cmds) == 2 and all("\n" not in c for c in cmds), cmds
    assert "shardkit demo" in cmds[0] and "pytest" in cmds[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci and "SHARDKIT_REQUIRE_AIS=1" in ci
