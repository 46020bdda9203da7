"""ETL: one transform run five ways must agree; the server under a real ASGI server; bad input and faults.

Data: 3 classes x 4 training images as 3 shards of 4 samples (val-style transform) -- seconds, not minutes."""
import io, os, socket, subprocess, sys, tarfile, threading, time, warnings
from pathlib import Path
import numpy as np
import pytest
import requests
import webdataset as wds
from shardkit.etl.core import ShardTransform, SampleError, etl_stage
from shardkit.etl.server import etl_unavailable
from shardkit.etl.transforms import imagenet_val_npy, imagenet_train_npy
from shardkit.etl import run_etl
from shardkit.shards.fields import ShardError
from shardkit.shards.read import read_samples
from shardkit.etl.sidecar import Sidecar, sidecar_server
from shardkit.folder import convert_folder, synthesize_folder
from shardkit.store import open_store
from shardkit.cli import main

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etl")
    synthesize_folder(tmp / "tree", classes=3, per_class=4, val_per_class=0, progress=False)
    convert_folder(tmp / "tree" / "train", tmp / "src", prefix="imagenet-train-", maxcount=4, progress=False)
    return open_store(tmp / "src")


@pytest.fixture(scope="module")
def transforms_module(tmp_path_factory):
    "A user's module of sample functions, importable as MODULE:FUNC by the CLI (cwd on sys.path)."
    d = tmp_path_factory.mktemp("userfns")
    (d / "userfns.py").write_text(
        "from shardkit.etl.transforms import imagenet_val_npy\n"
        "def picky(sample):\n"
        "    if sample['__key__'].endswith(('1', '5')): raise ValueError('unlucky key')\n"
        "    return imagenet_val_npy(sample)\n")
    return d


def decoded(tar_bytes):
    from webdataset.autodecode import Decoder, ImageHandler
    dec = Decoder([ImageHandler("pil")])
    return {s["__key__"]: dec(s) for s in read_samples(io.BytesIO(tar_bytes))}


def same_samples(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k]["npy"], b[k]["npy"]), k
        assert a[k]["cls"] == b[k]["cls"], k


def way1(src, fn, seed=None):
    ds = wds.WebDataset(src.urls(src.list("*.tar")), shardshuffle=False).compose(etl_stage(fn, seed=seed))
    return {s["__key__"]: s for s in ds}


def shardkit(capsys, *args) -> tuple[int, str]:
    "Run `shardkit ARGS` in this process (the CLI's own entry point); its return code and output."
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_four_ways_identical_for_val_transform(src, tmp_path, capsys):
    one = way1(src, imagenet_val_npy)
    assert len(one) == 12
    # way 2: shard by shard
    st = ShardTransform(imagenet_val_npy)
    two = {}
    for n in src.list("*.tar"): two.update(decoded(st(src.read_bytes(n), n)))
    same_samples(one, two)
    # way 4: `shardkit etl serve` in another process, read by plain WebDataset over HTTP
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shardkit.cli", "etl", "serve", "shardkit.etl.transforms:imagenet_val_npy",
                             "--source", str(src.root), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc)
        urls = [f"http://127.0.0.1:{port}/{n}" for n in src.list("*.tar")]
        four = {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False).decode()}
    finally:
        proc.terminate(); proc.wait(10)
    same_samples(one, four)
    # way 5: `shardkit etl run` with two worker processes
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.transforms:imagenet_val_npy", src.root, tmp_path / "out", "--workers", 2)
    assert rc == 0 and "3 of 3 shards written" in out and "12 in, 12 out, 0 skipped" in out, out
    five = {}
    for n in src.list("*.tar"): five.update(decoded((tmp_path / "out" / n).read_bytes()))
    same_samples(one, five)


def test_random_transform_identical_with_seed(src, tmp_path):
    one = way1(src, imagenet_train_npy, seed=7)
    sc = Sidecar(imagenet_train_npy, src, seed=7)
    with sc:
        four = {s["__key__"]: s for s in wds.WebDataset(src.urls(src.list("*.tar"), etl=sc), shardshuffle=False).decode()}
    same_samples(one, four)
    run_etl(imagenet_train_npy, src, tmp_path / "out", workers=1, seed=7, progress=False)
    five = {}
    for n in src.list("*.tar"): five.update(decoded((tmp_path / "out" / n).read_bytes()))
    same_samples(one, five)
    # a different seed gives different crops: the seed really drives the randomness
    other = way1(src, imagenet_train_npy, seed=8)
    assert sum(not np.array_equal(other[k]["npy"], one[k]["npy"]) for k in one) >= 10


