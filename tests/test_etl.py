"""ETL: one transform run five ways must agree; the server under a real ASGI server; bad input and faults.

The five ways: 1 a loader stage, 2 shard by shard, 3 AIStore's own ETL (`init_etl`, `run_in_cluster`), 4 the sidecar
(`shardkit etl serve`), 5 offline store to store (`shardkit etl run`). Way 3 needs AIStore on Kubernetes (its ETL code
is built only with the `etl` tag and runs only in a pod; /work/shared/facts.md), which the suite's local cluster is
not. So here way 3 runs as far as it can without Kubernetes: `init_etl` builds its request (recorded, not sent), and
the server class it ships runs as AIStore's pod runs it, in a fresh Python where shardkit is not installed, under
uvicorn, behind the routes a target calls, pulling from a real HTTP "target". Only AIStore's own routing to the pod
is left out; `test_run_in_cluster_on_kubernetes` runs it where SHARDKIT_K8S_AIS_ENDPOINT names such a cluster.

Data: 3 classes x 4 training images as 3 shards of 4 samples (val-style transform) -- seconds, not minutes."""
import contextlib, functools, http.server, io, os, socket, subprocess, sys, tarfile, threading, time, warnings
from types import SimpleNamespace
from pathlib import Path
import numpy as np
import pytest
import requests
import webdataset as wds
from shardkit.etl.shard_transform import ShardTransform, SampleError, etl_stage
from shardkit.etl.server import init_etl
from shardkit.stores.ais import etl_unavailable
from shardkit.etl.recipes import imagenet_val_npy, imagenet_train_npy
from shardkit.etl import run_etl
from shardkit.shards.fields import ShardError
from shardkit.shards.tar import read_samples
from shardkit.etl.sidecar import Sidecar, sidecar_server
from shardkit.ingest.folder import convert_folder, synthesize_folder
from shardkit.stores import open_store
from shardkit.apps.cli import main

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
        "from shardkit.etl.recipes import imagenet_val_npy\n"
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


@pytest.mark.slow
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
    proc = subprocess.Popen([sys.executable, "-m", "shardkit.apps.cli", "etl", "serve", "shardkit.etl.recipes:imagenet_val_npy",
                             "--source", str(src.root), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc)
        urls = [f"http://127.0.0.1:{port}/{n}" for n in src.list("*.tar")]
        four = {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False).decode()}
    finally:
        proc.terminate(); proc.wait(10)
    same_samples(one, four)
    # way 5: `shardkit etl run` with two worker processes
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.recipes:imagenet_val_npy", src.root, tmp_path / "out", "--processes", 2)
    assert rc == 0 and "3 of 3 shards written" in out and "12 in, 12 out, 0 skipped" in out, out
    five = {}
    for n in src.list("*.tar"): five.update(decoded((tmp_path / "out" / n).read_bytes()))
    same_samples(one, five)


@pytest.mark.slow
def test_random_transform_identical_with_seed(src, tmp_path):
    one = way1(src, imagenet_train_npy, seed=7)
    sc = Sidecar(imagenet_train_npy, src, seed=7)
    with sc:
        four = {s["__key__"]: s for s in wds.WebDataset(src.urls(src.list("*.tar"), etl=sc), shardshuffle=False).decode()}
    same_samples(one, four)
    run_etl(imagenet_train_npy, src, tmp_path / "out", processes=1, seed=7, progress=False)
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
        rc, out = shardkit(capsys, "etl", "run", "userfns:picky", src.root, tmp_path / "out", "--processes", 1)
    assert rc == 0, out
    bad = sum(k.endswith(("1", "5")) for k in way1(src, imagenet_val_npy))
    assert bad and f"12 in, {12 - bad} out, {bad} skipped ({bad} ValueError)" in out, out
    rc, out = shardkit(capsys, "etl", "run", "userfns:picky", src.root, tmp_path / "strict", "--processes", 1, "--strict")
    assert rc == 2 and "failed on sample" in out and "unlucky key" in out, out
    # way 1 counts the same skips and reports them when the stream ends
    stage = etl_stage("userfns:picky")
    with pytest.warns(UserWarning, match=f"{bad} skipped"):
        got = list(wds.WebDataset(src.urls(src.list("*.tar")), shardshuffle=False).compose(stage))
    assert len(got) == 12 - bad and stage.counts["skipped"] == bad


# Run in a fresh Python: unpickling shardkit's classes by value in a process sets the copies' methods on its live
# classes (cloudpickle's class tracker), so that process's later transforms would hold copied functions too.
BY_VALUE = """import sys, cloudpickle, shardkit
from shardkit.etl.shard_transform import ShardTransform, SampleError, strict
from shardkit.etl.local_engine import run_locally
from shardkit.stores import open_store
cloudpickle.register_pickle_by_value(shardkit)
st = ShardTransform("userfns:picky", handler="strict")
assert cloudpickle.loads(cloudpickle.dumps(st)).samples.handler is not strict  # the two objects apart
src = open_store(sys.argv[1])
try: run_locally(st, src, open_store(sys.argv[2], create=True), src.list("*.tar"), processes=1, progress=False)
except SampleError as e: print("stopped:", e)
"""


