"""An opt-in pytest plugin that says where the suite's CPU goes: `python -m pytest -p cpu_report ...` (from tests/, or
with tests/ on the path) ends with the tests that used the most CPU, and writes every test's figures to
tests/_out/cpu/<worker>.tsv (test, wall s, CPU s; `CPU_REPORT_DIR` to put them elsewhere).

A test's CPU is everything it started: the notebooks' forks of the runner's forkserver, servers, clusters, torchrun's
ranks. `getrusage` sees only the children a process waits for, so where the cgroup v1 `cpuacct` controller is
writable (root on Linux), each pytest worker moves itself into a group of its own and a test's CPU is its group's
usage over the test; elsewhere it is this process and its waited-for children (less than the truth)."""
import os, resource, time
from pathlib import Path
import pytest

OUT = Path(os.environ.get("CPU_REPORT_DIR") or Path(__file__).resolve().parent / "_out" / "cpu")
_GROUP = None  # this worker's cpuacct group folder, when one could be made
_WORKER = "main"  # this process's xdist worker id (its own config says; the environment may be a parent worker's)


def _worker() -> str: return _WORKER


def pytest_configure(config):
    global _GROUP, _WORKER
    _WORKER = getattr(config, "workerinput", {}).get("workerid", "main")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): start afresh
        OUT.mkdir(parents=True, exist_ok=True)
        for old in OUT.glob("*.tsv"): old.unlink()
    base = Path("/sys/fs/cgroup/cpuacct")
    try:
        group = base / f"pytest-{os.getpid()}-{_worker()}"
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        _GROUP = group
    except OSError:
        _GROUP = None


def pytest_unconfigure(config):
    "Leave the group and remove it (it stays while something this worker started still runs)."
    if _GROUP is None: return
    try:
        (_GROUP.parent / "cgroup.procs").write_text(str(os.getpid()))
        _GROUP.rmdir()
    except OSError: pass


def _cpu() -> float:
    if _GROUP is not None: return int((_GROUP / "cpuacct.usage").read_text()) / 1e9
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0 = time.monotonic(), _cpu()
    yield
    with open(OUT / f"{_worker()}.tsv", "a") as f:
        f.write(f"{item.nodeid}\t{time.monotonic() - t0:.2f}\t{_cpu() - c0:.2f}\n")


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"): return
    rows = [line.rstrip("\n").split("\t") for p in OUT.glob("*.tsv") for line in p.open()]
    if not rows: return
    rows = sorted(((n, float(w), float(c)) for n, w, c in rows), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    how = "each worker's cgroup" if _GROUP is not None else "this process and its waited-for children"
    terminalreporter.write_sep("=", f"CPU: {total:.0f} s in {len(rows)} tests ({how}); the most")
    for n, w, c in rows[:15]:
        terminalreporter.write_line(f"{c:7.1f} s CPU {w:7.1f} s wall  {n}")
    terminalreporter.write_line(f"every test: {OUT}/*.tsv")
