"""gs:// and az:// shards against the stores' own emulators on 127.0.0.1 (fake-gcs-server and Azurite, one of each a
session: tests/bucketservers.py): epochs in both access modes, written and read back, the command line, refusals, and
every fault through a proxy of the tests' own in front of each emulator (a cut body, GCS's 429 and 503, Azure's 503
ServerBusy and 500, a dead object). A planted secret is searched for in every output."""
import fnmatch, http.client, http.server, json, logging, os, pickle, re, shutil, socket, threading, time, urllib.parse
from pathlib import Path
import pytest
from bucketservers import AZURITE_ACCOUNT, AZURITE_KEY, connection_string
from faults import N_SHARDS, NAMES, PER_SHARD, fast_retries, write_fault_shards
from shardkit.remote import AccessDenied, ObjectMissing, RetriesExhausted

pytestmark = pytest.mark.xdist_group("buckets")  # one emulator of each kind a session, on one worker
KINDS = ["gs", "az"]
# the answers each store gives when busy or failing, in its own format
BUSY = {"gs": {429: '{"error": {"code": 429, "message": "rate", "errors": [{"reason": "rateLimitExceeded"}]}}',
               503: '{"error": {"code": 503, "message": "busy", "errors": [{"reason": "backendError"}]}}'},
        "az": {503: "<Error><Code>ServerBusy</Code><Message>busy</Message></Error>",
               500: "<Error><Code>InternalError</Code><Message>oops</Message></Error>"}}


class FaultProxy:
    """Forwards every request to `upstream` (an emulator), playing faults on the GETs its rules match: "cut" (the
    headers with the full length, half the body, then the connection drops) or an HTTP status (with `Retry-After` and
    the store's own error body). A rule applies to the paths matching its glob (the URL's path, unquoted), on the
    first GET of each path ("first"), the first with a Range ("ranged"), or every GET ("always")."""
    def __init__(self, upstream: str, kind: str):
        self.upstream, self.kind = urllib.parse.urlsplit(upstream), kind
        self.rules, self.gets, self.played, self.lock = [], {}, [], threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _proxy_handler(self))
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that went away is no error
        threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def fault(self, kind, pattern: str, when: str = "first", retry_after: float = 0.2, then=None):
        "Play `kind` on the GETs of paths matching `pattern` (`when`); `then()` runs after a cut, before the resume."
        with self.lock: self.rules.append(dict(kind=kind, pattern=pattern, when=when, retry_after=retry_after,
                                               then=then))
    def clear(self):
        with self.lock: self.rules, self.gets, self.played = [], {}, []
    def pick(self, path: str, ranged: bool):
        with self.lock:
            n = self.gets[path] = self.gets.get(path, 0) + 1
            m = self.gets[path, "r"] = self.gets.get((path, "r"), 0) + ranged
            for r in self.rules:
                if not fnmatch.fnmatchcase(path, r["pattern"]): continue
                if r["when"] == "always" or (r["when"] == "first" and n == 1) or (r["when"] == "ranged" and ranged
                                                                                 and m == 1):
                    self.played.append((r["kind"], path))
                    return r
        return None
    def close(self): self.httpd.shutdown(); self.httpd.server_close()