def test_strict_holds_when_shardkit_is_pickled_by_value(src, tmp_path, transforms_module):
    """Strict is a flag said when the transform is made, not the handler's identity asked in the worker: with shardkit
    registered to pickle by value (init_etl does so for its class), a worker's copy of `strict` is another function.
    Before the flag, `--strict` skipped the bad samples after an init_etl in the same process."""
    import cloudpickle
    from shardkit.etl.shard_transform import strict
    out = subprocess.run([sys.executable, "-c", BY_VALUE, str(src.root), str(tmp_path / "out")], cwd=transforms_module,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and "stopped: transform picky failed on sample" in out.stdout, out.stdout + out.stderr
    # and init_etl registers shardkit only while it pickles its class: after it, strict is `strict` again
    assert init_etl("shardkit-val", imagenet_val_npy, client=RecordingClient()) == "shardkit-val"
    assert "shardkit" not in cloudpickle.list_registry_pickle_by_value()
    st = cloudpickle.loads(cloudpickle.dumps(ShardTransform(imagenet_val_npy, handler="strict")))
    assert st.samples.handler is strict and st.samples.strict


@pytest.mark.timed
def test_corrupt_shard_names_the_shard(src, tmp_path, capsys):
    data = src.read_bytes("imagenet-train-000001.tar")
    with pytest.raises(ShardError, match="shard imagenet-train-000001.tar is not a readable tar"):
        ShardTransform(imagenet_val_npy)(data[: len(data) // 3], "imagenet-train-000001.tar")
    bad = open_store(tmp_path / "bad", create=True)
    for n in src.list("*.tar"): bad.put_file(src.path(n), n)
    bad.put_bytes(data[:5000], "imagenet-train-000001.tar")
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.recipes:imagenet_val_npy", bad.root, tmp_path / "out", "--processes", 1)
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
    sc = Sidecar("shardkit.etl.recipes:imagenet_val_npy", src).start()
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
    sc = Sidecar("shardkit.etl.recipes:imagenet_val_npy", src, stall_timeout=3).start()
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


class RecordingClient:
    "An AIStore client for `init_etl`: says the cluster runs ETL, and records the init request instead of sending it."
    base_url = "http://aistore-on-kubernetes.invalid/v1"

    def __init__(self): self.sent, self._request_client = [], self
    def cluster(self): return SimpleNamespace(list_etls=lambda: [])  # the answer of a cluster that runs ETL
    def etl(self, name):
        from aistore.sdk.etl.etl import Etl
        return Etl(self, name)  # the SDK's own ETL object: init_class serializes the class and builds the request
    def request(self, method, path, **kw): self.sent.append((method, path, kw)); return SimpleNamespace(text="etl-job")


# AIStore's runtime_python pod: the SDK and the PACKAGES init_etl names, not shardkit (nor fastcore, which shardkit
# needs); it unpickles ETL_CLASS_PAYLOAD, makes the server with no arguments and runs its app under uvicorn.
POD = """import base64, importlib.abc, os, sys
class NotInThePod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("shardkit", "fastcore"): raise ImportError(name + " is not installed in the ETL pod")
sys.meta_path.insert(0, NotInThePod())
import cloudpickle, uvicorn
server = cloudpickle.loads(base64.b64decode(os.environ["ETL_CLASS_PAYLOAD"]))()
uvicorn.run(server.app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


@contextlib.contextmanager
def http_target(folder: Path):
    "A tiny HTTP server on a free 127.0.0.1 port answering GET /<name> with `folder`'s file: the AIS target's stand-in."
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True); th.start()
    try: yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally: srv.shutdown(); srv.server_close(); th.join(10)


@pytest.mark.slow
def test_init_etl_ships_a_server_that_runs_without_shardkit(src):
    "Way 3 without Kubernetes: the request init_etl makes, and its server class run as AIStore's pod would run it."
    client = RecordingClient()
    assert init_etl("shardkit-val", imagenet_val_npy, client=client) == "shardkit-val"
    (method, path, kw), = client.sent
    spec = kw["json"]
    assert (method, path, spec["name"], spec["communication"]) == ("put", "etl", "shardkit-val", "hpull://"), spec
    assert spec["runtime"]["image"].startswith("aistorage/runtime_python:"), spec["runtime"]
    pod_env = {e["name"]: e["value"] for e in spec["runtime"]["env"]}
    assert set(pod_env["PACKAGES"].split(",")) >= {"webdataset", "torch", "torchvision", "pillow", "numpy"}, pod_env
    shard, name = src.read_bytes("imagenet-train-000000.tar"), "imagenet-train-000000.tar"
    want = ShardTransform(imagenet_val_npy)(shard, name)
    port = _free_port()
    with http_target(src.root) as target:
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "AIS_TARGET_URL": target,
               "ETL_CLASS_PAYLOAD": pod_env["ETL_CLASS_PAYLOAD"]}
        pod = subprocess.Popen([sys.executable, "-c", POD, str(port)], env=env, cwd=src.root, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_http(f"{base}/health", pod, timeout=120)
            pulled = requests.get(f"{base}/{name}", timeout=120)  # hpull: the server GETs AIS_TARGET_URL/<name>
            pushed = requests.put(f"{base}/bucket/{name}", data=shard, timeout=120)  # hpush: the target sends the shard
            assert pulled.status_code == pushed.status_code == 200, (pulled.text[:300], pushed.text[:300])
            assert pulled.content == pushed.content == want
            assert requests.get(f"{base}/nope.tar", timeout=60).status_code == 404  # the target's 404, passed on
            bad = requests.put(f"{base}/bucket/bad.tar", data=b"not a tar", timeout=60)
            assert bad.status_code == 422 and "bad.tar" in bad.text, (bad.status_code, bad.text[:300])
        finally:
            pod.terminate()
            try: out = pod.communicate(timeout=20)[0].decode(errors="replace")
            except subprocess.TimeoutExpired: pod.kill(); out = pod.communicate()[0].decode(errors="replace")
    assert "not installed in the ETL pod" not in out, out[-3000:]
    assert f"{name}: 4 samples in, 4 out, 0 skipped" in out, out[-3000:]  # the server's own log line, per shard


@pytest.mark.slow
def test_run_in_cluster_on_kubernetes(src, monkeypatch):
    """Way 3 for real: `run_etl` between two buckets of an AIStore that runs ETL, which starts our ETL and AIStore's
    bucket-to-bucket transform job (`run_in_cluster`). That needs AIStore on Kubernetes; the suite's local cluster has
    no ETL, so this runs only where SHARDKIT_K8S_AIS_ENDPOINT names such a cluster (its pods pull
    aistorage/runtime_python and pip-install the PACKAGES, so they need a registry and PyPI)."""
    endpoint = os.environ.get("SHARDKIT_K8S_AIS_ENDPOINT")
    if not endpoint:
        pytest.skip("AIStore runs ETL only on Kubernetes (built with the etl tag, in a pod); the local cluster cannot. "
                    "Set SHARDKIT_K8S_AIS_ENDPOINT=http://HOST:PORT of an AIStore on Kubernetes to run this")
    why = etl_unavailable(endpoint)
    if why: pytest.fail(f"SHARDKIT_K8S_AIS_ENDPOINT={endpoint} names a cluster without ETL: {why}")
    monkeypatch.setenv("AIS_ENDPOINT", endpoint)
    tag = f"{os.getpid()}-{int(time.time())}"
    a = open_store(f"ais://shardkit-test-k8s-src-{tag}", create=True)
    b = open_store(f"ais://shardkit-test-k8s-dest-{tag}", create=True)
    try:
        for n in src.list("*.tar"): a.put_file(src.path(n), n)
        s = run_etl(imagenet_val_npy, a.spec, b.spec, progress=False, etl_name=f"shardkit-test-{os.getpid()}")
        assert s["way"] == "aistore" and s["written"] == s["shards"] == 3 and not s["failed"], s
        for n in src.list("*.tar"):
            same_samples(decoded(b.read_bytes(n)), decoded(ShardTransform(imagenet_val_npy)(src.read_bytes(n), n)))
    finally:
        for st in (a, b):
            for n in st.list(): st.delete(n)


def test_offline_between_buckets_falls_back_to_local_workers(src, ais_endpoint, capsys):
    a, b = open_store("ais://shardkit-test-etl-src", create=True), open_store("ais://shardkit-test-etl-dest", create=True)
    try:
        a.put_file(src.path("imagenet-train-000000.tar"), "imagenet-train-000000.tar")
        rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.recipes:imagenet_val_npy", "ais://shardkit-test-etl-src",
                           "ais://shardkit-test-etl-dest", "--processes", 1)
        assert rc == 0, out
        assert out.splitlines()[0] == etl_unavailable(ais_endpoint)  # says why the cluster did not run it
        assert "1 of 1 shards written to ais://shardkit-test-etl-dest (local processes" in out, out
        got = decoded(b.read_bytes("imagenet-train-000000.tar"))
        same_samples(got, decoded(ShardTransform(imagenet_val_npy)(src.read_bytes("imagenet-train-000000.tar"))))
    finally:
        for st in (a, b):
            for n in st.list(): st.delete(n)


def test_cli_bad_input(src, capsys, tmp_path):
    rc, out = shardkit(capsys, "etl", "serve", "nomodule_xyz:fn", "--source", src.root)
    assert rc == 2 and "cannot import 'nomodule_xyz'" in out, out
    rc, out = shardkit(capsys, "etl", "serve", "shardkit.etl.recipes:imagenet_val_npy", "--source", tmp_path / "missing")
    assert rc == 1 and "does not exist" in out, out  # a data error: 1
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.recipes:imagenet_val_npy", src.root, src.root)
    assert rc == 2 and "same store" in out, out
    rc, out = shardkit(capsys, "etl", "run", "not-a-function-spec", src.root, tmp_path / "o")
    assert rc == 2 and "expected MODULE:FUNCTION" in out, out
    rc, out = shardkit(capsys, "etl", "run", "shardkit.etl.recipes:imagenet_val_npy", src.root, tmp_path / "o", "--pattern", "nothing-*.tar")
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
