"""One conformance suite, one test body, run over every backend: local files, HTTP (a real `http.server` on
127.0.0.1 serving a folder), the local AIStore, the S3 API (AIStore's own `/s3`), Google Cloud Storage's
(fake-gcs-server) and Azure Blob Storage's (Azurite). Each backend is made from its
URL by `open_store`; the same reads are asked of each, and the writes of those that write (`writable`): an HTTP
server is read-only, and a write there must be refused, not ignored."""
import functools, http.server, io, os, re, threading
from pathlib import Path
import pytest
import webdataset as wds
from s3servers import ais_md5_bucket
from shardkit.errors import StoreError
from shardkit.remote import ObjectMissing
from shardkit.stores import Store, backend_for, open_store, open_url, read_url_range

BACKENDS = ["local", "http", "ais", "s3", "gs", "az"]  # a new backend: one more entry here, one more branch in `seeded`
# those on the session's AIStore get the marks conftest gives its tests (slow; its xdist group, one cluster a session):
# `seeded` asks for the cluster at run time, which conftest cannot see when it marks tests by their fixtures
ON_AIS = [pytest.mark.slow, pytest.mark.xdist_group("aistore")]
ON_EMULATOR = [pytest.mark.xdist_group("buckets")]  # one emulator of each kind a session, on one worker
PARAMS = [pytest.param(k, marks=ON_AIS if k in ("ais", "s3") else ON_EMULATOR if k in ("gs", "az") else ())
          for k in BACKENDS]
WRITES = {"local": True, "http": False, "ais": True, "s3": True, "gs": True, "az": True}


def _shard(n=3, tag="x") -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf, mtime=0) as w:
        for i in range(n): w.write({"__key__": f"{tag}{i:03d}", "txt": f"{tag} {i}"})
    return buf.getvalue()


SEED = {"part-00.tar": _shard(tag="a"), "part-01.tar": _shard(tag="b"), "sub/c.tar": _shard(1, "c")}


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    "`http.server`'s handler (quiet), answering `Range: bytes=A-B` with 206, as web servers and object stores do."
    def log_message(self, *a): pass
    def send_head(self):
        rng = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        path = Path(self.translate_path(self.path))
        if not rng or not path.is_file(): return super().send_head()
        data = path.read_bytes()[int(rng[1]):int(rng[2]) + 1]
        self.send_response(206); self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Range", f"bytes {rng[1]}-{rng[2]}/{path.stat().st_size}"); self.end_headers()
        return io.BytesIO(data)


@pytest.fixture
def seeded(request, tmp_path, monkeypatch):
    "The backend's URL (a folder, a server, a bucket) holding SEED: written directly where the store does not write."
    kind = request.param
    if kind in ("local", "http"):
        root = tmp_path / "root"
        for n, b in SEED.items(): (root / n).parent.mkdir(parents=True, exist_ok=True); (root / n).write_bytes(b)
        if kind == "local": yield str(root); return
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=root))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try: yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally: server.shutdown(); server.server_close()
        return
    bucket = f"conform-{kind}-{os.getpid()}"
    if kind == "gs": monkeypatch.setenv("STORAGE_EMULATOR_HOST", request.getfixturevalue("gcs_emulator"))
    if kind == "az":
        from bucketservers import connection_string
        endpoint = request.getfixturevalue("azurite_emulator")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(endpoint))
    if kind in ("ais", "s3"): endpoint = request.getfixturevalue("ais_endpoint")
    if kind == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"{endpoint}/s3")
        for k, v in dict(AWS_ACCESS_KEY_ID="ais", AWS_SECRET_ACCESS_KEY="ais", AWS_EC2_METADATA_DISABLED="true",
                         AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
                         AWS_REGION="us-east-1").items():
            monkeypatch.setenv(k, v)
        ais_md5_bucket(endpoint, bucket)
    url = f"{kind}://{bucket}/shards"
    store = open_store(url, create=True)
    for n in store.list(): store.delete(n)
    for n, b in SEED.items(): store.put_bytes(b, n)
    yield url
    for n in store.list(): store.delete(n)


@pytest.mark.parametrize("seeded", PARAMS, indirect=True)
def test_every_backend_does_what_store_says(seeded):
    store = open_store(seeded)
    kind = next(k for k in BACKENDS if seeded.startswith(f"{k}://")) if "://" in seeded else "local"
    assert isinstance(store, Store) and backend_for(seeded) is type(store)
    assert store.writable == WRITES[kind]
    # listing: sorted, every name, filtered by glob, template or prefix
    assert store.list() == sorted(SEED)
    assert store.list("part-{00..01}.tar") == ["part-00.tar", "part-01.tar"]
    assert store.list("sub/") == ["sub/c.tar"]
    # size, exists, a stream, a range; a missing object named
    assert store.size("part-01.tar") == len(SEED["part-01.tar"])
    assert store.exists("sub/c.tar") and not store.exists("nope.tar")
    with pytest.raises(ObjectMissing, match="nope.tar"): store.size("nope.tar")
    with store.open("part-00.tar") as f: assert f.read() == SEED["part-00.tar"]
    assert store.read_range("part-00.tar", 100, 612) == SEED["part-00.tar"][100:612]
    # URLs: what the loaders open; read again through the one mapping, and by WebDataset
    urls = store.urls("part-{00..01}.tar")
    with open_url(urls[1]) as f: assert f.read() == SEED["part-01.tar"]
    assert read_url_range(urls[0], 0, 512) == SEED["part-00.tar"][:512]
    if kind not in ("s3", "gs", "az"):  # opened by shardkit's loaders (signed requests), not by plain WebDataset
        keys = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
        assert keys == [f"{t}{i:03d}" for t in "ab" for i in range(3)]
    assert type(store).__name__ in repr(store)
    # writes, where the backend writes; refused where it does not
    if not store.writable:
        with pytest.raises(StoreError, match="only reads"): store.put_bytes(b"x", "new.tar")
        with pytest.raises(StoreError, match="only reads"): store.delete("part-00.tar")
        assert store.list() == sorted(SEED)
        return
    assert store.put_bytes(b"new", "new.tar") == "new.tar" and store.read_bytes("new.tar") == b"new"
    store.put_bytes(b"newer", "new.tar")
    assert store.read_bytes("new.tar") == b"newer" and store.size("new.tar") == 5
    store.delete("new.tar")
    assert not store.exists("new.tar") and store.list() == sorted(SEED)
    with pytest.raises(StoreError, match="nope.tar"): store.delete("nope.tar")
