"""Faults survived: a cut connection, a busy store (503, Retry-After), a stalled read, a dead shard, a missing one and a
shard rewritten between attempts, each played by a real misbehaving HTTP server (tests/faults.py) against streaming,
random access (shard cache and range reads) and index building. A fault costs an epoch nothing: the same samples in
the same order as a clean epoch with the same seed, every retry counted and reported; a dead shard ends the run with
an error that names it, within the bound. The AIStore side (a target killed and restarted mid-epoch, and during
`shardkit ais put`) is tests/test_faults_ais.py; DDP with one rank meeting faults is tests/test_train.py's."""
import shutil, time
from pathlib import Path
import numpy as np
import pytest
from faults import N_SHARDS, NAMES, PER_SHARD, FaultServer, fast_retries, write_fault_shards
from shardkit.remote import open_remote

ALL = N_SHARDS * PER_SHARD


fast = fast_retries


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    "8 shards of 40 samples (a class and 3 KB of bytes each): small, but a cut lands inside a member."
    return write_fault_shards(tmp_path_factory.mktemp("fault-shards"))


@pytest.fixture
def server(shard_dir, tmp_path):
    "A fault server over a fresh copy of the shards (a test may rewrite them)."
    with FaultServer(shutil.copytree(shard_dir, tmp_path / "www")) as srv: yield srv


def reported(err: str) -> dict[str, int]:
    "The retries the loader's lines on stderr report, summed over its workers' lines: cause -> count."
    import re
    out = {}
    for line in err.splitlines():
        if m := re.match(r"shardkit loader: \d+ reads? retried in epoch \d+ \(([^)]*)\)(?: by worker \d+)?, .*; nothing lost$",
                         line):
            for part in m.group(1).split(", "):
                n, cause = part.split(" ", 1); out[cause] = out.get(cause, 0) + int(n)
    return out


def stream_keys(urls, workers=2, **kw) -> list[str]:
    "The keys of one streaming epoch (seed 0, batches of 16) in the order the training loop sees them."
    from shardkit import create_dataloader, create_dataset
    ds = create_dataset(urls, fields=("__key__", "cls"), seed=0, batch_size=16, shuffle=50, **kw)
    return [k for b in create_dataloader(ds, num_workers=workers, batch_size=16) for k in b[0]]


@pytest.fixture(scope="module")
def clean_stream(shard_dir) -> list[str]:
    "A clean epoch's keys, read from the local files: URLs in the same order give the same epoch."
    keys = stream_keys([str(shard_dir / n) for n in NAMES])
    assert sorted(keys) == sorted(f"s{s}_{i:02d}" for s in range(N_SHARDS) for i in range(PER_SHARD))
    return keys


def test_streaming_epoch_is_exact_through_cut_connections(server, clean_stream, capfd):
    "The first GET of every shard is cut halfway (default settings): a clean epoch's samples, and the retries reported."
    server.fault("cut")
    assert stream_keys(server.urls(NAMES)) == clean_stream
    assert len(server.faults_played()) == N_SHARDS
    err = capfd.readouterr().err
    assert reported(err) == {"connection cut": N_SHARDS}, err  # each worker says what its reads met


def test_streaming_epoch_is_exact_through_each_fault(server, clean_stream, capfd):
    """503 and 429 with Retry-After, a stall longer than the read timeout, a connection dropped before any answer: each
    on the first GET of some shards, all in one epoch (one epoch is cheaper than one per fault)."""
    for kind, pattern in ((503, "f-00[01].tar"), (429, "f-002.tar"), ("stall", "f-003.tar"), ("reset", "f-00[45].tar")):
        server.fault(kind, pattern=pattern, retry_after=0.3, stall=3)
    t0 = time.monotonic()
    assert stream_keys(server.urls(NAMES), retry_wait=fast()) == clean_stream
    want = {"HTTP 503": 2, "HTTP 429": 1, "timed out": 1, "connection cut": 2}
    assert reported(capfd.readouterr().err) == want
    assert time.monotonic() - t0 > 0.3 + 1  # the server's Retry-After was honoured, the stall waited out (1 s)


def random_loader(urls, read, workers=2, **kw):
    "A random-access loader (seed 0, batches of 16), its index built, its shard cache empty."
    from shardkit.loading.pipeline import create_dataloader, create_dataset
    dl = create_dataloader(create_dataset(urls, fields=("__key__", "cls"), batch_size=16, seed=0, read=read,
                                          index_cache=False, access="random", **kw), num_workers=workers)
    if read == "cache":
        for f in dl.dataset.reader.copies.files(): f.unlink()  # every shard is fetched in the epoch
    return dl

