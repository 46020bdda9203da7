"""Exact mid-epoch resume of the streaming loader (ShardLoader.state_dict / load_state_dict): after restoring into a
freshly built loader, the rest of the epoch and the next one are exactly the batches of the uninterrupted run, for any
number of workers and ranks, locally and on AIStore; the state is plain JSON; skipped samples are not decoded."""
import json, re, subprocess, sys, textwrap
import numpy as np
import pytest
import webdataset as wds
from shardkit import create_dataloader, create_dataset
from shardkit.errors import LoaderError
from shardkit.loading.decode import train_transform
from shardkit.ingest.synth import draw_animal, jpeg_bytes

SIZES = (7, 3, 5, 9, 4, 6)  # uneven shards: workers run out at different times, the last batches are partial
ALL = sorted(f"s{s}_{i}" for s, n in enumerate(SIZES) for i in range(n))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder, rng = tmp_path_factory.mktemp("resume") / "shards", np.random.default_rng(0)
    folder.mkdir()
    paths = []
    for s, n in enumerate(SIZES):
        paths.append(str(folder / f"pets-{s:05d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for i in range(n):
                w.write({"__key__": f"s{s}_{i}", "image.jpg": jpeg_bytes(draw_animal(i % 5, rng, size=(40, 30))[0]), "cls": i})
    return paths


def _loader(src, workers, rank=None, world=None, seed=3, **kw):
    ds = create_dataset(src, fields=("__key__", "cls", "image.jpg"), transform=train_transform(16), shuffle=8, batch_size=4,
                        seed=seed, rank=rank, world_size=world)
    return create_dataloader(ds, num_workers=workers, batch_size=4, **kw)


def _batch(b): return (tuple(b[0]), b[1].tolist(), int(b[2].sum()))  # keys, labels and the pixels' sum: same augmentation too


def _epochs(dl, n=2): return [[_batch(b) for b in dl] for _ in range(n)]


def _take(dl, k):
    out = []
    for b in dl:
        out.append(_batch(b))
        if len(out) == k: break
    return out


def _check_resume(src, workers, world, cuts, **kw):
    for rank in range(world):
        make = lambda: _loader(src, workers, rank if world > 1 else None, world if world > 1 else None, **kw)
        ref = _epochs(make())
        n0 = len(ref[0])
        assert n0 > 1 and ref[0] != ref[1]
        for cut in [{"first": 1, "middle": n0 // 2, "last": n0}[c] for c in cuts]:
            a = make()
            head = _take(a, cut)
            state = json.loads(json.dumps(a.state_dict()))  # plain data, through JSON
            assert state["epoch"] == 0 and sum(state["batches"]) == cut and len(state["batches"]) == max(workers, 1)
            b = make()
            b.load_state_dict(state)
            rest, nxt = [_batch(x) for x in b], [_batch(x) for x in b]
            assert head + rest == ref[0], f"rank {rank}, {workers} workers, cut after {cut} of {n0}: the rest of the epoch differs"
            assert nxt == ref[1], "the next epoch differs"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_resume_is_exact(shards, workers, world):
    "At the first batch, a middle one and the last one of the epoch (then across the boundary into the next)."
    _check_resume(shards, workers, world, ["first", "middle", "last"])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_the_device_copy_is_exact(shards, workers):
    "device='cpu': the batch being copied ahead is neither lost nor counted twice, at the first, a middle and the last batch."
    _check_resume(shards, workers, 1, ["first", "middle", "last"], device="cpu")


def test_an_epoch_read_to_the_end_resumes_at_the_next(shards):
    a = _loader(shards, 2)
    first = [_batch(b) for b in a]
    state = a.state_dict()
    assert state["epoch"] == 1 and state["batches"] == [0, 0]
    b = _loader(shards, 2)
    b.load_state_dict(state)
    ref = _epochs(_loader(shards, 2))
    assert first == ref[0] and [_batch(x) for x in b] == ref[1]


RESUME = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from test_resume import _batch, _loader
    dl = _loader(json.loads(sys.argv[2]), 2, seed=None)
    dl.load_state_dict(json.loads(sys.argv[3]))
    print(json.dumps([_batch(b) for b in dl]))
""")


@pytest.mark.slow
def test_resume_in_a_new_process_takes_the_saved_seed(shards):
    "seed=None draws a seed; the resumed process, also built with seed=None, takes the saved one (and says nothing)."
    a = _loader(shards, 2, seed=None)
    head = _take(a, 3)
    state = a.state_dict()
    r = subprocess.run([sys.executable, "-c", RESUME, str(__import__("pathlib").Path(__file__).parent), json.dumps(shards),
                        json.dumps(state)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rest = [(tuple(k), labels, total) for k, labels, total in json.loads(r.stdout.strip().splitlines()[-1])]
    ref = _epochs(_loader(shards, 2, seed=state["seed"]), 1)[0]
    assert head + rest == ref


def test_a_setting_that_changes_the_order_is_named(shards):
    a = _loader(shards, 2, seed=3)
    _take(a, 2)
    state = a.state_dict()
    with pytest.raises(LoaderError, match=r"seed is 4 here, 3 in the saved state"):
        _loader(shards, 2, seed=4).load_state_dict(state)
    with pytest.raises(LoaderError, match=r"seed is 4 here, 3 in the saved state"):  # on another shape too
        _loader(shards, 1, seed=4).load_state_dict(state)
    with pytest.raises(LoaderError, match=r"shards is"):
        _loader(shards[:-1], 2, seed=3).load_state_dict(state)
    with pytest.raises(LoaderError, match="shuffle_across=0"):
        _loader(shards, 2, shuffle_across=16).state_dict()


class CountingTransform:
    "train_transform(16) that counts the samples it augments (decoding happens for exactly those)."
    def __init__(self): self.tf, self.n = train_transform(16), 0
    def __call__(self, x): self.n += 1; return self.tf(x)


def test_skipped_samples_are_not_decoded(shards):
    ref = _epochs(_loader(shards, 0), 1)[0]
    a = _loader(shards, 0)
    _take(a, 5)
    state = a.state_dict()
    tf = CountingTransform()
    ds = create_dataset(shards, fields=("__key__", "cls", "image.jpg"), transform={"image.jpg": tf}, shuffle=8, batch_size=4, seed=3)
    b = create_dataloader(ds, num_workers=0, batch_size=4)
    b.load_state_dict(state)
    rest = [x for x in b]
    assert [tuple(x[0]) for x in rest] == [r[0] for r in ref[5:]]
    assert tf.n == len(ALL) - 5 * 4, f"{tf.n} samples decoded; only the {len(ALL) - 20} after the resume point should be"


def test_resume_from_aistore(shards, ais_endpoint):
    from shardkit.stores import open_store
    store = open_store("ais://shardkit-test-resume", create=True)
    for p in shards: store.put_file(p)
    try: _check_resume(store, 2, 1, ["middle"])
    finally:
        for name in store.list(): store.delete(name)


@pytest.mark.parametrize("change, says", [
    (dict(batches=[1] * 50), "batches has 50 entries in the saved state; it should be a list of 2 counts, one per worker"),
    (dict(batches="2,1"), "batches has '2,1'"),
    (dict(next_worker=2), "next_worker is 2 in the saved state; it should be a whole number from 0 to 1"),
    (dict(next_worker=-1), "next_worker is -1"),
    (dict(epoch=-1), "epoch is -1 in the saved state; it should be a whole number, 0 or more"),
    (dict(batches=[1, -3]), "batches[1] is -3 in the saved state; it should be a whole number, 0 or more"),
    (dict(batches=[1, "x"]), "batches[1] is 'x'"),
    (dict(epoch="0"), "epoch is '0'"),
    (dict(epoch=True), "epoch is True"),
    (dict(epoch=None), "epoch is None"),
])
def test_a_malformed_state_is_refused_by_field(shards, change, says):
    "A corrupted checkpoint: each malformed field is a LoaderError naming it and what it should be, before anything runs."
    a = _loader(shards, 2)
    _take(a, 2)
    state = a.state_dict()
    with pytest.raises(LoaderError, match=re.escape(says)):
        _loader(shards, 2).load_state_dict({**state, **change})


def test_a_state_that_is_not_a_dict_is_refused(shards):
    with pytest.raises(LoaderError, match="cannot resume from a list"):
        _loader(shards, 2).load_state_dict([1, 2])


@pytest.mark.parametrize("change, says", [
    (dict(position=99), "position is 99 in the saved state; it should be a whole number from 0 to 34"),
    (dict(position=-1), "position is -1"), (dict(position="3"), "position is '3'"),
    (dict(epoch=-1), "epoch is -1 in the saved state; it should be a whole number, 0 or more"), (dict(epoch=None), "epoch is None"),
])
def test_the_random_loader_refuses_a_malformed_state(shards, change, says):
    from shardkit.loading.pipeline import create_dataloader, create_dataset
    make = lambda: create_dataloader(create_dataset(shards, fields=("__key__", "cls"), batch_size=4, seed=1,
                                                    access="random"), num_workers=0)
    a = make()
    next(iter(a))
    with pytest.raises(LoaderError, match=re.escape(says)):
        make().load_state_dict({**a.state_dict(), **change})
    with pytest.raises(LoaderError, match="cannot resume from a str"): make().load_state_dict("x")


# Elastic resume (nbs/24b_elastic): a job stopped on one shape goes on on another, every sample of the epoch once.
# (ranks, workers per rank, batch size): every rank and worker count of {1, 2, 3} x {0, 1, 3}, in 6 pairs
ELASTIC = [((1, 0, 4), (3, 3, 5)), ((2, 1, 4), (1, 0, 4)), ((3, 3, 4), (2, 0, 6)), ((1, 3, 5), (2, 1, 4)),
           ((2, 0, 4), (3, 1, 4)), ((3, 1, 6), (1, 3, 4))]


@pytest.fixture(scope="module")
def elastic_shards(tmp_path_factory):
    "1,200 keys-only samples in 12 shards of 100."
    from shardkit.shards.write import write_shards
    folder = tmp_path_factory.mktemp("elastic")
    write_shards(({"__key__": f"k{i:04d}", "cls": i % 7} for i in range(1200)), folder, maxcount=100, progress=False)
    return folder


def _job(src, shape, share=None, states=None):
    "Each rank of `shape` in turn: the keys it hands out (all, or until it has `share` of its part), and its state."
    ranks, workers, bs = shape
    keys, saved = [], []
    for r in range(ranks):
        ds = create_dataset(src, fields=("__key__",), transform=None, shuffle=50, batch_size=bs, seed=5, rank=r,
                            world_size=ranks)
        dl = create_dataloader(ds, num_workers=workers)
        if states is not None: dl.load_state_dict(states)
        it, mine = iter(dl), []
        for b in it:
            mine += list(b[0])
            if share is not None and len(mine) >= share * 1200 / ranks: break
        keys += mine
        saved.append(dl.state_dict()); del it
    return keys, saved


def _exactly_once_after_reshapes(src, pairs, shares=(0.01, 0.5, 0.99)):
    for a, b in pairs:
        for share in shares:
            head, states = _job(src, a, share)
            tail, _ = _job(src, b, states=states)
            both = head + tail
            assert len(both) == len(set(both)) == 1200, (a, b, share, len(head), len(tail), len(set(both)))


@pytest.mark.slow
@pytest.mark.parametrize("pairs", [ELASTIC[:3], ELASTIC[3:]], ids=["pairs0-2", "pairs3-5"])
def test_streaming_resume_on_another_shape_reads_each_sample_once(elastic_shards, pairs):
    "Stopped at 1%, 50% and 99% of an epoch on one shape, gone on with on another: every sample once, none twice."
    _exactly_once_after_reshapes(elastic_shards, pairs)


def test_streaming_resume_reshapes_twice_and_refuses_half_a_job(elastic_shards):
    "A job resumed on another shape, stopped again and resumed on a third; one rank's state alone is refused."
    head, states = _job(elastic_shards, (2, 1, 4), 0.3)
    mid, states2 = _job(elastic_shards, (3, 0, 5), 0.3, states=states)
    assert all(s["plan"] for s in states2), "the state of a resumed epoch keeps its plan"
    again, _ = _job(elastic_shards, (3, 0, 5), states=states2)  # the same shape as it saved: the plan goes on
    tail, _ = _job(elastic_shards, (1, 3, 4), states=states2)   # another shape again
    assert len(set(head + mid + again)) == len(head + mid + again) == 1200
    assert sorted(head + mid + tail) == sorted(head + mid + again)
    with pytest.raises(LoaderError, match=r"the states are of ranks \[0\], and the saved run had 2"):
        _job(elastic_shards, (1, 0, 4), states=states[:1])
    with pytest.raises(LoaderError, match="pass every rank's state_dict"):
        _job(elastic_shards, (3, 0, 4), states=states[1])


def test_streaming_resume_on_another_shape_from_aistore(elastic_shards, ais_endpoint):
    import uuid
    from shardkit.stores import open_store
    store = open_store(f"ais://shardkit-elastic-{uuid.uuid4().hex[:8]}", create=True)
    try:
        for p in sorted(elastic_shards.glob("*")): store.put_file(p)
        _exactly_once_after_reshapes(store.spec, ELASTIC[1:3], shares=(0.5,))
    finally:
        for name in store.list(): store.delete(name)
