"""Random access at scale (issue 30): the shard cache mode (exact epochs, resume, the cache bound), shard order
in spans, and HTTP range reads on a local AIStore."""
import os, tarfile, uuid
import numpy as np
import pytest
import webdataset as wds
from shardkit.errors import UsageError
from shardkit.loading.index import file_lock, sample_index
from shardkit.loading.order import epoch_order, order_quality
from shardkit.loading.pipeline import create_dataloader, create_dataset
from shardkit.loading.readers import RangeReader, ShardCache, shard_cache_dir
from shardkit.stores import open_store

SIZES = (7, 3, 5, 9, 4, 6)  # uneven shards, 34 samples
ALL = sorted(f"s{s}_{i:02d}" for s, n in enumerate(SIZES) for i in range(n))


def _write_shards(folder, sizes=SIZES):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, n in enumerate(sizes):
        paths.append(str(folder / f"small-{s:05d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for i in range(n):
                w.write({"__key__": f"s{s}_{i:02d}", "bin": rng.bytes(int(rng.integers(100, 3000))), "cls": i})
    return paths


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    "Index and shard caches go to a temp SHARDKIT_HOME, a fresh one per test."
    monkeypatch.setenv("SHARDKIT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _write_shards(tmp_path_factory.mktemp("scale") / "shards")


def _loader(src, **kw):
    kw.setdefault("fields", ("__key__", "cls", "bin"))
    kw.setdefault("transform", None)
    num_workers = kw.pop("num_workers", 2)
    return create_dataloader(create_dataset(src, access="random", **kw), num_workers=num_workers)


def _keys(loader):
    return [k for b in loader for k in b[0]]


def _cache_files(loader):
    return sorted(loader.dataset.reader.copies.folder.glob("*.tar"))


def _cache_bytes(loader) -> int:
    """The bytes in the cache now, under the cache's own lock: its workers evict and add a copy under it, so a listing
    outside it can name a copy that is gone by its stat (run s9a failed so, while the bound held)."""
    with file_lock(loader.dataset.reader.copies.folder / ".lock"):
        return sum(f.stat().st_size for f in _cache_files(loader))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_cache_mode_exactly_once_per_epoch(shards, world, workers):
    per_rank = [_loader(str(os.path.dirname(shards[0])), read="cache", shard_cache=2, batch_size=4, num_workers=workers,
                        rank=r, world_size=world, pad=world > 1) for r in range(world)]
    assert per_rank[0].span == 2
    for epoch in range(2):
        got = [_keys(dl) for dl in per_rank]
        assert len({len(g) for g in got}) == 1                     # equal batches per rank
        flat = [k for g in got for k in g]
        assert set(flat) == set(ALL)                               # every sample ...
        assert len(flat) - len(ALL) < 4 * world                    # ... once, bar the pad to a whole step
        if world == 1: assert sorted(flat) == ALL


def test_cache_mode_order_is_spans_of_cached_shards(shards):
    dl = _loader(os.path.dirname(shards[0]), read="cache", shard_cache=2, batch_size=1)
    idx = dl.dataset.index
    order = np.concatenate(dl.batches(0))
    np.testing.assert_array_equal(order, epoch_order(idx.shard, 0, 0, span=2))
    seq = idx.shard[order]
    first = {s: int(np.flatnonzero(seq == s)[0]) for s in set(seq.tolist())}
    last = {s: int(np.flatnonzero(seq == s)[-1]) for s in set(seq.tolist())}
    open_at = [sum(first[s] <= p <= last[s] for s in first) for p in range(len(seq))]
    assert max(open_at) == 2                 # never more shards in play than the cache holds


@pytest.mark.parametrize("stop", [1, 3, 9, 12])
def test_cache_mode_resumes_batch_for_batch(shards, stop):
    src = os.path.dirname(shards[0])
    dl = _loader(src, read="cache", shard_cache=2, batch_size=3, seed=5)
    whole = _keys(dl) + _keys(dl)            # epochs 0 and 1, uninterrupted
    first = _loader(src, read="cache", shard_cache=2, batch_size=3, seed=5, num_workers=2)
    seen, it = [], iter(first)
    for _ in range(stop): seen += list(next(it)[0])
    state = first.state_dict(); del it
    again = _loader(src, read="cache", shard_cache=2, batch_size=3, seed=5, num_workers=0)
    again.load_state_dict(state)
    seen += _keys(again) + _keys(again)
    assert seen[:len(whole)] == whole and len(seen) >= len(whole)


def test_cache_bound_is_respected(shards):
    src = os.path.dirname(shards[0])
    dl = _loader(src, read="cache", shard_cache=3, batch_size=4, num_workers=2)
    for _ in range(2): _keys(dl)
    assert len(_cache_files(dl)) <= 3
    limit = 2 * max(os.path.getsize(p) for p in shards)
    dl = _loader(src, read="cache", shard_cache=f"{limit}B", batch_size=4)
    assert dl.span == 2 and dl.dataset.reader.copies.max_bytes == limit
    seen = []
    for b in dl:
        seen += list(b[0])
        assert _cache_bytes(dl) <= limit
    assert sorted(seen) == ALL
    assert not list(dl.dataset.reader.copies.folder.glob(".*.tmp"))  # atomic writes leave no partial files


def test_cache_refuses_what_it_cannot_hold(shards):
    src = os.path.dirname(shards[0])
    with pytest.raises(UsageError, match="span=5 is more shards than the cache holds"):
        _loader(src, read="cache", shard_cache=2, span=5)
    with pytest.raises(UsageError, match="holds no shard"):
        _loader(src, read="cache", shard_cache="1KB")
    with pytest.raises(UsageError, match=r"read=.range. cannot read local shards.*use one of"):
        _loader(src, read="range")


def test_cache_is_private_and_per_source(shards, tmp_path):
    dl = _loader(os.path.dirname(shards[0]), read="cache", shard_cache=2)
    folder = dl.dataset.reader.copies.folder
    assert folder == shard_cache_dir(dl.dataset.index) and (folder.stat().st_mode & 0o777) == 0o700
    other = _write_shards(tmp_path / "other", sizes=(2, 2))
    assert shard_cache_dir(sample_index(other[0], ("cls",))) != folder


def test_span_quality_figures():
    shard = np.repeat(np.arange(100, dtype=np.int32), 200)
    full, win = (order_quality(shard, epoch_order(shard, 1, 0, w)) for w in (None, 10))
    assert full["same_shard_neighbours"] < 0.03 and 0.05 < win["same_shard_neighbours"] < 0.15
    assert 80 < full["mean_gap"] < 120 and 8 < win["mean_gap"] < 12


@pytest.fixture(scope="module")
def bucket(shards, ais_cluster):
    with pytest.MonkeyPatch.context() as mp:  # AIS_ENDPOINT for this module's tests only
        mp.setenv("AIS_ENDPOINT", ais_cluster["endpoint"])
        store = open_store(f"ais://shardkit-scale-{uuid.uuid4().hex[:8]}", create=True)
        for p in shards: store.put_file(p)
        yield store.spec
        store.bucket.delete()


def test_ais_defaults_to_the_shard_cache_exactly_once_and_resumes(shards, bucket):
    dl = _loader(bucket, shard_cache=2, batch_size=4, num_workers=2, seed=3)
    assert type(dl.dataset.reader).__name__ == "CachedShardReader" and dl.span == 2
    e0, e1 = _keys(dl), _keys(dl)
    assert sorted(e0) == sorted(e1) == ALL and e0 != e1
    local = _loader(os.path.dirname(shards[0]), read="cache", shard_cache=2, batch_size=4, seed=3)
    assert _keys(local) == e0                                    # the same order as from the local tars
    dl.set_epoch(0)
    it = iter(dl); head = list(next(it)[0]) + list(next(it)[0]); state = dl.state_dict(); del it
    again = _loader(bucket, shard_cache=2, batch_size=4, num_workers=0, seed=3)
    again.load_state_dict(state)
    assert head + _keys(again) == e0
    assert len(_cache_files(again)) <= 2


def test_range_read_returns_the_tar_members_bytes(shards, bucket):
    dl = _loader(bucket, read="range", batch_size=4)
    assert isinstance(dl.dataset.reader, RangeReader) and dl.span is None
    members = {}
    for p in shards:
        with tarfile.open(p) as t:
            for m in t.getmembers(): members[m.name] = t.extractfile(m).read()
    idx = dl.dataset.index
    keys, rows = dl.dataset.reader.read(idx, list(range(len(idx))))
    assert sorted(keys) == ALL
    for k, (cls, data) in zip(keys, rows):
        assert (cls, data) == (members[f"{k}.cls"], members[f"{k}.bin"])
    assert sorted(_keys(dl)) == ALL


class _RangeHandler(__import__("http.server").server.SimpleHTTPRequestHandler):
    "Serves files with `Range: bytes=a-b` (206), as object stores do; quiet."
    def log_message(self, *args): pass

    def do_GET(self):
        rng = self.headers.get("Range")
        if not rng: return super().do_GET()
        a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        with open(self.translate_path(self.path), "rb") as f: f.seek(a); data = f.read(b - a + 1)
        self.send_response(206); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def http_base(shards):
    import functools, http.server, threading
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                          functools.partial(_RangeHandler, directory=os.path.dirname(shards[0])))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _urls(base): return [f"{base}/small-{s:05d}.tar" for s in range(len(SIZES))]


def test_http_defaults_to_the_shard_cache(shards, http_base):
    dl = _loader(_urls(http_base), shard_cache=3, batch_size=4, num_workers=2, seed=1)
    assert type(dl.dataset.reader).__name__ == "CachedShardReader" and dl.span == 3
    e0 = _keys(dl)
    assert sorted(e0) == ALL and len(_cache_files(dl)) <= 3
    assert _keys(_loader(os.path.dirname(shards[0]), read="cache", shard_cache=3, batch_size=4, seed=1)) == e0


def test_http_range_read_returns_the_tar_members_bytes(shards, http_base):
    dl = _loader(_urls(http_base), read="range", batch_size=4)
    local = _loader(os.path.dirname(shards[0]), read="local", batch_size=4)
    ids = list(range(len(ALL)))
    assert dl.dataset.reader.read(dl.dataset.index, ids) == local.dataset.reader.read(local.dataset.index, ids)
    with tarfile.open(shards[0]) as t: first = t.extractfile(t.getmember("s0_00.bin")).read()
    assert dl.dataset.samples([0])[0]["bin"] == first


def test_cache_copies_of_a_rewritten_local_tar_are_new(tmp_path):
    paths = _write_shards(tmp_path / "s", sizes=(3, 2))
    first = sorted(_keys(_loader(str(tmp_path / "s"), read="cache", shard_cache=2)))
    old = [(s["bin"], s["cls"]) for s in wds.WebDataset(paths[1], shardshuffle=False)]
    size = os.path.getsize(paths[1])
    with wds.TarWriter(paths[1]) as w:  # the same size, other keys
        for i, (data, cls) in enumerate(old): w.write({"__key__": f"x1_{i:02d}", "bin": data, "cls": cls})
    os.utime(paths[1], ns=(0, os.stat(paths[1]).st_mtime_ns + 10**9))
    assert os.path.getsize(paths[1]) == size
    again = sorted(_keys(_loader(str(tmp_path / "s"), read="cache", shard_cache=2)))
    assert first[-2:] == ["s1_00", "s1_01"] and again[-2:] == ["x1_00", "x1_01"]


def test_a_global_order_from_a_cache_that_holds_every_shard(shards):
    dl = _loader(os.path.dirname(shards[0]), read="cache", shard_cache=len(SIZES), span=None, batch_size=5)
    assert dl.span is None and sorted(_keys(dl)) == ALL


def test_the_loader_is_made_with_the_batch_size_create_dataloader_is_given(shards):
    "A data set made with batches of 4, its loader asked for 5: the loader is made once, with 5, and its batches follow."
    ds = create_dataset(os.path.dirname(shards[0]), fields=("__key__", "cls", "bin"), transform=None, read="cache",
                        shard_cache=2, batch_size=4, access="random")
    dl = create_dataloader(ds, num_workers=0, batch_size=5)
    assert dl.batch_size == 5 and [len(b) for b in dl.batches(0)][:-1] == [5] * (len(ALL) // 5)
    assert ds.settings.batch_size == 4  # the data set's own: what a loader gets when none is asked for


@pytest.mark.parametrize("n", [1, 2, 3, 31, 64, 1024, 4099, 65_537])
def test_permute_is_a_permutation(n):
    from shardkit.loading.order import permute
    for seed in (0, 1, 12345):
        assert np.array_equal(np.sort(permute(np.arange(n), n, seed)), np.arange(n)), "every number once"


def test_batches_of_a_huge_epoch_need_no_array_of_its_samples():
    "A trillion samples: batch b comes from (seed, epoch, b) alone, in both orders, without the samples before it."
    from shardkit.loading.order import EpochBatches, EpochOrder
    n = 10**12
    starts = np.arange(0, n + 1, 10**6, dtype=np.int64)  # a million shards of a million samples
    for span in (None, 16):
        b = EpochBatches(EpochOrder(starts, 0, 3, span), 64, rank=1, world_size=8)
        assert len(b) == n // (64 * 8)
        late = b[len(b) - 1]
        assert len(late) == 64 and len(set(late.tolist())) == 64 and ((0 <= late) & (late < n)).all()
        assert np.array_equal(late,
                              EpochBatches(EpochOrder(starts, 0, 3, span), 64, rank=1,
                                           world_size=8)[-1])  # from the seed


def test_a_late_span_batch_equals_the_whole_order():
    from shardkit.loading.order import EpochBatches, EpochOrder, epoch_batches, shard_starts
    shard = np.repeat(np.arange(50, dtype=np.int32), np.arange(50) % 7 + 1)  # uneven shards, some of one sample
    whole = epoch_batches(len(shard), 3, 5, 2, rank=1, world_size=2, pad=True, order=epoch_order(shard, 5, 2, 4))
    lazy = EpochBatches(EpochOrder(shard_starts(shard, 50), 5, 2, 4), 3, rank=1, world_size=2, pad=True)
    for b in (len(whole) - 1, 0, len(whole) // 2):  # out of order, as a resumed loader asks
        assert lazy[b].tolist() == whole[b].tolist()


def _rewrite_same_size(path):
    "Rewrite tar `path` with the same names and sizes but other bytes in every `bin` field; returns the new samples."
    old = [(s["__key__"], s["bin"], s["cls"]) for s in wds.WebDataset(path, shardshuffle=False)]
    size = os.path.getsize(path)
    with wds.TarWriter(path) as w:
        for key, data, cls in old: w.write({"__key__": key, "bin": bytes(255 - b for b in data), "cls": cls})
    assert os.path.getsize(path) == size
    return {key: bytes(255 - b for b in data) for key, data, _ in old}


def _fresh_bucket(paths):
    store = open_store(f"ais://shardkit-version-{uuid.uuid4().hex[:8]}", create=True)
    for p in paths: store.put_file(p)
    return store


def test_ais_cached_copies_follow_the_shards_content(tmp_path, ais_endpoint):
    "A shard overwritten with other bytes of the same size: a new loader reads the new bytes, never the old copy."
    from shardkit.errors import ShardkitError
    from shardkit.loading.readers import CachedShardReader
    paths = _write_shards(tmp_path / "s", sizes=(3, 2))
    store = _fresh_bucket(paths)
    try:
        first = _loader(store.spec, shard_cache=2, batch_size=5, num_workers=0)
        idx = first.dataset.index
        before = {s["__key__"]: s["bin"] for s in first.dataset.samples(list(range(len(idx))))}
        assert len(_cache_files(first)) == 2 and all(v.count("/") == 1 for v in idx.versions)  # checksum/version
        new = _rewrite_same_size(paths[1]); store.put_file(paths[1])
        again = _loader(store.spec, shard_cache=2, batch_size=5, num_workers=0)
        assert again.dataset.index.versions[1] != idx.versions[1] and again.dataset.index.versions[0] == idx.versions[0]
        after = {s["__key__"]: s["bin"] for s in again.dataset.samples(list(range(len(idx))))}
        assert after["s1_00"] == new["s1_00"] != before["s1_00"] and after["s0_00"] == before["s0_00"]
        # a loader still on the old index, whose copy of the shard is gone: the refetch brings other content
        for f in _cache_files(first): f.unlink()
        stale = CachedShardReader(idx, first.dataset.reader.copies)
        with pytest.raises(ShardkitError, match="changed after indexing: build the loader again"):
            stale.read(idx, [int(np.flatnonzero(idx.shard == 1)[0])])
    finally:
        store.bucket.delete()


_REUSE = '''
import sys
import shardkit.loading.index as I
def no(*a, **k): raise SystemExit("the index was built again: " + repr(a))
I.index_ais = I.index_url = no
idx = I.sample_index(sys.argv[1], ("cls", "bin"))
print(len(idx), type(idx.shard).__name__)
'''


def test_ais_index_is_built_once_per_machine_and_follows_the_bucket(tmp_path, ais_endpoint):
    "The first call lists the members and saves the index; another process maps it; a rewritten shard: a new one."
    import subprocess, sys
    from shardkit.loading.index import index_cache_dir
    paths = _write_shards(tmp_path / "s", sizes=(3, 2))
    store = _fresh_bucket(paths)
    try:
        a = sample_index(store.spec, ("cls", "bin"))
        saved = sorted(p.parent for p in (index_cache_dir() / "remote").glob("*/meta.json"))
        assert len(saved) == 1 and isinstance(a.shard, np.memmap) and a.kind == "ais" and len(a) == 5
        out = subprocess.run([sys.executable, "-c", _REUSE, store.spec], capture_output=True, text=True, env=os.environ)
        assert out.returncode == 0 and out.stdout.split() == ["5", "memmap"], out.stderr[-2000:]
        _rewrite_same_size(paths[1]); store.put_file(paths[1])
        b = sample_index(store.spec, ("cls", "bin"))
        assert len(list((index_cache_dir() / "remote").glob("*/meta.json"))) == 2 and b.versions[1] != a.versions[1]
        assert len(sample_index(store.spec, ("cls", "bin"), index_cache=False)) == 5  # index_cache=False: built, not kept
    finally:
        store.bucket.delete()


def test_http_index_is_built_once_per_machine(shards, http_base):
    import subprocess, sys
    from shardkit.loading.index import index_cache_dir
    a = sample_index(_urls(http_base), ("cls", "bin"))
    assert a.kind == "http" and all(a.versions) and isinstance(a.shard, np.memmap)  # Last-Modified of each shard
    assert len(list((index_cache_dir() / "remote").glob("*/meta.json"))) == 1
    out = subprocess.run([sys.executable, "-c", _REUSE, "{" + ",".join(_urls(http_base)) + "}"], capture_output=True,
                         text=True, env=os.environ)
    assert out.returncode == 0 and out.stdout.split() == [str(len(ALL)), "memmap"], out.stderr[-2000:]


def test_header_scan_of_a_cached_copy_matches_the_tar_reader(tmp_path, shards):
    "The in-place scan of plain headers gives what `scan_tar` gives; a long name (pax) or a folder: the full reader."
    from shardkit.loading.readers import plain_members, scan_members
    from shardkit.shards.tar import scan_tar
    longp = tmp_path / "long.tar"
    with tarfile.open(longp, "w", format=tarfile.PAX_FORMAT) as t:
        for name in ("d", "d/" + "k" * 120 + ".cls", "d/short.cls"):
            info = tarfile.TarInfo(name)
            if name == "d": info.type = tarfile.DIRTYPE; t.addfile(info); continue
            data = name.encode(); info.size = len(data); t.addfile(info, __import__("io").BytesIO(data))
    for p in (shards[0], str(longp)):
        fd = os.open(p, os.O_RDONLY)
        try:
            names, offs, sizes = scan_members(fd, p)
            want = scan_tar(p)
            assert (names, list(offs), list(sizes)) == (list(want[0]), list(want[1]), list(want[2]))
        finally: os.close(fd)
    data = open(shards[0], "rb").read()
    assert plain_members(data, len(data)) is not None and plain_members(open(longp, "rb").read(), 10240) is None