def _proxy_handler(proxy: FaultProxy):
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version, wbufsize = "HTTP/1.1", -1  # an answer in one write: no waits for delayed ACKs
        def log_message(self, *a): pass
        def setup(self):
            super().setup(); self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        def forward(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            rule = proxy.pick(path, "Range" in self.headers) if self.command == "GET" else None
            if rule and isinstance(rule["kind"], int):
                text = BUSY[proxy.kind].get(rule["kind"], "").encode()
                self.send_response(rule["kind"]); self.send_header("Retry-After", str(rule["retry_after"]))
                if proxy.kind == "az" and text:
                    self.send_header("x-ms-error-code", re.search(b"<Code>(\\w+)", text)[1].decode())
                self.send_header("Content-Length", str(len(text))); self.end_headers(); self.wfile.write(text)
                return
            up = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
            try:
                up.connect(); up.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                up.request(self.command, self.path, body=body,
                           headers={k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")})
                r = up.getresponse(); data = r.read()
            finally: up.close()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "keep-alive"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data))); self.end_headers()
            if self.command == "HEAD": return
            if rule and rule["kind"] == "cut":
                self.wfile.write(data[:len(data) // 2]); self.wfile.flush()
                if rule["then"]: rule["then"]()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data)
        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward
    return H


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    return write_fault_shards(tmp_path_factory.mktemp("bucket-shards"))


def _point_at(kind: str, endpoint: str, mp):
    "Point this process's clients at `endpoint` (an emulator, or a proxy in front of it)."
    if kind == "gs": mp.setenv("STORAGE_EMULATOR_HOST", endpoint)
    else: mp.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(endpoint))


@pytest.fixture(scope="module", params=KINDS)
def bucket(request, shard_dir, tmp_path_factory):
    """(kind, URL of a prefix holding the 8 fault shards, the proxy in front of the emulator): shards uploaded once a
    module; every request of the tests goes through the proxy."""
    from shardkit.stores import open_store
    kind = request.param
    upstream = request.getfixturevalue("gcs_emulator" if kind == "gs" else "azurite_emulator")
    proxy = FaultProxy(upstream, kind)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDKIT_HOME", str(tmp_path_factory.mktemp(f"home-{kind}")))  # indexes and caches: this module's
        _point_at(kind, proxy.base if kind == "gs" else f"{proxy.base}/{AZURITE_ACCOUNT}", mp)
        store = open_store(f"{kind}://data/shards", create=True)
        for n in NAMES: store.put_file(shard_dir / n, n)
        yield kind, f"{kind}://data/shards", proxy
    proxy.close()


@pytest.fixture
def faults(bucket):
    kind, url, proxy = bucket
    proxy.clear()
    yield proxy
    proxy.clear()


def stream_keys(urls, workers=2, **kw) -> list[str]:
    "The keys of one streaming epoch (seed 0, batches of 16) in the order the training loop sees them."
    from shardkit import create_dataloader, create_dataset
    ds = create_dataset(urls, fields=("__key__", "cls"), seed=0, batch_size=16, shuffle=50,
                        **{k: v for k, v in kw.items() if k == "retry_wait"})
    return [k for b in create_dataloader(ds, num_workers=workers, batch_size=16,
                                         **{k: v for k, v in kw.items() if k != "retry_wait"}) for k in b[0]]


def random_keys(source, read, workers=0, **kw) -> list[str]:
    "The keys of a random-access loader's first epoch (seed 0), its index built fresh, its shard cache empty."
    from shardkit.loading.pipeline import create_dataloader, create_dataset
    dl = create_dataloader(create_dataset(source, fields=("__key__", "cls"), batch_size=16, seed=0, read=read,
                                          index_cache=False, access="random", **kw), num_workers=workers)
    if read == "cache":
        for f in dl.dataset.reader.copies.files(): f.unlink()
    return [k for b in dl for k in b[0]]


@pytest.fixture(scope="module")
def clean(shard_dir):
    "The local files' epochs: streaming, random access through a shard cache, and by ranges (as local files are)."
    local = [str(shard_dir / n) for n in NAMES]
    return dict(stream=stream_keys(local), cache=random_keys(str(shard_dir), "cache"),
                range=random_keys(str(shard_dir), "local"))


def _prefix_of(kind: str, name: str) -> str:
    "The glob of object `name`'s paths: Azure's /ACCOUNT/CONTAINER/BLOB, GCS's .../b/BUCKET/o/NAME."
    return f"/*/data/shards/{name}" if kind == "az" else f"*/b/data/o/shards/{name}"


# ---- epochs, both access modes ------------------------------------------------------------------------------------

