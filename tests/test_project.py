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


def _command_after(marker: str) -> str:
    "The command in the fenced block right after `<!-- marker -->` in the README (as .ci/run reads the test command)."
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", text)
    assert m, f"README.md has no ```bash block right after <!-- {marker} -->"
    return m.group(1)


def test_readme_fast_tier_is_the_not_slow_tests_and_the_test_command_runs_everything():
    fast, full = _command_after("fast-test-command"), _command_after("test-command")
    assert "\n" not in fast and fast.startswith("python -m pytest") and '-m "not slow"' in fast, fast
    assert "pytest" in full and " -m " not in full.split("pytest", 1)[1] and " -k " not in full, full  # nothing deselected
    ini = (ROOT / "pytest.ini").read_text()
    assert re.search(r"^markers\s*=\s*\n\s+slow:", ini, re.M), "the slow marker is registered in pytest.ini"
