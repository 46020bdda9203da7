"""The Dask ETL engine: the local engine's bytes, on directories and bucket to bucket; a failing shard retried,
reported and rewritten alone on a re-run; a worker killed mid-run; an unreachable scheduler.

Data: 3 classes x 4 training images as 3 shards of 4 samples; one 2-worker LocalCluster for the module."""
import hashlib, os, socket, time, uuid, warnings
from pathlib import Path
import pytest

pytest.importorskip("distributed")
pytestmark = pytest.mark.slow  # each test starts Dask workers that import torch: the fast tier has 18_etl.dask_engine's light run
from shardkit.etl.dask_engine import SchedulerUnreachable, local_cluster, run_etl_dask
from shardkit.etl.receipt import MANIFEST, read_etl_manifest
from shardkit.etl.recipes import imagenet_train_uint8
from shardkit.etl import run_etl
from shardkit.ingest.folder import convert_folder, synthesize_folder
from shardkit.shards.tar import list_shards
from shardkit.errors import ShardkitError
from shardkit.stores import open_store

FN = "shardkit.etl.recipes:imagenet_train_uint8"
NAMES = [f"imagenet-train-00000{i}.tar" for i in range(3)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dask-etl")
    synthesize_folder(tmp / "tree", classes=3, per_class=4, val_per_class=0, progress=False)
    convert_folder(tmp / "tree" / "train", tmp / "src", prefix="imagenet-train-", maxcount=4, progress=False)
    return open_store(tmp / "src")


@pytest.fixture(scope="module")
def expected(src, tmp_path_factory):
    "sha256 per shard of the local engine's output (seed 0), the reference for every Dask run."
    out = tmp_path_factory.mktemp("local-out")
    s = run_etl(FN, src, out, processes=1, seed=0, progress=False)
    assert (s["written"], s["failed"]) == (3, {})
    return shas(open_store(out))


@pytest.fixture(scope="module")
def cluster():
    "One 2-worker LocalCluster for the tests that pass it as `scheduler` (a worker is killed in the last one), torch and torchvision imported."
    from distributed import Client
    with local_cluster(2) as c:
        with Client(c) as client: client.run(_warm_up)  # start-up cost here, not in the first test that uses it
        yield c


def _warm_up(): import torch, torchvision.transforms  # noqa: F401


def shas(store) -> dict:
    return {n: hashlib.sha256(store.read_bytes(n)).hexdigest() for n in store.list("*.tar")}


def test_identical_to_local_engine_on_directories(src, expected, tmp_path):
    t0 = time.perf_counter()
    s = run_etl_dask(FN, src, tmp_path / "out", seed=0, processes=1, progress=False)  # its own LocalCluster (1 worker: a loaded machine)
    assert time.perf_counter() - t0 < 120
    assert (s["way"], s["shards"], s["written"], s["resumed"], s["failed"]) == ("dask", 3, 3, 0, {})
    assert (s["samples_in"], s["samples_out"], s["skipped"]) == (12, 12, 0)
    out = open_store(tmp_path / "out")
    assert shas(out) == expected
    m = read_etl_manifest(out)
    assert m["complete"] and m["missing"] == {} and m["seed"] == 0 and m["transform"] == FN
    assert {sh["name"]: sh["sha256"] for sh in m["shards"]} == expected
    assert {r["name"]: r["source"] for r in list_shards(out)} == {n: "manifest" for n in NAMES}  # counts come from it
    assert out.list() == sorted(NAMES + [MANIFEST])  # no temporary files left


def test_identical_bucket_to_bucket(src, expected, cluster, ais_endpoint):
    b = uuid.uuid4().hex[:8]
    ais_src = open_store(f"ais://dask-src-{b}", create=True)
    for n in src.list("*.tar"): ais_src.put_file(src.path(n), n)
    try:
        t0 = time.perf_counter()
        local = run_etl(FN, ais_src.spec, f"ais://dask-local-{b}", processes=1, seed=0, progress=False)
        t1 = time.perf_counter()
        s = run_etl_dask(FN, ais_src.spec, f"ais://dask-out-{b}", seed=0, scheduler=cluster, progress=False)
        print(f"local engine {t1 - t0:.1f} s, dask engine {time.perf_counter() - t1:.1f} s")
        assert (s["written"], s["failed"], local["written"]) == (3, {}, 3)
        out = open_store(f"ais://dask-out-{b}")
        assert shas(out) == shas(open_store(f"ais://dask-local-{b}")) == expected
        assert read_etl_manifest(out)["complete"]
    finally:
        for name in ("src", "local", "out"):
            try: open_store(f"ais://dask-{name}-{b}").bucket.delete()
            except ShardkitError: pass


def picky_transform(bad_key: str | None, log: Path):
    "imagenet_train_uint8, but raising on sample `bad_key`; every attempt on that shard leaves a file in `log`."
    def picky(sample):
        if bad_key is not None and sample["__key__"] == bad_key:
            (log / uuid.uuid4().hex).touch()
            raise ValueError(f"cannot crop {bad_key}")
        return imagenet_train_uint8(sample)
    return picky


def test_failing_shard_retried_reported_then_rewritten_alone(src, expected, cluster, tmp_path):
    import webdataset as wds
    bad = sorted(s["__key__"] for s in wds.WebDataset(src.urls(NAMES[1]), shardshuffle=False))[0]
    log = tmp_path / "attempts"; log.mkdir()
    dest = tmp_path / "out"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = run_etl_dask(picky_transform(bad, log), src, dest, strict=True, seed=0, scheduler=cluster, retries=2, progress=False)
    assert len(list(log.iterdir())) == 3  # 1 attempt + 2 retries
    assert (s["written"], list(s["failed"])) == (2, [NAMES[1]])
    assert f"cannot crop {bad}" in s["failed"][NAMES[1]] and "after 3 attempts" in s["failed"][NAMES[1]]
    assert any(NAMES[1] in str(x.message) for x in w)
    out = open_store(dest)
    assert out.list("*.tar") == [NAMES[0], NAMES[2]]
    m = read_etl_manifest(out)
    assert (m["complete"], list(m["missing"]), [sh["name"] for sh in m["shards"]]) == (False, [NAMES[1]], [NAMES[0], NAMES[2]])
    before = {n: out.path(n).stat().st_mtime_ns for n in out.list("*.tar")}
    s = run_etl_dask(picky_transform(None, log), src, dest, strict=True, seed=0, scheduler=cluster, progress=False)
    assert (s["written"], s["resumed"], s["failed"]) == (1, 2, {})
    assert {n: out.path(n).stat().st_mtime_ns for n in before} == before  # the good shards were not rewritten
    assert shas(out) == expected and read_etl_manifest(out)["complete"]


def test_unreachable_scheduler_fails_fast_naming_it(src, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.perf_counter()
    with pytest.raises(SchedulerUnreachable, match=f"tcp://127.0.0.1:{port}"):
        run_etl_dask(FN, src, tmp_path / "out", scheduler=f"tcp://127.0.0.1:{port}", progress=False)
    assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_worker_killed_mid_run(src, expected, cluster, tmp_path):
    "The first task to reach a sample kills its worker process (os._exit) mid-shard; Dask reruns it elsewhere."
    marker = tmp_path / "killed"
    def killer(sample):
        try: fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError: return imagenet_train_uint8(sample)
        os.write(fd, str(os.getpid()).encode()); os.close(fd)
        os._exit(1)
    dest = tmp_path / "out"
    s = run_etl_dask(killer, src, dest, seed=0, scheduler=cluster, retries=0, progress=False)
    assert marker.exists()  # a worker did die
    assert (s["shards"], s["written"], s["failed"], s["samples_out"]) == (3, 3, {}, 12)
    out = open_store(dest)
    assert out.list() == sorted(NAMES + [MANIFEST])  # every shard exactly once, no leftovers
    assert shas(out) == expected
    assert [sh["name"] for sh in read_etl_manifest(out)["shards"]] == NAMES