def test_an_epoch_is_exact_in_both_access_modes(bucket, clean):
    "A prefix streamed (2 forked workers) and read by random access (shard cache; ranges): the local files' epochs."
    kind, url, _ = bucket
    assert stream_keys(url) == clean["stream"]
    assert random_keys(url, "cache") == clean["cache"]
    assert random_keys(url, "range", workers=2) == clean["range"]
    from shardkit.loading.index import sample_index
    idx = sample_index(url, ("__key__", "cls"), index_cache=False)
    assert idx.kind == kind and len(idx) == N_SHARDS * PER_SHARD and all(v.startswith('"') for v in idx.versions)


@pytest.mark.slow  # the whole suite's: the fast tier keeps an exact epoch, the faults and the refusals
def test_templates_single_objects_and_lists(bucket, clean):
    "A brace template (one listing; a missing shard said before reading), one object, and a list of URLs."
    from shardkit.loading.sources import shard_urls
    kind, url, _ = bucket
    assert len(shard_urls(f"{url}/f-{{000..007}}.tar")) == N_SHARDS
    with pytest.raises(Exception, match=r"1 of the 2 shards .*f-\{007\.\.008\}\.tar names are not in"):
        shard_urls(f"{url}/f-{{007..008}}.tar")
    one = stream_keys(f"{url}/f-003.tar", workers=0)
    assert sorted(one) == [f"s3_{i:02d}" for i in range(PER_SHARD)]
    assert random_keys([f"{url}/{n}" for n in NAMES], "range") == clean["range"]


@pytest.mark.slow  # the whole suite's: the fast tier keeps an exact epoch, the faults and the refusals
def test_writers_and_commands_take_buckets(bucket, tmp_path):
    "write_shards, convert folder and the local shuffle write into the bucket; ls and verify read it back."
    from conftest import main_cli
    from shardkit import write_shards
    from shardkit.ingest.folder import convert_folder, synthesize_folder
    from shardkit.shuffle import shuffle_shards
    kind, url, _ = bucket
    dest = url.replace("/shards", "/written")
    r = write_shards(({"__key__": f"{i:04d}", "cls": i % 3, "txt": f"sample {i}"} for i in range(60)), dest,
                     maxcount=25, progress=False)
    assert r["samples"] == 60
    synthesize_folder(tmp_path / "tree", classes=2, per_class=6, val_per_class=0, progress=False)
    tree, shuffled = url.replace("/shards", "/tree"), url.replace("/shards", "/shuffled")
    convert_folder(tmp_path / "tree" / "train", tree, maxcount=4, progress=False)
    shuffle_shards(tree, shuffled, shard_size="20KB", backend="local", progress=False)
    ls = main_cli("ls", dest)
    assert ls.returncode == 0 and "60 samples" in ls.stdout.replace(",", ""), ls.stdout + ls.stderr
    for d in (dest, tree, shuffled):
        v = main_cli("verify", d)
        assert v.returncode == 0 and "every shard matches its manifest" in v.stdout, v.stdout + v.stderr
    assert sorted(stream_keys(dest, workers=0)) == [f"{i:04d}" for i in range(60)]
    assert sorted(stream_keys(shuffled, workers=0)) == sorted(stream_keys(tree, workers=0))


def test_refusals_are_said_at_once_with_what_to_check(bucket):
    "A missing bucket or container in one line, a missing object, a wrong key (Azurite checks signatures): no retry."
    from shardkit.stores import open_store
    kind, url, _ = bucket
    retries, what = fast_retries(), "bucket 'nothere'" if kind == "gs" else "container 'nothere'"
    with pytest.raises(ObjectMissing, match=f"{what} does not exist") as e: open_store(f"{kind}://nothere/x").list()
    assert "\n" not in str(e.value)
    with pytest.raises(ObjectMissing, match="it is not there"): stream_keys(f"{url}/nope.tar", workers=0,
                                                                            retry_wait=retries)
    if kind == "az":
        with pytest.MonkeyPatch.context() as mp:
            bad = os.environ["AZURE_STORAGE_CONNECTION_STRING"].replace(AZURITE_KEY, "d3Jvbmcta2V5")
            mp.setenv("AZURE_STORAGE_CONNECTION_STRING", bad)
            with pytest.raises(AccessDenied, match="HTTP 403.*the account key in AZURE_STORAGE_CONNECTION_STRING"):
                open_store(url).list()
    assert retries.counts() == {}


