"""The training loader: exact epochs over workers and ranks, seeds, resampling, warnings, AIStore."""
import warnings
import pytest
import torch
import webdataset as wds
from shardkit.errors import UsageError
from shardkit import create_dataloader, create_dataset
from shardkit.loading.decode import MissingField, train_transform
from shardkit.loading.sources import split_count
from conftest import write_pet_shards

N_SHARDS, PER_SHARD = 6, 5


def _write_shards(folder, n_shards=N_SHARDS, per_shard=PER_SHARD, seed=0):
    return write_pet_shards(folder, n_shards, per_shard, seed=seed)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _write_shards(tmp_path_factory.mktemp("loader") / "shards")


ALL = sorted(f"s{s}_{i}" for s in range(N_SHARDS) for i in range(PER_SHARD))


def _keys(loader):
    return [k for batch in loader for k in batch[0]]


def _dataset(urls, **kw):
    kw.setdefault("fields", ("__key__", "cls", "image.jpg", "trimap.png"))
    kw.setdefault("transform", train_transform(32))
    return create_dataset(urls, **kw)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_every_sample_exactly_once_per_epoch(shards, workers):
    dl = create_dataloader(_dataset(shards, seed=1), num_workers=workers, batch_size=7)
    epochs = [_keys(dl) for _ in range(2)]
    for keys in epochs:
        assert sorted(keys) == ALL, "each sample exactly once"
    assert epochs[0] != epochs[1], "a new order every epoch"


def test_batches_keep_image_label_trimap_together(shards):
    (keys, cls, images, trimaps), *_ = list(create_dataloader(_dataset(shards, seed=0), num_workers=2, batch_size=8))
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 32, 32)
    assert trimaps.dtype == torch.uint8 and trimaps.shape == (8, 1, 32, 32)
    assert cls.dtype == torch.int64 and len(keys) == 8
    truth = {s["__key__"]: s["cls"] for s in wds.WebDataset(shards, shardshuffle=False).decode()}
    assert [truth[k] for k in keys] == cls.tolist()


@pytest.mark.parametrize("workers", [1, 2])
def test_two_ranks_split_the_epoch(shards, workers):
    per_rank = [_keys(create_dataloader(_dataset(shards, rank=r, world_size=2), num_workers=workers, batch_size=4))
                for r in (0, 1)]
    assert not set(per_rank[0]) & set(per_rank[1]), "ranks read disjoint samples"
    assert sorted(per_rank[0] + per_rank[1]) == ALL, "together they read every sample once"
    assert all(per_rank), "both ranks got work"


def test_more_workers_than_shards_warns_and_still_reads_once(shards):
    few = shards[:2]
    with pytest.warns(UserWarning, match="get no shard and stay idle"):
        dl = create_dataloader(_dataset(few, seed=2), num_workers=3, batch_size=4)
    assert sorted(_keys(dl)) == sorted(f"s{s}_{i}" for s in range(2) for i in range(PER_SHARD))
    with pytest.warns(UserWarning, match="2 workers x 2 ranks read 2 shards"):
        dls = [create_dataloader(_dataset(few, rank=r, world_size=2), num_workers=2, batch_size=4) for r in (0,)]
    assert len(_keys(dls[0])) == PER_SHARD


