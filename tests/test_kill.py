"""A killed job leaves nothing behind, and the same job started again goes on exactly. `kill -9` of a training
process in the middle of an epoch, and of one of its DataLoader workers; a random-access loader killed while it
fetches a shard into its cache. Afterwards: no process of the job alive, no shared-memory segment it made
(`/dev/shm`), no temporary file, no lock held, no half-written checkpoint (one a kill during a save would leave is
removed by the next run); the run started again resumes from its checkpoint and trains on exactly the samples of an
uninterrupted run, in its order."""
import fcntl, os, re, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path
import psutil
import pytest
from test_train import write_shards

pytestmark = pytest.mark.slow


def _train_cmd(shards: str, ck: Path, keys: Path) -> list[str]:
    return [sys.executable, "-m", "shardkit.apps.cli", "train", "--shards", shards, "--size", "32", "--workers", "2",
            "--epochs", "2", "--every", "3", "--batch-size", "4", "--device", "cpu", "--checkpoint", str(ck),
            "--keys-out", str(keys)]


def _shm_of(pids) -> list[str]:
    "The /dev/shm entries named after one of `pids` (PyTorch's torch_PID_..., Python's pym-PID-...)."
    return [n for n in os.listdir("/dev/shm") if any(n.startswith((f"torch_{p}_", f"pym-{p}-")) for p in pids)]


def _left_in(folder: Path) -> list[str]:
    "What runs left under `folder`: all in its TMPDIR, tmp/ (files, sockets, folders), and any *.tmp anywhere."
    return sorted(str(r) for p in folder.rglob("*") if (r := p.relative_to(folder)).parts[0] == "tmp" and len(r.parts) > 1
                  or p.suffix == ".tmp" or ".tmp." in p.name)


def _held_locks(folder: Path) -> list[str]:
    "Lock files under `folder` that some process still holds (a non-blocking lock of ours fails)."
    held = []
    for p in folder.rglob("*lock*"):
        with open(p, "a") as f:
            try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError: held.append(str(p))
    return held


def _kill_mid_epoch(cmd, env, ck: Path, keys: Path, victim: str) -> tuple[subprocess.CompletedProcess, set[int], int]:
    """Start `cmd`; once it has saved a checkpoint and trained on 30 samples, SIGKILL it (or one of its workers).
    (The run, its processes' ids, its own process id.)"""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    keys_file, deadline = keys / "keys-rank0.txt", time.time() + 120
    while not (ck.exists() and keys_file.exists() and len(keys_file.read_text().split()) >= 30):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    children = psutil.Process(p.pid).children(recursive=True)  # two workers and Python's resource tracker
    workers = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
    assert len(workers) == 2, children
    os.kill(p.pid if victim == "main" else workers[0].pid, signal.SIGKILL)
    out, err = p.communicate(timeout=120)  # the process ends (no hang), its workers with it
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"processes of the job still alive after the kill: {alive}"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), {p.pid, *(c.pid for c in children)}, p.pid


def _short_link(folder: Path) -> str:
    """A short path to `folder` (a link under the system's temporary folder, removed after the test): the run's TMPDIR.
    Its workers' sockets go under TMPDIR, and a socket's path may not exceed 107 bytes, which pytest-xdist's temporary
    folders do (the loader refuses such a TMPDIR: `worker_tmpdir_problem`)."""
    link = Path(tempfile.mkdtemp(prefix="sk-")) / "t"
    link.symlink_to(folder)
    _LINKS.append(link)
    return str(link)


_LINKS: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_links():
    yield
    while _LINKS:
        link = _LINKS.pop(); link.unlink(); link.parent.rmdir()


