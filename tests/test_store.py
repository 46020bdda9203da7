"""The store layer on both backends: round trips, URLs that WebDataset opens, and the errors users hit."""
import io, time
import pytest
import webdataset as wds
from shardkit.stores import AISStore, LocalStore, open_store
from shardkit.errors import StoreError


def _shard(n=3, tag="x") -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf, mtime=0) as w:
        for i in range(n): w.write({"__key__": f"{tag}{i:03d}", "txt": f"{tag} {i}", "cls": i})
    return buf.getvalue()


def _round_trip(store, tmp_path):
    for i in range(3): store.put_bytes(_shard(tag=f"s{i}-"), f"part-{i:02d}.tar")
    (tmp_path / "extra.tar").write_bytes(_shard(1, "e"))
    store.put_file(tmp_path / "extra.tar")
    assert store.list("part-*.tar") == ["part-00.tar", "part-01.tar", "part-02.tar"]
    assert store.list("part-{00..01}.tar") == ["part-00.tar", "part-01.tar"]
    assert store.list() == ["extra.tar", "part-00.tar", "part-01.tar", "part-02.tar"]
    assert store.exists("extra.tar") and not store.exists("nope.tar")
    assert store.size("part-00.tar") == len(_shard(tag="s0-"))
    with store.open("extra.tar") as f: assert f.read() == _shard(1, "e")
    urls = store.urls("part-{00..02}.tar")
    keys = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
    assert keys == [f"s{i}-{j:03d}" for i in range(3) for j in range(3)]
    store.delete("extra.tar")
    assert "extra.tar" not in store.list()
    with pytest.raises(StoreError, match="no object 'extra.tar'"): store.delete("extra.tar")
    return urls


def test_local_round_trip(tmp_path):
    store = open_store(tmp_path / "shards", create=True)
    assert isinstance(store, LocalStore)
    urls = _round_trip(store, tmp_path)
    assert all(u.startswith(str(tmp_path)) for u in urls)


def test_ais_round_trip(ais_endpoint, tmp_path):
    store = open_store("ais://store-test/run1", create=True)
    assert isinstance(store, AISStore) and store.spec == "ais://store-test/run1"
    urls = _round_trip(store, tmp_path)
    assert all(u.startswith(ais_endpoint) for u in urls), urls
    # the prefix is a real folder in the bucket: a store over the bare bucket sees it
    assert open_store("ais://store-test").list("run1/") == [f"run1/part-{i:02d}.tar" for i in range(3)]
    for n in store.list(): store.delete(n)
    assert store.list() == []


def test_ais_missing_bucket_says_how_to_create(ais_endpoint):
    with pytest.raises(StoreError, match=r"bucket ais://no-such-bucket does not exist.*ais bucket create"):
        open_store("ais://no-such-bucket")


@pytest.mark.timed
def test_unreachable_endpoint_fails_fast(monkeypatch):
    monkeypatch.setenv("AIS_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    t0 = time.time()
    with pytest.raises(StoreError, match=r"AIStore at http://127.0.0.1:9 is not reachable.*shardkit ais up"):
        open_store("ais://pets")
    assert time.time() - t0 < 5


def test_no_endpoint_says_what_to_set(monkeypatch):
    monkeypatch.delenv("AIS_ENDPOINT", raising=False)
    with pytest.raises(StoreError, match="set AIS_ENDPOINT"): open_store("ais://pets")


@pytest.mark.parametrize("spec, msg", [("ftp://bucket/x", "unsupported store"), ("ais://", "names no bucket"),
                                       ("s3:///x", "names no bucket"), ("abfs://c@a.dfs.core.windows.net/x", "name the same blobs as az://"),
                                       ("/definitely/not/here", "does not exist; check the path")])
def test_bad_specs(spec, msg):
    with pytest.raises(StoreError, match=msg): open_store(spec)


def test_file_is_not_a_store(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file, not a directory"): open_store(tmp_path / "f")


def test_local_urls_name_missing_shards(tmp_path):
    store = open_store(tmp_path, create=True)
    store.put_bytes(_shard(), "a-0.tar")
    with pytest.raises(StoreError, match=r"1 of 2 objects are not in .*a-1.tar"): store.urls("a-{0..1}.tar")


def test_local_put_is_atomic(tmp_path):
    "Readers never see a partial object: a put that fails midway leaves the old object intact and no temp file."
    store = open_store(tmp_path, create=True)
    store.put_bytes(b"old", "x.tar")
    class Boom(Exception): pass
    def fill(out):
        out.write(b"new but partial")
        raise Boom()
    with pytest.raises(Boom): store._write("x.tar", fill)
    assert store.read_bytes("x.tar") == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tar"]
