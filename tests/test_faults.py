"""Faults survived: a cut connection, a busy store (503, Retry-After), a stalled read, a dead shard, a missing one and a
shard rewritten between attempts, each served by a real misbehaving HTTP server (tests/faults.py), against streaming,
random access (shard cache and range reads) and index building. A fault costs an epoch nothing: the same samples, in
the same order, as a clean epoch with the same seed, and every retry is counted and reported; a dead shard ends the
run with an error that names it, within the bound. The AIStore side (a target killed and restarted mid-epoch and
during `shardkit ais put`) is tests/test_faults_ais.py."""
import os, time
from pathlib import Path
import pytest
import webdataset as wds
from faults import FaultServer

N_SHARDS, PER_SHARD = 8, 40
NAMES = [f"f-{s:03d}.tar" for s in range(N_SHARDS)]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    "8 shards of 40 samples (a class and 3 KB of bytes each): small, but a cut lands inside a member."
    d = tmp_path_factory.mktemp("fault-shards")
    for s, name in enumerate(NAMES):
        with wds.TarWriter(str(d / name)) as w:
            for i in range(PER_SHARD):
                w.write({"__key__": f"s{s}_{i:02d}", "cls": (s * PER_SHARD + i) % 7,
                         "bin": bytes([i]) * 3000 + os.urandom(64)})
    return d


@pytest.fixture
def server(shard_dir, tmp_path):
    "A fault server over a fresh copy of the shards (a test may rewrite them)."
    import shutil
    root = shutil.copytree(shard_dir, tmp_path / "www")
    with FaultServer(root) as srv: yield srv


def stream_keys(urls, workers=2, **kw) -> list[str]:
    "The keys of one streaming epoch (seed 0, 2 workers, batches of 16) in the order the training loop sees them."
    from shardkit.loader import create_dataloader, create_dataset
    ds = create_dataset(urls, keys=("__key__", "cls"), seed=0, batch_size=16, shuffle=50, **kw)
    return [k for b in create_dataloader(ds, num_workers=workers, batch_size=16) for k in b[0]]


def test_streaming_epoch_is_exact_through_cut_connections(server, capfd):
    "The first GET of every shard is cut halfway: the epoch is a clean epoch's, and the retries are reported."
    clean = stream_keys(server.urls(NAMES))
    assert len(clean) == N_SHARDS * PER_SHARD
    capfd.readouterr()
    server.clear(); server.fault("cut")
    assert stream_keys(server.urls(NAMES)) == clean
    assert len(server.faults_played()) == N_SHARDS
    err = capfd.readouterr().err
    assert "shardkit loader: 8 reads retried in epoch 0 (8 connection cut)" in err and "nothing lost" in err, err