def test_no_webdataset_warnings_leak(shards, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = _dataset(shards, seed=0)
        _keys(create_dataloader(ds, num_workers=2, batch_size=8))
        list(_dataset(shards, resampled=True, epoch_samples=9, seed=0))
    messages = [str(w.message) for w in caught] + [capfd.readouterr().err]
    for word in ("shardshuffle", "empty", "No samples", "unclosed"):
        assert not any(word in m for m in messages), (word, messages)


def test_same_seed_same_epochs_other_seed_other_order(shards):
    def run(seed):
        dl = create_dataloader(_dataset(shards, seed=seed), num_workers=2, batch_size=8)
        out = []
        for _ in range(2):
            batches = list(dl)
            out.append(([k for b in batches for k in b[0]], torch.cat([b[2] for b in batches])))
        return out
    a, b, c = run(11), run(11), run(12)
    for (ka, ia), (kb, ib) in zip(a, b):
        assert ka == kb and torch.equal(ia, ib), "same seed: same order and same crops"
    assert a[0][0] != c[0][0], "another seed: another order"


def test_set_epoch_replays_an_epoch(shards):
    dl = create_dataloader(_dataset(shards, seed=4), num_workers=2, batch_size=8)
    first, second = _keys(dl), _keys(dl)
    dl.set_epoch(1)
    assert _keys(dl) == second
    dl.set_epoch(0)
    assert _keys(dl) == first


@pytest.mark.parametrize("workers,ranks,total", [(3, 2, 23), (2, 1, 40), (0, 2, 7)])
def test_resampled_epoch_length_is_for_the_whole_job(shards, workers, ranks, total):
    counts = []
    for r in range(ranks):
        ds = _dataset(shards, fields=("__key__",), transform=None, resampled=True, epoch_samples=total, rank=r, world_size=ranks)
        dl = create_dataloader(ds, num_workers=workers, batch_size=5)
        counts.append([len(_keys(dl)) for _ in range(2)])
    assert [sum(c[e] for c in counts) for e in range(2)] == [total, total]
    assert sum(split_count(total, s, 6) for s in range(6)) == total


def test_bad_arguments_say_what_to_do(shards):
    with pytest.raises(ValueError, match="give epoch_samples=N"): create_dataset(shards, resampled=True)
    with pytest.raises(ValueError, match="needs resampled=True"): create_dataset(shards, epoch_samples=10)
    with pytest.raises(ValueError, match="rank 3 is not in 0..1"): list(_dataset(shards, rank=3, world_size=2))
    with pytest.raises(MissingField, match="has no \\['image.png'\\]"): next(iter(create_dataset(shards, fields=("cls", "image.png"))))
    with pytest.raises(UsageError, match="needs a dataset from create_dataset"): create_dataloader(wds.WebDataset(shards, shardshuffle=False))


def test_skip_counts_samples_missing_a_field(shards, capsys):
    assert list(create_dataset(shards, fields=("cls", "image.png"), handler="skip", batch_size=None)) == []
    err = capsys.readouterr().err  # the epoch's report: counted by the error's type
    assert f"skipped {len(ALL)} bad samples" in err and f"{len(ALL)} x MissingField, e.g. sample" in err, err


def test_reads_from_aistore_exactly_once(shards, ais_endpoint):
    from shardkit.stores import open_store
    store = open_store("ais://shardkit-test-loader", create=True)
    for p in shards: store.put_file(p)
    try:
        ds = _dataset(store, seed=0)
        assert all(u.startswith("http") for u in ds.urls)
        assert sorted(_keys(create_dataloader(ds, num_workers=2, batch_size=8))) == ALL
    finally:
        for name in store.list(): store.delete(name)


def test_workers_persist_and_epochs_stay_exact(shards):
    "Persistent workers: an epoch left half-read, then whole epochs: each sample once; set_epoch still replays."
    dl = create_dataloader(_dataset(shards, seed=8), num_workers=2, batch_size=4)
    assert dl.pipeline[0].persistent_workers
    it = iter(dl)
    next(it)  # read one batch of epoch 0, then leave it
    first_pids = {w.pid for w in dl.pipeline[0]._iterator._workers}
    e1, e2 = _keys(dl), _keys(dl)
    assert sorted(e1) == sorted(e2) == ALL and e1 != e2
    assert {w.pid for w in dl.pipeline[0]._iterator._workers} == first_pids, "the same workers served every epoch"
    dl.set_epoch(1)
    assert _keys(dl) == e1, "set_epoch restarts the workers at that epoch"


def test_workers_batch_at_the_loader_batch_size_and_the_post_way_still_works(shards):
    ds = _dataset(shards, seed=3)
    sizes = [len(b[0]) for b in create_dataloader(ds, num_workers=2, batch_size=4)]
    assert sum(sizes) == len(ALL) and max(sizes) == 4
    assert ds.batch_size == 64, "the dataset handed in is left as it was"
    post = create_dataloader(ds, num_workers=2, batch_size=7, shuffle_across=100)  # unbatch, shuffle across workers, rebatch
    assert [len(b[0]) for b in post] == [7, 7, 7, 7, 2]
    assert sorted(_keys(post)) == ALL


@pytest.mark.parametrize("how", ["plain", "shuffle_across", "device"])
def test_a_dropped_loader_stops_its_workers_at_once(shards, how):
    """A loader let go of mid-epoch stops its persistent workers when its last reference goes, without the cycle
    collector: in a reference cycle, torch's DataLoader is collected after its queues and each worker waits out a 5 s
    join (10 s for two) before it is killed."""
    import gc, psutil
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    kw = {"shuffle_across": {"shuffle_across": 100}, "device": {"device": "cpu"}}.get(how, {})
    dl = create_dataloader(_dataset(shards, seed=3), num_workers=2, batch_size=7, **kw)
    _keys(dl)
    it = iter(dl)
    next(it)
    workers = [p for p in me.children() if p.pid not in before]
    assert len(workers) == 2
    gc.collect()
    gc.disable()
    try:
        del it, dl
        _, alive = psutil.wait_procs(workers, timeout=20)
    finally:
        gc.enable()
    assert not alive, f"{len(alive)} workers still running after the loader's last reference went (a reference cycle)"


def _batches(loader):
    "Every batch of one pass as (keys, labels, images, trimaps) on the CPU, kept (to see that no buffer is reused under them)."
    return [(list(k), c.cpu(), x.cpu(), t.cpu()) for k, c, x, t in loader]


@pytest.mark.slow
def test_device_cpu_gives_the_plain_loaders_batches_and_epochs(shards):
    "device='cpu' runs DeviceLoader's code (one batch ahead, no streams): same batches, epochs, set_epoch and len()."
    plain = create_dataloader(_dataset(shards, seed=6), num_workers=2, batch_size=8)
    dev = create_dataloader(_dataset(shards, seed=6), num_workers=2, batch_size=8, device="cpu")
    for _ in range(2):
        for a, b in zip(_batches(plain), _batches(dev), strict=True):
            assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
    assert dev.copied == 2 * 4 and dev.copy_seconds > 0
    dev.set_epoch(0)
    plain.set_epoch(0)
    assert _keys(dev) == _keys(plain)


def test_device_moves_tensors_and_passes_other_values():
    from shardkit.loading.pipeline import DeviceLoader
    batches = [(torch.arange(3), ["a", "b", "c"], {"x": torch.ones(2)}, 7)] * 3
    out = list(DeviceLoader(batches, "cpu"))
    assert len(out) == 3 and out[0][1] == ["a", "b", "c"] and out[0][3] == 7 and torch.equal(out[0][2]["x"], torch.ones(2))
    assert DeviceLoader([], "cpu").state_dict.__name__ == "state_dict" and list(DeviceLoader([], "cpu")) == []
    with pytest.raises(AttributeError):
        DeviceLoader(batches, "cpu").state_dict()  # a list has no state: said plainly, not hidden


def test_device_random_access_loader(shards):
    "create_dataset(access='random') with device: the same wrapper, and its state resumes at the batch after the last one handed out."
    make = lambda: create_dataloader(create_dataset(shards, fields=("__key__", "cls"), seed=1, access="random"),
                                     num_workers=0, batch_size=4, device="cpu")
    ref = _keys(make())
    a = make()
    it = iter(a)
    head = [k for _ in range(3) for k in next(it)[0]]
    state = a.state_dict()
    assert state["batch"] == 3, state
    b = make()
    b.load_state_dict(state)
    assert head + _keys(b) == ref


def _why_no_cuda():
    from shardkit.loading.gpu_decode import why_no_gpu
    return why_no_gpu()


@pytest.mark.skipif(_why_no_cuda() is not None, reason=f"needs a CUDA GPU: {_why_no_cuda()}")
def test_device_cuda_batches_equal_the_cpu_ones_and_overlap(shards):
    "On CUDA: the batches arrive on the GPU, equal to the CPU loader's, also when the step keeps the GPU busy and holds them."
    cpu = _batches(create_dataloader(_dataset(shards, seed=8), num_workers=2, batch_size=4))
    dev = create_dataloader(_dataset(shards, seed=8), num_workers=2, batch_size=4, device="cuda")
    kept = []
    for k, c, x, t in dev:
        assert x.is_cuda and c.is_cuda and t.is_cuda and isinstance(k, list)
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(5): a = a @ a / 2048  # a step running on the consumer stream while the next batch is copied
        kept.append((k, c, x.float().sum(), x))
    torch.cuda.synchronize()
    assert [k for k, *_ in kept] == [b[0] for b in cpu]
    for (k, c, s, x), b in zip(kept, cpu):
        assert torch.equal(c.cpu(), b[1]) and torch.equal(x.cpu(), b[2]) and s.item() == b[2].float().sum().item()
    assert dev.copied == len(cpu)


@pytest.mark.skipif(_why_no_cuda() is not None, reason=f"needs a CUDA GPU: {_why_no_cuda()}")
def test_device_cuda_resume(shards):
    make = lambda: create_dataloader(_dataset(shards, seed=8), num_workers=2, batch_size=4, device="cuda")
    ref = _keys(make())
    a, head = make(), []
    for b in a:
        head += b[0]
        if len(head) == 12: break
    b = make()
    b.load_state_dict(a.state_dict())
    assert head + _keys(b) == ref


def test_one_pair_of_factories_for_every_access_mode_and_device(shards):
    "create_dataset returns a data set, create_dataloader its one loader, made once: stream, random, decode_on='gpu'."
    import inspect
    import shardkit
    from shardkit.loading.gpu_decode import GpuLoader
    from shardkit.loading.pipeline import DeviceLoader
    from shardkit.loading.random_access import RandomAccessDataset, RandomAccessLoader
    from shardkit.loading.stream import ShardDataset, ShardLoader
    assert [n for n in shardkit.__all__ if n.startswith("create_")] == ["create_dataset", "create_dataloader"]
    assert [next(iter(inspect.signature(f).parameters)) for f in (create_dataset, create_dataloader)] == \
        ["source", "dataset"]
    kw = dict(fields=("__key__", "image.jpg"), transform=train_transform(32), batch_size=4, seed=2)
    made = {(a, d): create_dataset(shards, access=a, decode_on=d, **kw) for a, d in (("stream", "cpu"),
                                                                                    ("random", "cpu"),
                                                                                    ("stream", "gpu"))}
    assert [type(ds) for ds in made.values()] == [ShardDataset, RandomAccessDataset, ShardDataset]
    loaders = {k: create_dataloader(ds, num_workers=0, batch_size=3, device="cpu" if k[1] == "gpu" else None)
               for k, ds in made.items()}
    assert [type(dl) for dl in loaders.values()] == [ShardLoader, RandomAccessLoader, GpuLoader]
    for dl in loaders.values():
        assert sorted(_keys(dl)) == ALL and len(next(iter(dl))[0]) == 3  # the loader's batch size, not the data set's
        assert set(dl.state_dict()) and callable(dl.load_state_dict)
    assert type(create_dataloader(made["random", "cpu"], num_workers=0, device="cpu")) is DeviceLoader
    with pytest.raises(UsageError, match="decode_on='gpu' streams"):
        create_dataset(shards, access="random", decode_on="gpu", **kw)
    with pytest.raises(UsageError, match="decode_on must be 'cpu'"):
        create_dataset(shards, decode_on="device", **kw)