@pytest.mark.parametrize("victim", ["main", "worker"])
def test_a_training_process_killed_mid_epoch_leaves_nothing_and_resumes_exactly(tmp_path, victim):
    shards = write_shards(tmp_path / "shards", [30, 30, 30, 30])
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "SHARDKIT_HOME": str(tmp_path / "home"), "TMPDIR": _short_link(tmp_path / "tmp"),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    whole = subprocess.run(_train_cmd(shards, tmp_path / "whole.pt", tmp_path / "whole"), env=env, capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    ck, keys = tmp_path / "ck.pt", tmp_path / "resumed"
    killed, pids, pid = _kill_mid_epoch(_train_cmd(shards, ck, keys), env, ck, keys, victim=victim)
    if victim == "main": assert killed.returncode == -signal.SIGKILL
    else:  # one line that says what happened and what to do, no traceback
        assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr
        # the signal, when this process sees the worker's end before torch reaps it; else torch's words for it
        assert re.search(r"(loader worker \(pid \d+\) was killed by signal 9 \(SIGKILL\)|DataLoader worker \(pid\(s\) "
                         r"\d+\) exited unexpectedly), so the epoch cannot go on; nothing is lost: run the same command "
                         r"again", killed.stderr), killed.stderr
    # a kill in the middle of a save leaves the checkpoint's half beside it: the next run removes it, unread. (Made
    # here when this kill came between two saves.) A killed training process leaves its temporary folder, which the
    # next run removes; one whose worker was killed removes it itself (the worker's socket, torch's files in it).
    run_folder = f"tmp/shardkit-run-{pid}-"
    left = [x for x in _left_in(tmp_path) if x != "ck.pt.tmp" and not (victim == "main" and x.startswith(run_folder))]
    assert _shm_of(pids) == [] and left == [] and _held_locks(tmp_path) == [], left
    if not (tmp_path / "ck.pt.tmp").exists(): (tmp_path / "ck.pt.tmp").write_bytes(b"half a checkpoint")
    again = subprocess.run(_train_cmd(shards, ck, keys), env=env, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=300)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stdout + again.stderr
    assert "removed" in again.stdout and "ck.pt.tmp: half of a checkpoint" in again.stdout, again.stdout
    assert "Warning" not in again.stderr and "Traceback" not in again.stderr, again.stderr
    assert (keys / "keys-rank0.txt").read_text() == (tmp_path / "whole" / "keys-rank0.txt").read_text()
    assert _left_in(tmp_path) == [] and _held_locks(tmp_path) == []


_FETCH = """
import sys
from shardkit.loading.pipeline import create_dataloader, create_dataset
from shardkit.remote import Retries
dl = create_dataloader(create_dataset(sys.argv[1:], fields=("__key__", "cls"), batch_size=8, seed=0, read="cache",
                                      shard_cache=2, retry_wait=Retries(wait=60, read_timeout=3), access="random"),
                       num_workers=2)
print(sum(len(b[0]) for b in dl), flush=True)
"""


def test_a_random_access_loader_killed_while_it_fetches_leaves_nothing(tmp_path):
    """A loader reading through its shard cache, killed with its workers (`kill -9` of the process group, as a
    scheduler ends a job) while a worker is half-way through a shard (the server stalls it): the half-fetched copy is
    its only trace (no lock stays held); the next loader on the same cache removes it and reads an exact epoch."""
    from faults import FaultServer
    write_shards(tmp_path / "shards", [40, 40, 40, 40])
    names = sorted(p.name for p in (tmp_path / "shards").glob("*.tar"))
    env = {**os.environ, "SHARDKIT_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    with FaultServer(tmp_path / "shards") as server:
        urls, cache = server.urls(names), tmp_path / "home" / "cache" / "shards"
        first = subprocess.run([sys.executable, "-c", _FETCH, *urls], env=env, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=300)  # builds the index, kept in the home's cache
        assert first.returncode == 0 and first.stdout.split() == ["160"], first.stdout + first.stderr
        shutil.rmtree(cache)  # the shards' copies go: the next loader fetches them again
        server.fault("stall", pattern="*", when="fresh", stall=60)  # every whole-shard GET: half, then silence
        p = subprocess.Popen([sys.executable, "-c", _FETCH, *urls], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while not list(cache.rglob(".*.tmp")):  # a worker is fetching (the server stalls it half-way)
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        workers = psutil.Process(p.pid).children(recursive=True)
        pids = {p.pid, *(w.pid for w in workers)}
        os.killpg(p.pid, signal.SIGKILL); p.communicate(timeout=60)
        assert not psutil.wait_procs(workers, timeout=30)[1]
        half = [f.name for f in cache.rglob(".*.tmp")]
        assert half and _held_locks(tmp_path / "home") == [] and _shm_of(pids) == []  # a kill cannot remove these
        server.clear()
        done = subprocess.run([sys.executable, "-c", _FETCH, *urls], env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["160"], done.stdout + done.stderr
    assert list(cache.rglob(".*.tmp")) == [], f"left: {half}"
