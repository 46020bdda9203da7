"""Write the seed corpora under tests/fuzz/corpus/<target>/ (deterministic; `python -m tests.fuzz.make_corpus`).
Seeds are small: real files of each kind, plus the odd cases a parser should refuse. Inputs a fuzz run found
(`crash-*`, `slow-*`) are kept beside them and never rewritten here."""
from __future__ import annotations
import hashlib
import io
import json
import tarfile
from pathlib import Path
import numpy as np
from .core import CORPUS
from .targets import SEP


def _write(target: str, name: str, data: bytes):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def _tar(members, fmt=tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, body, *kind in members:
            ti = tarfile.TarInfo(name); ti.size = len(body); ti.mtime = 0
            if kind: ti.type = kind[0]; ti.size = 0; body = b""; ti.linkname = "x.jpg"
            tf.addfile(ti, io.BytesIO(body))
    return buf.getvalue()


def tar_seeds():
    plain = [("000.jpg", b"\xff\xd8jpeg"), ("000.cls", b"3"), ("001.jpg", b"j" * 700), ("001.cls", b"1")]
    seeds = {
        "plain": _tar(plain),
        "gnu-long": _tar([("d/" + "n" * 150 + ".txt", b"x"), ("d/" + "n" * 150 + ".cls", b"2")], tarfile.GNU_FORMAT),
        "pax-long": _tar([("p/" + "q" * 120 + ".txt", b"y" * 10), ("p/é.cls", b"1")], tarfile.PAX_FORMAT),
        "ustar-prefix": _tar([("a" * 90 + "/" + "b" * 60 + "/k.txt", b"z")]),
        "meta-and-dir": _tar([("__meta__", b"m"), ("dir/", b"", tarfile.DIRTYPE), ("dir/k.txt", b"t")]),
        "out-of-order": _tar([("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"3")]),
        "duplicate": _tar([("a.jpg", b"1"), ("a.jpg", b"2")]),
        "symlink": _tar([("a.jpg", b"", tarfile.SYMTYPE)]),
        "climbs": _tar([("../x.jpg", b"1")]),
        "empty": b"\0" * 1024,
    }
    whole = seeds["plain"]
    seeds["truncated-data"] = whole[:512 + 3]
    seeds["truncated-header"] = whole[:300]
    huge = bytearray(whole[:512]); huge[124:136] = b"77777777777\0"
    seeds["huge-size"] = bytes(huge) + whole[512:1024]
    b256 = bytearray(whole[:512]); b256[124:136] = b"\x80" + b"\0" * 7 + b"\xff" * 4
    seeds["base256-size"] = bytes(b256) + whole[512:]
    pax = b"30 path=" + b"a" * 19 + b".txt\n" + b"20 size=99999999999\n"
    seeds["pax-size"] = _pax_member(pax, b"x.txt", b"hello")
    seeds["pax-zero-length"] = _pax_member(b"0 path=a.txt\n", b"x.txt", b"hello")
    for name, data in seeds.items():
        _write("tar", name, bytes([1]) + data)  # mode byte: 1 = fix checksums after mutating


def _pax_member(pax: bytes, name: bytes, body: bytes) -> bytes:
    def head(n: bytes, size: int, kind: bytes) -> bytes:
        h = bytearray(512)
        h[:len(n)] = n; h[100:108] = b"0000644\0"; h[124:136] = b"%011o\0" % size; h[156:157] = kind
        h[257:263] = b"ustar\0"; h[263:265] = b"00"
        h[148:156] = b" " * 8; h[148:156] = b"%06o\0 " % sum(h)
        return bytes(h)
    pad = lambda b: b + b"\0" * (-len(b) % 512)  # noqa: E731
    return head(b"PaxHeader", len(pax), b"x") + pad(pax) + head(name, len(body), b"0") + pad(body) + b"\0" * 1024


def key_seeds():
    seeds = {"plain": "a/b/000.jpg\0a/b/000.cls\0a/b/001.JPG", "dots": "x.y.z.tar.gz\0.hidden.jpg\0dir/.x.jpg",
             "meta": "__key__\0__meta__/x.txt\0__a__.b", "unsafe": "/etc/passwd.x\0../up.jpg\0a\\b.jpg\0c:x.jpg",
             "unicode": "é/ü.jpg\0日本.txt\0a\nb.jpg", "pickles": "a.pyd\0b.pth\0c.PICKLE\0d.mask.png",
             "deep": "a/" * 200 + "k.jpg"}
    for name, text in seeds.items(): _write("keys", name, text.encode())


def index_seeds():
    import tempfile
    from shardkit.loading.index import sample_index
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "s.tar").write_bytes(_tar([("000.cls", b"1"), ("000.jpg", b"j" * 700), ("001.cls", b"2"),
                                                ("001.jpg", b"j" * 700)]))
        idx = sample_index(tmp, ("cls", "jpg"), index_cache=False)
        idx.keys, idx.key_end = np.frombuffer(b"000001", np.uint8), np.array([3, 6], np.int64)

    def npy(a) -> bytes:
        b = io.BytesIO(); np.save(b, np.ascontiguousarray(a)); return b.getvalue()
    meta = dict(shards=["/data/s.tar"], fields=["cls", "jpg"], source="/data", kind="local", endpoint=None,
                versions=None)
    parts = [json.dumps(meta).encode()] + [npy(getattr(idx, n)) if getattr(idx, n) is not None else b"-"
                                           for n in ("shard", "offset", "size", "keys", "key_end", "shard_bytes")]
    _write("index", "saved", SEP.join(parts))
    meta2 = dict(meta, kind="ais", endpoint="http://127.0.0.1:8080", versions=["x/1"])
    _write("index", "ais", SEP.join([json.dumps(meta2).encode()] + parts[1:]))
    _write("index", "object-array", SEP.join([parts[0], npy(np.array([{}], dtype=object))] + parts[2:]))
    _write("index", "out-of-range", SEP.join([parts[0], npy(np.array([7, 7], np.int32))] + parts[2:]))


def manifest_seeds():
    m = dict(prefix="shard-", maxcount=10, complete=True, samples=20, bytes=4096, store="/data",
             shards=[dict(name="shard-000000.tar", samples=10, bytes=1024, sha256="0" * 64, fields={"cls": 10})],
             source=dict(listed=20, kept=20, skipped={"unreadable image": 1}, converted={"CMYK": 1}))
    _write("manifest", "full", json.dumps(m).encode())
    _write("manifest", "incomplete", json.dumps(dict(m, complete=False)).encode())
    _write("manifest", "minimal", b'{"shards": [], "complete": true}')
    _write("manifest", "not-json", b"{shards")


def etl_manifest_seeds():
    from .targets import ETL_SETTINGS
    shard = dict(name="part-000.tar", samples=3, bytes=1024, sha256=hashlib.sha256(b"\0" * 1024).hexdigest())
    m = dict(ETL_SETTINGS, engine="local", complete=True, missing={}, updated="2026-11-29T06:00:00Z", shards=[shard])
    _write("etl_manifest", "complete", json.dumps(m, indent=1, sort_keys=True).encode())
    _write("etl_manifest", "incomplete", json.dumps(dict(m, complete=False, missing={"part-001.tar": "ValueError: x",
                                                                                     "part-002.tar": "not run"},
                                                         engine="dask")).encode())
    _write("etl_manifest", "resized", json.dumps(dict(m, shards=[dict(shard, bytes=512)])).encode())
    _write("etl_manifest", "no-decode-no-seed", json.dumps(dict(m, decode=None, seed=None, shards=[])).encode())
    _write("etl_manifest", "other-run", json.dumps(dict(m, transform="m:g", seed=7)).encode())
    _write("etl_manifest", "outside", json.dumps(dict(m, shards=[dict(shard, name="../part-000.tar")])).encode())
    _write("etl_manifest", "not-json", b'{"kind": "shardkit-etl", "shards')
    _write("etl_manifest", "name-too-long", json.dumps(dict(m, shards=[dict(shard, name="a" * 300)])).encode())
    _write("etl_manifest", "name-lone-surrogate", json.dumps(dict(m, shards=[dict(shard, name="\ud800")])).encode())


def state_seeds():
    s = {"epoch": 1, "batches": [2, 1], "next_worker": 1, "seed": 1, "shards": "", "num_workers": 2, "batch_size": 4,
         "rank": 0, "world_size": 1, "shuffle": 1000, "epoch_samples": None, "reorder_shards": True, "plan": None,
         "mix": None}
    _write("stream_state", "saved", json.dumps(s).encode())
    _write("stream_state", "plan", json.dumps(dict(s, plan={"epoch": 1, "shards": [["shard-00000.tar", [0, 3]]]}))
           .encode())
    _write("stream_state", "other-shape", json.dumps([dict(s, num_workers=1, batches=[3]), dict(s, rank=1)]).encode())
    _write("stream_state", "field", b"\x05-12")
    r = {"epoch": 0, "batch": 3, "position": 12, "seed": 1, "samples": 40, "span": None, "mix": None,
         "batch_size": 4, "rank": 0, "world_size": 1, "pad": False, "drop_last": False}
    _write("random_state", "saved", json.dumps(r).encode())
    r2 = {k: v for k, v in r.items() if k != "position"}
    _write("random_state", "no-position", json.dumps(r2).encode())
    _write("random_state", "other-step", json.dumps(dict(r, batch_size=3, position=9)).encode())


def checkpoint_seeds(stream_state: dict | None = None):
    t = lambda x: {"__tensor__": x}  # noqa: E731
    ck = {"format": 2, "epoch": 0, "done": 3, "steps": 3, "history": [1.0, 0.9], "stats": t([3.0, 1.0, 12.0]),
          "keys_bytes": 4, "rank": 0, "world_size": 1, "model": {"weight": t([[0.1] * 3] * 2), "bias": t([0.0, 0.0])},
          "opt": {"state": {"0": {"momentum_buffer": t([[0.0] * 3] * 2)}},
                  "param_groups": [{"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "params": [0, 1]}]},
          "loader": None}
    _write("train_checkpoint", "saved", json.dumps(ck).encode())
    _write("train_checkpoint", "no-steps", json.dumps({k: v for k, v in ck.items() if k != "steps"}).encode())
    _write("train_checkpoint", "other-model", json.dumps(dict(ck, model={"weight": t([1.0])})).encode())
    _write("train_checkpoint", "bad-loader", json.dumps(dict(ck, loader={"epoch": -1})).encode())


def listing_seeds():
    page = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            '<Name>b</Name><Prefix></Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true'
            '</IsTruncated><NextContinuationToken>tok==</NextContinuationToken><Contents><Key>s-000.tar</Key>'
            '<Size>10240</Size><ETag>"abc"</ETag></Contents><Contents><Key>s-001.tar</Key><Size>0</Size></Contents>'
            '</ListBucketResult>')
    _write("s3_listing", "page", page.encode())
    _write("s3_listing", "error", b"<Error><Code>NoSuchBucket</Code><Message>The bucket does not exist</Message>"
                                  b"</Error>")
    _write("s3_listing", "entities", b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY a "aaaa">]><r>&a;&a;</r>')
    entries = [dict(n="s-000.tar", s=3072, cs="c1", v="1"),
               dict(n="s-000.tar/000.cls", s=1), dict(n="s-000.tar/000.jpg", s=700),
               dict(n="s-000.tar/001.cls", s=1), dict(n="s-000.tar/001.jpg", s=700),
               dict(n="s-001.tar", s=1024), dict(n="s-001.tar/__meta__", s=3)]
    _write("ais_listing", "arch-dir", json.dumps(dict(UUID="", ContinuationToken="", Flags=0, Entries=entries))
           .encode())
    _write("ais_listing", "no-shards", b'{"UUID": "", "ContinuationToken": "", "Flags": 0, "Entries": []}')
    _write("http_answers", "seconds", b"3\nbytes 0-99/1000\n100\n\"etag\"")
    _write("http_answers", "date", b"Wed, 21 Oct 2015 07:28:00 GMT\n\n4096\n\ncs\n2")
    _write("http_answers", "odd", b"-5\nbytes */x\n-1")


def source_seeds():
    for name, text in {"template": "shards-{000000..000015}.tar", "nested": "a-{0..2}-{x,y}/{00..03}.tar",
                       "s3": "s3://bucket/prefix/x-{0..3}.tar?endpoint_url=http://127.0.0.1:9000&region=eu&anonymous=1",
                       "s3-key-question": "s3://bucket/what?.tar", "size": "size:1.5GiB",
                       "unbalanced": "x-{0..3.tar", "step": "x-{0..20..5}.tar"}.items():
        _write("sources", name, text.encode())


def etl_seeds():
    shard = _tar([("000.cls", b"1"), ("000.txt", b"t")])
    _write("etl_http", "put-shard", b"\x01\x00shard.tar\nContent-Type: application/octet-stream\n\n" + shard)
    _write("etl_http", "get-source", b"\x00\x00shard-00000.tar\n\n")
    _write("etl_http", "health", b"\x00\x00health\n\n")
    _write("etl_http", "climb", b"\x00\x00_source/../../etc/passwd\n\n")
    _write("etl_http", "etl-fqn", b"\x00\x00x.tar?etl_fqn=/etc/passwd\n\n")
    _write("etl_http", "put-garbage", b"\x01\x00x.tar\n\n" + b"\x1f\x8b" + b"\0" * 40)


def main():
    from . import jpeg_corpus
    tar_seeds(); key_seeds(); index_seeds(); manifest_seeds(); etl_manifest_seeds(); state_seeds()
    checkpoint_seeds()
    listing_seeds(); source_seeds(); etl_seeds()
    jpeg_corpus.main()
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"corpus: {sum(1 for p in CORPUS.rglob('*') if p.is_file())} files, {total / 1e6:.2f} MB in {CORPUS}")


if __name__ == "__main__":
    main()
