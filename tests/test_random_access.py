"""The random-access loader: exact and equal epochs over ranks and workers, resume in a fresh process, AIStore GetBatch, pickle refusal."""
import os, pickle, subprocess, sys, uuid
import numpy as np
import pytest
import torch
import webdataset as wds
from shardkit import create_dataset
from shardkit.loading.decode import train_transform
from shardkit.loading.index import RandomAccessError, index_cache_dir, sample_index
from shardkit.loading.order import epoch_batches
from shardkit.loading.pipeline import create_dataloader, create_dataset
from shardkit.errors import LoaderError, UsageError
from shardkit.stores import open_store
from shardkit.ingest.synth import draw_animal, jpeg_bytes, png_bytes

SIZES = (7, 3, 5, 9)  # uneven shards, 24 samples
ALL = sorted(f"s{s}_{i:02d}" for s, n in enumerate(SIZES) for i in range(n))


def _write_shards(folder, sizes=SIZES, extra=None, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, n in enumerate(sizes):
        paths.append(str(folder / f"pets-{s:05d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for i in range(n):
                cls = int(rng.integers(0, 37))
                img, tri = draw_animal(cls, rng, size=(32, 24))
                w.write({"__key__": f"s{s}_{i:02d}", "image.jpg": jpeg_bytes(img), "cls": cls, "trimap.png": png_bytes(tri),
                         **(extra or {})})
    return paths


@pytest.fixture(autouse=True)
def _cache_home(tmp_path_factory, monkeypatch):
    "Index caches go to a temp SHARDKIT_HOME, never to the user's."
    monkeypatch.setenv("SHARDKIT_HOME", str(tmp_path_factory.getbasetemp() / "home"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _write_shards(tmp_path_factory.mktemp("random") / "shards")


def _keys(loader):
    return [list(b[0]) for b in loader]


def _loader(src, **kw):
    kw.setdefault("fields", ("__key__", "cls", "image.jpg"))
    kw.setdefault("transform", train_transform(16))
    num_workers = kw.pop("num_workers", 2)
    return create_dataloader(create_dataset(src, access="random", **kw), num_workers=num_workers)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_every_sample_exactly_once_equal_batches(shards, world, workers):
    dls = [_loader(shards, batch_size=3, num_workers=workers, seed=1, rank=r, world_size=world) for r in range(world)]
    epochs = []
    for _ in range(2):
        per_rank = [_keys(dl) for dl in dls]
        assert len({len(p) for p in per_rank}) == 1, "every rank gets the same number of batches"
        assert all(len(b) == 3 for p in per_rank for b in p), "every batch is full"
        keys = [k for p in per_rank for b in p for k in b]
        assert sorted(keys) == ALL, "each sample exactly once per epoch"
        epochs.append([k for step in zip(*per_rank) for b in step for k in b])
    assert epochs[0] != epochs[1], "a new order every epoch"
    again = [_loader(shards, batch_size=3, num_workers=0, seed=1, rank=r, world_size=world) for r in range(world)]
    assert [k for step in zip(*[_keys(dl) for dl in again]) for b in step for k in b] == epochs[0], "same seed, same order"


def test_order_is_the_same_for_any_number_of_workers_and_ranks(shards):
    one = [k for b in _keys(_loader(shards, batch_size=6, num_workers=0, seed=5)) for k in b]
    two = [_keys(_loader(shards, batch_size=3, num_workers=2, seed=5, rank=r, world_size=2)) for r in (0, 1)]
    assert [k for step in zip(*two) for b in step for k in b] == one, "a global batch does not depend on the world size"


def test_remainder_is_dropped_or_padded(shards):
    drop = [_keys(_loader(shards, batch_size=5, num_workers=0, rank=r, world_size=2)) for r in (0, 1)]
    assert [len(p) for p in drop] == [2, 2]
    flat = [k for p in drop for b in p for k in b]
    assert len(flat) == len(set(flat)) == 20, "4 samples left out of this epoch, none twice"
    pad = [_keys(_loader(shards, batch_size=5, num_workers=0, rank=r, world_size=2, pad=True)) for r in (0, 1)]
    assert [len(p) for p in pad] == [3, 3]
    flat = [k for p in pad for b in p for k in b]
    assert sorted(set(flat)) == ALL and len(flat) == 30, "every sample, 6 of them twice"
    perm = epoch_batches(24, 30, 0, 0, pad=True)[0]
    idx = sample_index(shards, ("__key__",))
    assert [k for step in zip(*pad) for b in step for k in b][24:] == [idx.key(i) for i in perm[:6]], "padding repeats the permutation's start"
    with pytest.raises(UsageError, match="pad=True"):
        _loader(shards, batch_size=20, world_size=2, rank=0)


def test_one_rank_delivers_the_partial_last_batch_by_default(shards):
    "As DataLoader does (drop_last=False): every sample once an epoch, the last batch smaller; drop_last=True is the choice."
    full = _keys(_loader(shards, batch_size=5, num_workers=0))
    assert [len(b) for b in full] == [5, 5, 5, 5, 4]
    assert sorted(k for b in full for k in b) == ALL
    dropped = _keys(_loader(shards, batch_size=5, num_workers=0, drop_last=True))
    assert dropped == full[:4], "the same order, without the tail"
    with pytest.raises(UsageError, match="same number of full batches"):
        _loader(shards, batch_size=5, rank=0, world_size=2, drop_last=False)


def test_same_crop_as_the_streaming_loader(shards):
    tf = train_transform(16)
    stream = {k: img for k, img in create_dataset(shards, fields=("__key__", "image.jpg"), transform=tf, seed=3, batch_size=None)}
    ours = {k: img for b in _loader(shards, fields=("__key__", "image.jpg"), batch_size=4, num_workers=2, seed=3) for k, img in zip(*b)}
    assert sorted(ours) == sorted(stream)
    assert all(torch.equal(ours[k], stream[k]) for k in ours), "same seed, epoch and key: same augmentation"


RESUME = r'''
import pickle, sys
from shardkit import create_dataloader, create_dataset
from shardkit.loading.decode import train_transform
src, state, n = pickle.loads(sys.stdin.buffer.read())
dl = create_dataloader(create_dataset(src, fields=("__key__", "image.jpg"), transform=train_transform(16),
                                      batch_size=5, seed=7, access="random"), num_workers=1)
dl.load_state_dict(state)
out = []
while len(out) < n:
    for b in dl:
        out.append(b)
        if len(out) == n: break
sys.stdout.buffer.write(pickle.dumps(out))
'''


def _take(dl, n):
    out = []
    while len(out) < n:
        for b in dl:
            out.append(b)
            if len(out) == n: break
    return out


TOTAL = 10  # 4 batches of 5 per epoch (4 samples dropped): 2.5 epochs


@pytest.fixture(scope="module")
def uninterrupted(shards):
    return _take(_loader(shards, fields=("__key__", "image.jpg"), batch_size=5, num_workers=2, seed=7), TOTAL)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [1, 2, 4, 6], ids=["first-batch", "middle", "last-batch-of-epoch", "next-epoch"])
def test_resume_in_a_fresh_process(shards, uninterrupted, stop):
    dl = _loader(shards, fields=("__key__", "image.jpg"), batch_size=5, num_workers=2, seed=7)
    head = _take(dl, stop)
    state = dl.state_dict()
    r = subprocess.run([sys.executable, "-c", RESUME], input=pickle.dumps((os.path.dirname(shards[0]), state, TOTAL - stop)),
                       capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    resumed = head + pickle.loads(r.stdout)
    assert len(resumed) == TOTAL
    for a, b in zip(uninterrupted, resumed):
        assert a[0] == b[0], "same keys"
        assert torch.equal(a[1], b[1]), "same pixels, same augmentation"


def test_resume_refuses_another_order(shards):
    dl = _loader(shards, batch_size=5, num_workers=0, seed=7)
    with pytest.raises(LoaderError, match="seed is 8 here, 7 in the saved state"):
        _loader(shards, batch_size=4, num_workers=0, seed=8).load_state_dict(dl.state_dict())


def test_a_state_with_the_span_under_window_resumes_the_same(shards):
    "A saved state whose span of shards is under the key `window` resumes as it does under `span`."
    def cached(**kw):
        return _loader(shards, fields=("__key__",), transform=None, batch_size=5, num_workers=0, seed=7, **kw)
    dl = cached(read="cache", shard_cache=2)
    _take(dl, 2)
    state = dl.state_dict()
    assert state["span"] == 2 and "window" not in state
    old = {("window" if k == "span" else k): v for k, v in state.items()}
    a, b = cached(read="cache", shard_cache=2), cached(read="cache", shard_cache=2)
    a.load_state_dict(state)
    b.load_state_dict(old)
    assert a.state_dict() == b.state_dict() and _keys(a) == _keys(b) and len(_keys(a)) > 0
    with pytest.raises(LoaderError, match="span is None here, 2 in the saved state"):
        cached().load_state_dict(old)  # local shards read in place: a global order, not spans of 2


# Elastic resume: 1,200 samples, 12 a step of the whole job on every shape, so that a resume after 1, 50 or 99 steps is
# at 1%, 50% and 99% of the epoch. (ranks, workers per rank, batch size per rank)
ELASTIC = (1, 0, 12), (2, 1, 6), (3, 3, 4), (1, 3, 12), (2, 0, 6), (3, 1, 4)
PAIRS = [(ELASTIC[i], ELASTIC[(i + k) % len(ELASTIC)]) for i in range(len(ELASTIC)) for k in (1, 2)]


@pytest.fixture(scope="module")
def elastic_shards(tmp_path_factory):
    from shardkit.shards.write import write_shards
    folder = tmp_path_factory.mktemp("elastic")
    write_shards(({"__key__": f"k{i:04d}", "cls": i % 7} for i in range(1200)), folder, maxcount=100, progress=False)
    return folder


def _job(src, shape, state=None, weights=None):
    "One loader per rank of `shape` (of a mix, given `weights`), each resumed from `state` if given."
    ranks, workers, bs = shape
    dls = [create_dataloader(create_dataset(src, fields=("__key__",), transform=None, batch_size=bs, seed=11, rank=r,
                                            world_size=ranks, weights=weights, access="random"), num_workers=workers) for r in range(ranks)]
    for dl in dls:
        if state is not None: dl.load_state_dict(state)
    return dls


def _steps(dls, n=None):
    "The keys of the job's next `n` steps (None: to the epoch's end), rank 0's batch first in each; rank 0's state."
    its, out = [iter(dl) for dl in dls], []
    for i, step in enumerate(zip(*its)):
        out.append([k for b in step for k in b[0]])
        if n is not None and i + 1 == n: break
    state = dls[0].state_dict()
    del its
    return out, state


def _elastic_check(src, pairs, points=(1, 50, 99), weights=None):
    whole, _ = _steps(_job(src, (1, 0, 12), weights=weights))
    assert sorted(k for s in whole for k in s if k[0] == "k") == [f"k{i:04d}" for i in range(1200)]
    for a, b in pairs:
        for p in points:
            head, state = _steps(_job(src, a, weights=weights), p)
            tail, _ = _steps(_job(src, b, state, weights=weights))
            assert head + tail == whole, f"{a} -> {b} after {p} steps: not the uninterrupted run's batches"


@pytest.mark.slow
@pytest.mark.parametrize("pairs", [PAIRS[:6], PAIRS[6:]], ids=["pairs0-5", "pairs6-11"])
def test_resume_on_another_shape_gives_the_uninterrupted_batches(elastic_shards, pairs):
    "Any number of ranks and workers, the same samples a step: the batches after the resume are the uninterrupted run's."
    _elastic_check(elastic_shards, pairs)


def test_resume_on_another_step_size_reads_the_rest_once(elastic_shards, capsys):
    "12 a step, then 7 on one rank: the rest of the same order, cut anew, each sample once."
    whole, _ = _steps(_job(elastic_shards, (1, 0, 12)))
    head, state = _steps(_job(elastic_shards, (2, 1, 6)), 50)
    tail, _ = _steps(_job(elastic_shards, (1, 0, 7), state))
    assert [k for s in head + tail for k in s] == [k for s in whole for k in s] and len(tail[0]) == 7
    assert "resumed at sample 600 of epoch 0's order on steps of 7 samples, not 12" in capsys.readouterr().err


def _mixed_check(sources, pairs):
    "A 2:1 mix: each epoch-source sample once, the other source's count exact, every prefix within 1; elastic resume."
    whole, _ = _steps(_job(sources, (1, 0, 12), weights=dict(zip(sources, (2, 1)))))
    other = np.cumsum([k[0] == "m" for s in whole for k in s])
    assert other[-1] == 600 and np.abs(other - np.arange(1, len(other) + 1) / 3).max() <= 1, other[-1]
    _elastic_check(sources, pairs, (1, 50, 140), weights=dict(zip(sources, (2, 1))))  # 150 steps of 12


def test_resume_on_another_shape_on_aistore(elastic_shards, ais_endpoint, tmp_path):
    """The same, reading a bucket (the shard cache, ais://'s default); then the bucket mixed 2:1 with a folder of
    fewer samples (read about 7 times each), resumed on other shapes: the uninterrupted run's batches again."""
    from shardkit.shards.write import write_shards
    small = tmp_path / "small"
    write_shards(({"__key__": f"m{i:03d}", "cls": 0} for i in range(90)), small, maxcount=20, progress=False)
    name = f"shardkit-elastic-{uuid.uuid4().hex[:8]}"
    store = open_store(f"ais://{name}", create=True)
    try:
        for p in sorted(elastic_shards.glob("*")): store.put_file(p)
        _elastic_check(f"ais://{name}", [PAIRS[1], PAIRS[4]])
        _mixed_check({"bucket": f"ais://{name}", "folder": small}, [PAIRS[1], PAIRS[4]])
    finally:
        for n in store.list(): store.delete(n)


def test_set_epoch(shards):
    dl = _loader(shards, batch_size=4, num_workers=0)
    e0, e1 = _keys(dl), _keys(dl)
    dl.set_epoch(1)
    assert _keys(dl) == e1
    dl.set_epoch(0)
    assert _keys(dl) == e0


def test_pickle_refused_by_default(tmp_path):
    paths = _write_shards(tmp_path / "p", sizes=(2,), extra={"meta.pyd": pickle.dumps({"x": 1})})
    with pytest.raises(UsageError, match=r"'meta.pyd'.*allow_pickle=True"):
        create_dataloader(create_dataset(paths, fields=("cls", "meta.pyd"), batch_size=2, access="random"),
                          num_workers=0)
    (cls, meta), = list(create_dataloader(create_dataset(paths, fields=("cls", "meta.pyd"), batch_size=2,
                                                         allow_pickle=True, access="random"), num_workers=0))
    assert meta == [{"x": 1}, {"x": 1}]


def test_cache_is_keyed_by_path_size_and_mtime(tmp_path):
    paths = _write_shards(tmp_path / "c", sizes=(3,))
    assert len(sample_index(paths, ("cls",))) == 3
    n = len(list(index_cache_dir().glob("*.npz")))
    assert len(sample_index(paths, ("cls",))) == 3 and len(list(index_cache_dir().glob("*.npz"))) == n, "second time from the cache"
    _write_shards(tmp_path / "c", sizes=(5,), seed=1)  # rewritten in place: new size and mtime
    assert len(sample_index(paths, ("cls",))) == 5


def test_keys_from_tar_headers_or_memory(shards, tmp_path):
    idx = sample_index(shards, ("cls", "image.jpg"))
    assert idx.keys is None and idx.nbytes / len(idx) == 28, "short ASCII names: keys are read back from the headers"
    long = str(tmp_path / "long.tar")
    with wds.TarWriter(long) as w:
        for i in range(3): w.write({"__key__": f"{'k' * 120}_{i}", "cls": i})
    lidx = sample_index([long], ("cls",))
    assert lidx.keys is not None and lidx.key(2) == f"{'k' * 120}_2", "long names (pax headers): keys kept in memory"
    (keys, cls), = list(create_dataloader(create_dataset([long], fields=("__key__", "cls"), batch_size=3,
                                                         access="random"), num_workers=0))
    assert sorted(zip(keys, cls.tolist())) == [(f"{'k' * 120}_{i}", i) for i in range(3)]


def test_unwritable_cache_warns_and_still_indexes(shards, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("SHARDKIT_HOME", str(tmp_path / "file"))
    with pytest.warns(UserWarning, match="cannot cache the index"):
        assert len(sample_index(shards[:1], ("cls",))) == SIZES[0]


def test_bench_cli_is_a_thin_layer(shards, capsys):
    "`shardkit bench random` through the real command table (a test that registered it would pass with it deleted)."
    from shardkit.apps import cli
    src = os.path.dirname(shards[0])
    assert cli.main(["bench", "random", src, "--workers", "0", "--samples", "24", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "read" in out and "decode" in out and "samples/s" in out
    assert cli.main(["bench", "random", src, "--shard-index"]) == 2
    assert "shard_index is for ais:// buckets" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_mix_cli_prints_the_ratios(elastic_shards, capsys):
    "`shardkit bench mix`: the four contenders, each mix against one source, and the verdict line."
    from shardkit.apps import cli
    assert cli.main(["bench", "mix", str(elastic_shards), "--repeats", "1", "--batch-size", "50", "--workers", "1",
                     "--no-images"]) == 0
    out = capsys.readouterr().out
    for row in ("stream, one source", "stream, mix of 2", "random access, one source", "random access, mix of 2"):
        assert row in out, out
    assert "label and key only" in out and "CPU per sample at most (goal: within +5%)" in out, out
    assert out.count("x ") >= 2 and " 1200 " in out, out


def test_missing_field_is_named(shards):
    with pytest.raises(RandomAccessError, match=r"has no \['depth.png'\]"):
        sample_index(shards, ("cls", "depth.png"))


def test_bench_ais_index_on_aistore(shards, ais_endpoint, capsys):
    "`bench_ais_index`: the loader measured on a bucket without, then with, AIStore's shard index; and its command."
    from shardkit.apps import cli
    from shardkit.bench.access import bench_ais_index
    name = f"shardkit-bench-index-{uuid.uuid4().hex[:8]}"
    store = open_store(f"ais://{name}", create=True)
    try:
        for p in shards: store.put_file(p)
        res = bench_ais_index(f"ais://{name}", fields=("cls", "image.jpg"), num_workers=0, samples=24, batch_size=8)
        assert set(res) == {"without index", "with index", "build_s", "modes"} and res["build_s"] > 0, res
        assert {"stream", "cache", "range", "getbatch"} <= set(res["modes"]), res["modes"]  # side by side on one bucket
        for when in ("without index", "with index"):
            for mode in ("read", "decode"):
                r = res[when][mode]
                assert (r["samples"], r["read_only"]) == (24, mode == "read") and r["rate"] > 0 and r["cpu_ms"] > 0, r
        # with the index in place, GetBatch still reads the bucket as the same samples, batch for batch (a global
        # shuffle, as over local shards; the shard cache, ais://'s default, shuffles within spans of shards instead)
        assert _keys(_loader(f"ais://{name}", batch_size=5, seed=3, read="getbatch")) == \
            _keys(_loader(shards, batch_size=5, seed=3))
        args = ["--shard-index", "--workers", "0", "--samples", "24", "--batch-size", "8"]
        assert cli.main(["bench", "random", f"ais://{name}", *args]) == 0
        out = capsys.readouterr().out
        for row in ("read, without index", "decode, without index", "read, with index", "decode, with index"):
            assert row in out, out
    finally:
        for n in store.list(): store.delete(n)


def test_on_aistore_a_shard_replaced_after_indexing_is_named(shards, ais_endpoint, tmp_path):
    "GetBatch with and without AIStore's shard index is the notebook's (nbs/27_random_access); this guards the error path."
    name = f"shardkit-random-{uuid.uuid4().hex[:8]}"
    store = open_store(f"ais://{name}", create=True)
    try:
        for p in shards: store.put_file(p)
        dl = _loader(f"ais://{name}", fields=("__key__", "image.jpg"), batch_size=5, num_workers=0, seed=7)
        assert len(dl.dataset.index) == 24
        other = _write_shards(tmp_path / "other", sizes=(3,), seed=9)
        store.put_file(other[0], "pets-00003.tar")
        victim = next(i for i in range(24) if dl.dataset.index.key(i).startswith("s3_0"))
        with pytest.raises(RandomAccessError, match=rf"ais://{name}/pets-00003.tar") as e:
            dl.dataset[(0, [victim])]
        assert dl.dataset.index.key(victim) in str(e.value)
    finally:
        store.bucket.delete()