def keys_of(dl) -> list[str]: return [k for b in dl for k in b[0]]


@pytest.mark.parametrize("read", ["cache", "range"])
def test_random_access_epoch_is_exact_through_each_fault(read, server, shard_dir, capfd):
    """The shard cache's fetches and the per-sample range reads, the first GET (or range GET) of each shard faulted: cut
    halfway, 503 with Retry-After, a stall; the epoch is a clean epoch's, every retry reported."""
    local = keys_of(random_loader(str(shard_dir), "cache" if read == "cache" else "local", workers=0))  # same order
    retries = fast()
    dl = random_loader(server.urls(NAMES), read, retry_wait=retries)  # its index built clean (the next test faults it)
    server.clear()
    for kind, pattern in (("cut", "f-00[012].tar"), (503, "f-00[345].tar"), ("stall", "f-006.tar")):
        server.fault(kind, pattern=pattern, when="ranged" if read == "range" else "first", retry_after=0.2, stall=3)
    assert keys_of(dl) == local
    want = {"connection cut": 3, "timed out": 1, "HTTP 503": 3}
    assert retries.counts() == want, retries.counts()
    assert "7 reads retried in epoch 0 (3 connection cut, 1 timed out, 3 HTTP 503)" in capfd.readouterr().err


def test_index_building_through_cut_reads(server, shard_dir):
    "The index of shards at URLs, each GET cut halfway (the HEADs answered): the same index as the local files'."
    from shardkit.loading.index import sample_index
    retries, keys = fast(), ("__key__", "cls", "bin")
    server.fault("cut")
    remote, local = sample_index(server.urls(NAMES), keys, index_cache=False, retries=retries), sample_index(
        str(shard_dir), keys, index_cache=False)
    assert [remote.key(i) for i in range(len(remote))] == [local.key(i) for i in range(len(local))]
    assert (np.asarray(remote.offset) == np.asarray(local.offset)).all()
    assert (np.asarray(remote.size) == np.asarray(local.size)).all()
    assert retries.counts() == {"connection cut": N_SHARDS}


def test_each_retried_status(server, shard_dir):
    "HTTP 408, 429, 500, 502, 503 and 504 are retried (a 503 or 429 after its Retry-After)."
    data = (shard_dir / NAMES[0]).read_bytes()
    for code in (408, 429, 500, 502, 503, 504):
        server.clear(); server.fault(code, retry_after=0.05)
        retries = fast()
        with open_remote(server.url(NAMES[0]), retries) as f: assert f.read() == data
        assert retries.counts() == {f"HTTP {code}": 1}