def test_raising_transform_skipped_and_counted_or_strict(src, tmp_path, transforms_module, capsys, monkeypatch):
    monkeypatch.chdir(transforms_module)  # MODULE:FUNC resolves modules in the current directory, as a user's would
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc, out = shardkit(capsys, "etl", "run", "userfns:picky", src.root, tmp_path / "out", "--workers", 1)
    assert rc == 0, out
    bad = sum(k.endswith(("1", "5")) for k in way1(src, imagenet_val_npy))
    assert bad and f"12 in, {12 - bad} out, {bad} skipped ({bad} ValueError)" in out, out
    rc, out = shardkit(capsys, "etl", "run", "userfns:picky", src.root, tmp_path / "strict", "--workers", 1, "--strict")
    assert rc == 2 and "failed on sample" in out and "unlucky key" in out, out
    # way 1 counts the same skips and reports them when the stream ends
    stage = etl_stage("userfns:picky")
    with pytest.warns(UserWarning, match=f"{bad} skipped"):
        got = list(wds.WebDataset(src.urls(src.list("*.tar")), shardshuffle=False).compose(stage))
    assert len(got) == 12 - bad and stage.counts["skipped"] == bad


@pytest.mark.timed
def test_corrupt_shard_names_the_shard(src, tmp_path, capsys):
    data = src.read_bytes("imagenet-train-000001.tar")
    with pytest.raises(ShardError, match="shard imagenet-train-000001.tar is not a readable tar"):
        ShardTransform(imagenet_val_npy)(data[: len(data) // 3], "imagenet-train-000001.tar")
    bad = open_store(tmp_path / "bad", create=True)
    for n in src.list("*.tar"): bad.put_file(src.path(n), n)
    bad.put_bytes(data[:5000], "imagenet-train-000001.tar")
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.transforms:imagenet_val_npy", bad.root, tmp_path / "out", "--workers", 1)
    assert rc == 1 and "FAILED imagenet-train-000001.tar: shard imagenet-train-000001.tar is not a readable tar" in out, out
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == ["imagenet-train-000000.tar", "imagenet-train-000002.tar"]
    # through the sidecar: HTTP 422 (not a 500 that curl would retry for a minute) with the reason
    with Sidecar(imagenet_val_npy, bad, process=False) as sc:
        r = requests.get(sc.http_url(bad, "imagenet-train-000001.tar"), timeout=30)
        assert r.status_code == 422 and "shard imagenet-train-000001.tar is not a readable tar" in r.text, r.text
        t0 = time.time()
        with pytest.raises(Exception, match="imagenet-train-000001.tar"):
            list(wds.WebDataset(bad.urls(["imagenet-train-000001.tar"], etl=sc), shardshuffle=False))
        assert time.time() - t0 < 10


@pytest.mark.timed
def test_sidecar_stopped_mid_epoch_fails_fast(src):
    sc = Sidecar("shardkit.etl.transforms:imagenet_val_npy", src).start()
    urls = src.urls(src.list("*.tar"), etl=sc)
    seen, t0 = 0, None
    with pytest.raises(Exception) as err:
        for s in wds.WebDataset(urls, shardshuffle=False):
            seen += 1
            if seen == 2:
                sc.stop(); t0 = time.time()
    assert time.time() - t0 < 15, "the loader hung after the sidecar stopped"
    assert seen < 12
    assert sc.url in str(err.value.args), err.value.args  # the error names the sidecar URL of the shard


@pytest.mark.timed
def test_stalled_sidecar_times_out_instead_of_hanging(src):
    "A sidecar that stops answering (SIGSTOP: connections still open) fails the loader after stall_timeout seconds."
    import signal
    sc = Sidecar("shardkit.etl.transforms:imagenet_val_npy", src, stall_timeout=3).start()
    try:
        # warm up: the first transform imports torchvision (~3 s on a busy machine), as long as the stall timeout
        requests.get(sc.http_url(src, src.list("*.tar")[0]), timeout=60).raise_for_status()
        urls = src.urls(src.list("*.tar"), etl=sc)
        seen, t0 = 0, None
        with pytest.raises(Exception) as err:
            for s in wds.WebDataset(urls, shardshuffle=False):
                seen += 1
                if seen == 4:  # the end of the first shard: the next one will not come
                    os.kill(sc._proc.pid, signal.SIGSTOP); t0 = time.time()
        assert time.time() - t0 < 20, "the loader hung on a stalled sidecar"
        assert "imagenet-train-000001.tar" in str(err.value.args), err.value.args
    finally:
        if sc._proc is not None: os.kill(sc._proc.pid, signal.SIGCONT)
        sc.stop()


def test_server_class_under_uvicorn_push_and_pull(src, ais_endpoint):
    "The server as an AIS pod runs it: a real ASGI server; PUT pushes a shard, GET pulls it from the (local AIS) target."
    import uvicorn
    ais = open_store("ais://shardkit-test-etl", create=True)
    try:
        for n in src.list("*.tar"): ais.put_file(src.path(n), n)
        port = _free_port()
        server = sidecar_server(imagenet_val_npy, ais, port=port)
        assert server.host_target == f"{ais_endpoint}/v1/objects"
        runner = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=runner.run, daemon=True); th.start()
        try:
            _wait_http(f"http://127.0.0.1:{port}/health")
            shard = src.read_bytes("imagenet-train-000000.tar")
            pushed = requests.put(f"http://127.0.0.1:{port}/shardkit-test-etl/imagenet-train-000000.tar", data=shard, timeout=60)
            pulled = requests.get(f"http://127.0.0.1:{port}/shardkit-test-etl/imagenet-train-000000.tar", timeout=60)
            assert pushed.status_code == pulled.status_code == 200, (pushed.text[:200], pulled.text[:200])
            assert pushed.content == pulled.content == ShardTransform(imagenet_val_npy)(shard, "x")
            missing = requests.get(f"http://127.0.0.1:{port}/shardkit-test-etl/nope.tar", timeout=60)
            assert missing.status_code == 404
        finally:
            runner.should_exit = True; th.join(10)
    finally:
        for n in ais.list(): ais.delete(n)


def test_offline_between_buckets_falls_back_to_local_workers(src, ais_endpoint, capsys):
    a, b = open_store("ais://shardkit-test-etl-src", create=True), open_store("ais://shardkit-test-etl-dest", create=True)
    try:
        a.put_file(src.path("imagenet-train-000000.tar"), "imagenet-train-000000.tar")
        rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.transforms:imagenet_val_npy", "ais://shardkit-test-etl-src",
                           "ais://shardkit-test-etl-dest", "--workers", 1)
        assert rc == 0, out
        assert out.splitlines()[0] == etl_unavailable(ais_endpoint)  # says why the cluster did not run it
        assert "1 of 1 shards written to ais://shardkit-test-etl-dest (local workers" in out, out
        got = decoded(b.read_bytes("imagenet-train-000000.tar"))
        same_samples(got, decoded(ShardTransform(imagenet_val_npy)(src.read_bytes("imagenet-train-000000.tar"))))
    finally:
        for st in (a, b):
            for n in st.list(): st.delete(n)


def test_cli_bad_input(src, capsys, tmp_path):
    rc, out = shardkit(capsys, "etl", "serve", "nomodule_xyz:fn", "--source", src.root)
    assert rc == 2 and "cannot import 'nomodule_xyz'" in out, out
    rc, out = shardkit(capsys, "etl", "serve", "shardkit.etl.transforms:imagenet_val_npy", "--source", tmp_path / "missing")
    assert rc == 2 and "does not exist" in out, out
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.transforms:imagenet_val_npy", src.root, src.root)
    assert rc == 2 and "same store" in out, out
    rc, out = shardkit(capsys, "etl", "run", "not-a-function-spec", src.root, tmp_path / "o")
    assert rc == 2 and "expected MODULE:FUNCTION" in out, out
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.transforms:imagenet_val_npy", src.root, tmp_path / "o", "--pattern", "nothing-*.tar")
    assert rc == 2 and "no shards matching 'nothing-*.tar'" in out, out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _wait_http(url, proc=None, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if requests.get(url, timeout=2).status_code == 200: return
        except requests.RequestException: pass
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout} s")
