"""tests/cpu_report.py, the opt-in plugin that says where the suite's CPU goes, counts a test's own work and a child's."""
import os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_report_counts_a_tests_cpu_and_its_childrens(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys, time\n"
        "def _burn(s):\n    t = time.process_time()\n    while time.process_time() - t < s: pass\n"
        "def test_idle(): time.sleep(0.3)\n"
        "def test_burns(): _burn(0.4)\n"
        "def test_child(): subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.4: pass'], check=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's worker (xdist)
    env.update(CPU_REPORT_DIR=str(tmp_path / "cpu"), PYTHONPATH=str(ROOT), PYTEST_XDIST_WORKER="gw7")  # a parent's
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.cpu_report", "-n", "0",
                        "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_burn.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CPU: " in r.stdout and "the most" in r.stdout, r.stdout
    rows = {line.split("\t")[0].split("::")[-1]: [float(x) for x in line.split("\t")[1:]]
            for line in (tmp_path / "cpu" / "main.tsv").read_text().splitlines()}
    assert rows["test_idle"][0] >= 0.3 and rows["test_idle"][1] < 0.2, rows  # waiting is wall time, not CPU
    assert rows["test_burns"][1] >= 0.35 and rows["test_child"][1] >= 0.35, rows  # its own work, and a child's
