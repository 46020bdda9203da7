"""Run a notebook the nbdev way in a fresh process that starts warm.

Every notebook run is a new process (a fresh kernel: nothing a notebook does can leak into the next), but paying
for `import torch, torchvision, nbdev` in each of a suite's 85 runs costs about 4 s of CPU a run. So the runs are
forked from a multiprocessing forkserver that has imported those libraries once and has run no notebook code. A
child starts with them already in memory, sets the run's environment and working directory, and runs
`nbdev.test.test_nb` on a fresh shell, which is what a new process would do after its imports.

A process has one forkserver, and its imports are those of whoever starts it first. shardkit's ETL engine starts it
too (`warm_start_context`, for its workers), with a shorter list: a notebook run forked from that one imports
IPython, execnb and nbdev itself, about 0.7 CPU-s a run (measured: a Dask ETL test and then 78 light runs took 160
CPU-s, and 105 with this starter started first). So tests/conftest.py starts this one as soon as a session that runs
notebooks is collected (`start`), and its list has the ETL engine's heavy modules too (`HEAVY_MODULES`; its workers
import shardkit themselves, as the notebooks do).
"""
import multiprocessing as mp
import os, sys, tempfile
from pathlib import Path

# Heavy third-party imports only: shardkit itself is imported by each notebook, under the run's environment.
# `distributed`: the Dask ETL engine's workers fork from the same server (shardkit.etl.local_engine.HEAVY_MODULES).
PRELOAD = ["numpy", "PIL.Image", "torch", "torchvision", "torchvision.transforms.v2", "webdataset", "matplotlib",
           "IPython", "execnb.shell", "nbdev.test", "fastcore.test", "requests", "distributed"]


def _run(nb: str, env: dict, skip: list, force: list, log: str) -> None:
    "In the child: output to `log`, the run's environment and folder, then the notebook; exit status 0 if it passed."
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)  # also what C code and the notebook's own subprocesses write
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    mp.set_start_method(None, force=True)  # the platform's default again (fork on Linux), as in a new process
    os.environ.clear(); os.environ.update(env)
    os.chdir(Path(nb).parent)
    from nbdev.test import test_nb
    ok, _ = test_nb(Path(nb), skip_flags=skip, force_flags=force, do_print=False)
    sys.exit(0 if ok else 1)  # a normal exit: multiprocessing joins whatever the notebook left running


_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def start() -> None:
    "Start the forkserver now, with `PRELOAD`, unless this process has one already (the first starter's list stays)."
    from multiprocessing import forkserver
    _context()
    forkserver.ensure_running()


def run_notebook_process(nb: Path, env: dict, skip=("slow", "ais"), force=(), timeout: float = 1500) -> tuple[int, str]:
    "Run `nb` in a fresh process forked warm; (exit status, its output). Flagged cells skipped unless in `force`."
    with tempfile.NamedTemporaryFile("w+", prefix="nbrun-", suffix=".log", delete=False) as f: log = f.name
    p = _context().Process(target=_run, args=(str(nb), dict(env), list(skip), list(force), log))
    try:
        p.start()
        p.join(timeout)
        if p.is_alive(): return -1, f"timed out after {timeout:.0f} s\n" + Path(log).read_text(errors="replace")
        return p.exitcode, Path(log).read_text(errors="replace")
    finally:
        if p.is_alive(): p.kill(); p.join(10)
        os.unlink(log)