def test_a_refused_connection_is_retried_until_the_server_is_up(shard_dir):
    "Nothing listens on the port yet (a node restarting): the read waits, and succeeds once a server starts there."
    import socket, subprocess, sys, threading
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    procs = []
    start = lambda: procs.append(subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(shard_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    timer, retries = threading.Timer(0.3, start), fast()
    timer.start()
    try:
        with open_remote(f"http://127.0.0.1:{port}/{NAMES[0]}", retries) as f:
            assert f.read() == (shard_dir / NAMES[0]).read_bytes()
    finally:
        timer.join()
        for p in procs: p.terminate(); p.wait(10)
    assert set(retries.counts()) == {"connection refused"}


def test_a_dead_shard_ends_the_run_naming_it_within_the_bound(server):
    "One shard answers 500 to every GET: a LoaderError names it, its attempts and the last cause, after the bound."
    from shardkit.errors import LoaderError
    server.fault(500, pattern=NAMES[3], when="always")
    for make in ("stream", "cache"):
        t0 = time.monotonic()
        with pytest.raises(LoaderError) as e:
            if make == "stream": stream_keys(server.urls(NAMES), workers=0, retry_wait=fast(wait=1, backoff=0.2))
            else: keys_of(random_loader(server.urls(NAMES), "cache", workers=0, retry_wait=fast(wait=1, backoff=0.2)))
        took = time.monotonic() - t0
        msg = str(e.value)
        assert f"gave up reading shard {server.url(NAMES[3])}" in msg and "the last HTTP 500" in msg, msg
        assert "attempt(s)" in msg and "load_state_dict" in msg, msg
        assert 1 <= took < 1 + 10, f"{make}: {took:.1f} s for a bound of 1 s"


def test_a_dead_shard_costs_one_bound_for_all_of_a_loaders_workers(server):
    """A shard-cache fetch that gave up leaves a note: the same loader's next reader of that shard (another worker,
    waiting for the shard's lock meanwhile) gives up at once instead of waiting out the bound again; another loader
    tries afresh. (With 2 workers and the default bound, a dead shard cost 240 s without the note, 120 s with it.)"""
    from shardkit.loading.readers import CachedShardReader
    from shardkit.remote import RetriesExhausted
    dl = random_loader(server.urls(NAMES), "cache", workers=0, retry_wait=fast(wait=1, backoff=0.2))
    server.clear(); server.fault(500, pattern=NAMES[3], when="always")
    reader, idx = dl.dataset.reader, dl.dataset.index
    first = int(np.searchsorted(idx.shard, 3))
    for took in ((1, 3), (0, 0.5)):  # the first read waits out the bound, the second gives up at once
        t0 = time.monotonic()
        with pytest.raises(RetriesExhausted, match="gave up reading shard"): reader.read(idx, [first])
        assert took[0] <= time.monotonic() - t0 < took[1]
    other = CachedShardReader(idx, reader.copies, reader.fetch)  # another loader's reader: it tries again
    t0 = time.monotonic()
    with pytest.raises(RetriesExhausted): other.read(idx, [first])
    assert time.monotonic() - t0 >= 1


def test_missing_and_forbidden_shards_are_refused_at_once(server):
    "404 and 403 are answers, not faults: each its own error, at once."
    from shardkit.remote import AccessDenied, ObjectMissing
    t0 = time.monotonic()
    with pytest.raises(ObjectMissing, match="not there \\(HTTP 404\\)"):
        stream_keys([server.url("nope.tar")], workers=0)
    server.fault(403, pattern=NAMES[1])
    with pytest.raises(AccessDenied, match="access denied \\(HTTP 403\\)"):
        stream_keys([server.url(NAMES[1])], workers=0)
    assert time.monotonic() - t0 < 5


def test_a_shard_rewritten_between_attempts_is_refused(server):
    "A read cut, then the shard rewritten (same size, other bytes) before the retry: the seam is refused, not read."
    server.fault("rewrite", pattern=NAMES[2])
    with pytest.raises(Exception, match="changed while it was read"):
        stream_keys([server.url(NAMES[2])], workers=0, retry_wait=fast())
    from shardkit.loading.index import RandomAccessError
    (server.root / NAMES[2]).write_bytes((server.root / NAMES[2]).read_bytes()[::-1])  # as it was
    dl = random_loader(server.urls(NAMES), "cache", workers=0, retry_wait=fast())
    server.clear(); server.fault("rewrite", pattern=NAMES[2])
    with pytest.raises(RandomAccessError, match="the shard changed after indexing: build the loader again"):
        keys_of(dl)


def test_a_state_taken_while_a_read_is_retried_resumes_exactly(server, clean_stream):
    "A 503 with Retry-After on every shard's first GET; the state taken while a worker waits for its retry resumes exactly."
    from shardkit import create_dataloader, create_dataset
    def make():
        ds = create_dataset(server.urls(NAMES), fields=("__key__", "cls"), seed=0, batch_size=16, shuffle=50,
                            retry_wait=fast())
        return create_dataloader(ds, num_workers=2, batch_size=16)
    server.fault(503, retry_after=0.6)
    waiting = lambda: any(p for m, p, r, k, t in server.log if k == 503
                          and not any(q == p and k2 is None for _, q, _, k2, t2 in server.log if t2 > t))
    loader, head, state = make(), [], None
    for b in loader:
        head += b[0]
        if len(head) >= 16 and waiting(): state = loader.state_dict(); break
    assert state is not None, "no batch arrived while a read was waiting for its retry"
    del loader
    again = make(); again.load_state_dict(state)
    assert head + [k for b in again for k in b[0]] == clean_stream


def test_profile_shows_the_retries_and_their_wait(server):
    from shardkit import create_dataloader, create_dataset
    from shardkit.profile import profile_pipeline, verdicts
    server.fault("cut")
    ds = create_dataset(server.urls(NAMES), fields=("__key__", "cls"), seed=0, batch_size=16, retry_wait=fast())
    p = profile_pipeline(create_dataloader(ds, num_workers=2, batch_size=16), device=None)
    assert p.samples == ALL and p.retries == {"connection cut": N_SHARDS} and p.retry_wait > 0
    assert any(v.startswith("8 reads were retried (8 connection cut)") for v in verdicts(p)), verdicts(p)