@pytest.mark.slow
@pytest.mark.parametrize("workers,context", [(1, "fork"), (4, "fork"), (2, "spawn")])
def test_workers_each_make_their_own_client(bucket, clean, workers, context):
    "1 and 4 forked workers and 2 spawned ones stream the same samples, each once (a client each, never the parent's)."
    from shardkit.stores.azure import azure_client
    from shardkit.stores.gcs import gcs_client
    kind, url, _ = bucket
    gcs_client() if kind == "gs" else azure_client()  # the parent's client exists before the workers start
    keys = stream_keys(url, workers=workers, multiprocessing_context=context, timeout=60)
    assert sorted(keys) == sorted(clean["stream"]) and len(keys) == len(set(keys))


@pytest.mark.slow
def test_two_ranks_split_the_epoch(bucket):
    "Two ranks (two processes, RANK/WORLD_SIZE), 2 workers each, read the bucket: every sample once between them."
    import subprocess, sys
    kind, url, _ = bucket
    code = ("import json, sys; from shardkit import create_dataloader, create_dataset\n"
            f"ds = create_dataset({url!r}, fields=('__key__',), seed=0, batch_size=8)\n"
            "print(json.dumps([k for b in create_dataloader(ds, num_workers=2, timeout=60) for k in b[0]]))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    got = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert not set(got[0]) & set(got[1]) and len(got[0]) + len(got[1]) == N_SHARDS * PER_SHARD


@pytest.mark.slow
def test_a_mix_of_a_bucket_and_local_sources(bucket, shard_dir):
    "A mix by weight of the bucket's prefix and a local folder: both in the batches, each sample of the bucket once."
    from shardkit import create_dataloader, create_dataset
    kind, url, _ = bucket
    ds = create_dataset({"bucket": url, "local": str(shard_dir)}, weights={"bucket": 1, "local": 1},
                        fields=("__key__", "__source__"), seed=0, batch_size=16)
    got = [(k, src) for b in create_dataloader(ds, num_workers=2) for k, src in zip(b[0], b[1])]
    assert sorted(k for k, src in got if src == "bucket") == sorted(
        f"s{s}_{i:02d}" for s in range(N_SHARDS) for i in range(PER_SHARD))
    assert {src for _, src in got} == {"bucket", "local"}


@pytest.mark.slow
def test_an_epoch_resumes_mid_way_exactly(bucket, clean):
    "A streaming loader's state_dict taken after 5 batches, loaded into a new loader: the rest of the same epoch."
    from shardkit import create_dataloader, create_dataset
    kind, url, _ = bucket
    make = lambda: create_dataloader(create_dataset(url, fields=("__key__", "cls"), seed=0, batch_size=16,  # noqa: E731
                                                    shuffle=50), num_workers=2, batch_size=16)
    dl, seen = make(), []
    it = iter(dl)
    for _ in range(5): seen += next(it)[0]
    state = dl.state_dict()
    del it
    again = make(); again.load_state_dict(state)
    assert seen + [k for b in again for k in b[0]] == clean["stream"]


# ---- faults, through the proxy -----------------------------------------------------------------------------------

def _play(proxy, kind, when):
    "Cuts on two shards, and each of the store's busy answers on one more."
    proxy.fault("cut", _prefix_of(kind, "f-00[01].tar"), when)
    for status, name in zip(BUSY[kind], ("f-002.tar", "f-003.tar")): proxy.fault(status, _prefix_of(kind, name), when)


def test_streaming_is_exact_through_each_fault(bucket, faults, clean, capfd):
    "Cut bodies resumed by Range; GCS 429/503 and Azure 503 ServerBusy/500 retried: a clean epoch, each retry said."
    kind, url, _ = bucket
    _play(faults, kind, "first")
    retries = fast_retries()
    assert stream_keys(url, retry_wait=retries) == clean["stream"]
    want = {"connection cut": 2, **{f"HTTP {s}": 1 for s in BUSY[kind]}}
    assert retries.counts() == want and len(faults.played) == 4
    assert "retrying" in capfd.readouterr().err


@pytest.mark.parametrize("read", ["cache", "range"])
def test_random_access_is_exact_through_each_fault(bucket, faults, clean, read):
    "The shard cache's fetches and the per-sample range reads, faulted: the local files' epoch, each retry counted."
    kind, url, _ = bucket
    retries = fast_retries()
    from shardkit.loading.pipeline import create_dataloader, create_dataset
    dl = create_dataloader(create_dataset(url, fields=("__key__", "cls"), batch_size=16, seed=0, read=read,
                                          index_cache=False, access="random", retry_wait=retries), num_workers=0)
    if read == "cache":
        for f in dl.dataset.reader.copies.files(): f.unlink()
    faults.clear()  # the index is built: the epoch's reads meet the faults
    _play(faults, kind, "ranged" if read == "range" else "first")
    assert [k for b in dl for k in b[0]] == clean[read]
    assert retries.counts() == {"connection cut": 2, **{f"HTTP {s}": 1 for s in BUSY[kind]}}


def test_an_object_rewritten_mid_read_is_refused(bucket, faults, shard_dir):
    """A body cut, and the object rewritten before the resume: the resume is pinned to the version first read (GCS's
    generation, Azure's ETag with If-Match), so the read is refused, never mixed; the object is put back after."""
    from shardkit.remote import ObjectChanged
    from shardkit.stores import open_store, open_url
    kind, url, _ = bucket
    store, name = open_store(url), "f-006.tar"
    original = (shard_dir / name).read_bytes()
    faults.fault("cut", _prefix_of(kind, name), then=lambda: store.put_bytes(original[::-1], name))
    try:
        with pytest.raises(ObjectChanged, match="changed while it was read"):
            with open_url(store.url(name), fast_retries()) as f: f.read()
    finally: store.put_bytes(original, name)


@pytest.mark.slow  # the whole suite's: the fast tier keeps an exact epoch, the faults and the refusals
@pytest.mark.parametrize("access", ["stream", "random"])
def test_a_dead_object_is_named_within_the_bound(bucket, faults, access):
    "A shard that answers 503 to every GET ends the epoch with an error that names it, within the bound + 10 s."
    kind, url, _ = bucket
    faults.fault(503, _prefix_of(kind, "f-003.tar"), "always")
    t0 = time.monotonic()
    with pytest.raises(RetriesExhausted, match=rf"gave up .*{kind}://data/shards/f-003\.tar.*HTTP 503"):
        if access == "stream": stream_keys(url, workers=0, retry_wait=fast_retries(wait=2))
        else: random_keys(url, "range", retry_wait=fast_retries(wait=2))
    assert time.monotonic() - t0 < 2 + 10


# ---- secrets -----------------------------------------------------------------------------------------------------

GCS_SECRETS = ("planted-GCS-CLIENT-SECRET-4f2a9e1c", "planted-GCS-REFRESH-8b3d0f6a", "planted-GCS-TOKEN-1c7e5a9d")
SAS = "sv=2021-08-06&ss=b&srt=sco&sp=rl&se=2030-01-01T00:00:00Z&sig=planted-SAS-SIG-3e8f1b7c"


@pytest.mark.slow  # the whole suite's: the fast tier keeps an exact epoch, the faults and the refusals
def test_a_planted_secret_shows_nowhere(bucket, faults, tmp_path, *, caplog, capfd, monkeypatch):
    """GCS through Application Default Credentials (a user's client secret and refresh token, an access token) and
    Azure with an account key and a SAS token, all planted: none appears in an error, a log line (every logger at
    DEBUG), a repr, a saved state_dict, a manifest, a pickled loader or the command line's output."""
    from conftest import main_cli
    from shardkit import write_shards
    from shardkit.loading.pipeline import create_dataloader, create_dataset
    from shardkit.stores import open_store
    from bucketservers import PLANTED_ACCOUNT, PLANTED_KEY
    kind, url, proxy = bucket
    caplog.set_level(logging.DEBUG)
    if kind == "gs":  # credentials used only where an endpoint is given (STORAGE_EMULATOR_HOST means none)
        adc = tmp_path / "adc.json"
        adc.write_text(json.dumps({"type": "authorized_user", "client_id": "shardkit-test", "token": GCS_SECRETS[2],
                                   "expiry": "2099-01-01T00:00:00Z", "client_secret": GCS_SECRETS[0],
                                   "refresh_token": GCS_SECRETS[1]}))  # a token valid till then: no refresh
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
        monkeypatch.delenv("STORAGE_EMULATOR_HOST")
        src, secrets = f"gs://data/shards?endpoint={urllib.parse.quote(proxy.base, safe='')}", GCS_SECRETS
    else:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(
            f"{proxy.base}/{AZURITE_ACCOUNT}", PLANTED_KEY, PLANTED_ACCOUNT))
        src, secrets = "az://data/shards", (PLANTED_KEY, "planted-SAS-SIG-3e8f1b7c")
    seen = []
    store = open_store(src, create=True)
    seen += [repr(store), repr(vars(store)), str(store.listing()[:2])]
    dest = src.replace("/shards", "/secret-out")
    write_shards(({"__key__": f"{i}", "cls": i} for i in range(5)), dest, maxcount=2, progress=False)
    seen.append(open_store(dest).read_bytes("shard-manifest.json").decode())
    ds = create_dataset(dest, fields=("__key__", "cls"), seed=0, batch_size=2)
    dl = create_dataloader(ds, num_workers=0)
    it = iter(dl); next(it)
    seen += [repr(dl.state_dict()), repr(pickle.dumps(dl.state_dict())), repr(pickle.dumps(ds))]
    rl = create_dataloader(create_dataset(dest, fields=("__key__", "cls"), batch_size=2, index_cache=False,
                                          access="random"), num_workers=0)
    it = iter(rl); next(it)
    seen += [repr(rl.state_dict()), repr(pickle.dumps(rl.dataset))]
    from shardkit.stores.azure import azure_client
    from shardkit.stores.gcs import gcs_client
    client = gcs_client(store.settings) if kind == "gs" else azure_client(store.settings)
    seen += [repr(client), repr(vars(client))]
    proxy.fault(403, "*secret-out/shard-00000.tar", "always")  # a refusal's message, credentials in play
    with pytest.raises(AccessDenied) as e: stream_keys(open_store(dest).url("shard-00000.tar"), workers=0)
    seen.append(str(e.value))
    if kind == "az":  # a SAS token instead (a bogus one: Azurite refuses it, and the refusal is said)
        monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
        monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", SAS)
        sas = f"az://data/secret-out?account={PLANTED_ACCOUNT}&endpoint=" + urllib.parse.quote(
            f"{proxy.base}/{PLANTED_ACCOUNT}", safe="")
        with pytest.raises(AccessDenied, match="the SAS token in AZURE_STORAGE_SAS_TOKEN") as e: open_store(sas).list()
        seen += [str(e.value), repr(azure_client(open_store(sas).settings))]
    seen += [(r := main_cli("ls", dest)).stdout + r.stderr, (r := main_cli("verify", dest)).stdout + r.stderr]
    seen += [r.getMessage() for r in caplog.records] + list(capfd.readouterr())
    assert len(seen) > 12 and any("403" in s for s in seen) and any("urllib3" in r.name for r in caplog.records)
    for secret in secrets:
        assert not [s for s in seen if secret in s], [s[:300] for s in seen if secret in s]
