"""The fuzz targets: one per parser of untrusted bytes. Each `setup()` does the slow work once and returns `one(data)`,
which parses `data` as that parser meets it and checks the target's invariants (a `Broken` is a finding; an error
outside the target's `allowed` is a finding too). tests/fuzz/make_corpus.py writes each target's seeds."""
from __future__ import annotations
import atexit
import io
import json
import math
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from .core import Broken, target

_SHM = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # scratch files of one input: in memory where it can


def _scratch(prefix: str) -> Path:
    "A new folder for a target's scratch files (in memory where it can be), removed when the process ends."
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=_SHM))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _json(data: bytes):
    "`data` as JSON (None where it is not): the plain data a saved state, a manifest or a listing is."
    try: return json.loads(data.decode("utf-8", "surrogatepass"))
    except (ValueError, UnicodeDecodeError, RecursionError): return None


# ---------------------------------------------------------------- the tar reader
def fix_checksums(tar: bytes) -> bytes:
    "`tar` with each header's checksum made right, so that mutations get past the checksum to the fields behind it."
    b, at = bytearray(tar), 0
    while at + 512 <= len(b) and b[at:at + 512].count(0) != 512:
        head = b[at:at + 512]
        head[148:156] = b" " * 8
        head[148:156] = b"%06o\0 " % (sum(head) & 0o777777)
        b[at:at + 512] = head
        field = bytes(head[124:136])
        if field[0] & 0x80: size = int.from_bytes(field[1:], "big")  # GNU base-256
        else:
            try: size = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
            except ValueError: break
        if size < 0 or size > len(b): break
        at += 512 + -(-size // 512) * 512
    return bytes(b)


def tarfile_files(tar: bytes) -> list[tuple[str, bytes]] | None:
    "The regular files Python's `tarfile` reads in `tar` (names and bytes), or None where it refuses the archive."
    try:
        with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as tf:
            out = []
            for m in tf:
                if m.isreg():
                    if not (m.name.startswith("__") and m.name.endswith("__")):
                        out.append((m.name, tf.extractfile(m).read()))
                elif not m.isdir(): return None  # a link or device: shardkit refuses it, by design
            # tarfile ends an archive quietly at a header it cannot parse (a field shardkit does not read, such as
            # mtime): that is a refusal, not an archive of fewer members
            return out if not tar[tf.offset:].strip(b"\0") else None
    except (tarfile.TarError, EOFError, OSError, ValueError, UnicodeError, OverflowError):
        return None


def _posix_names(tar: bytes, ents) -> bool:
    "Whether no header outside ustar carries a name prefix (tarfile joins it to the name; POSIX and shardkit do not)."
    return all(tar[e.data_offset - 512 + 257:][:5] == b"ustar" or not tar[e.data_offset - 512 + 345:][:155].strip(b"\0")
               for e in ents)


def padded_long_names(tar: bytes) -> bool:
    """Whether a GNU long-name record (type L or K) has bytes other than NUL past its size, in its block's padding:
    `tarfile` reads such a name to the first NUL of the whole block, GNU tar and shardkit to the record's size."""
    off = 0
    while off + 512 <= len(tar):
        h = tar[off:off + 512]
        if not h.strip(b"\0"): off += 512; continue
        try: size = int(h[124:136].strip(b"\0 ") or b"0", 8)
        except ValueError: return False  # a size in base 256 or damaged: left to the check
        end = off + 512 + (size + 511) // 512 * 512
        if h[156:157] in (b"L", b"K") and tar[off + 512 + size:end].strip(b"\0"): return True
        off = end
    return False


@target("tar")
def tar():
    "The one tar reader (shards/tar.py): headers, long names, pax records, sizes, truncation; against `tarfile`."
    from shardkit.loading.index import group_members
    from shardkit.shards.tar import read_samples, tar_entries, tar_members

    def one(data: bytes):
        if not data: return
        mode, tar = data[0], data[1:]
        if mode & 1: tar = fix_checksums(tar)
        try: members = [(m["fname"], m["data"]) for m in tar_members(io.BytesIO(tar), "fuzz.tar")]
        except Exception as e:
            members = e
        # the header scan that random access and counting use (data skipped by seeking) agrees with the full read
        try: ents = [e for e in tar_entries(io.BytesIO(tar), "fuzz.tar", data=False)]
        except Exception as e:
            ents = e
        if not tar.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")):
            if isinstance(ents, list) and not isinstance(members, Exception):
                files = [(e.name, e.data_offset, e.size) for e in ents if e.is_file]
                if [n for n, *_ in files if not (n.startswith("__") and n.endswith("__"))] != [n for n, _ in members]:
                    raise Broken(f"the header scan lists other members than the read: {files} vs {members}")
                for name, off, size in files:  # the offsets random access reads at hold the member's bytes
                    got = dict(members).get(name)
                    if got is not None and tar[off:off + size] != got and [n for n, _ in members].count(name) == 1:
                        raise Broken(f"member {name!r}: {size} bytes at offset {off} differ from what the read gave")
                group_members([n for n, *_ in files], [o for _, o, _ in files], [s for *_, s in files], "fuzz.tar")
        if isinstance(ents, Exception) and not isinstance(members, Exception):
            raise Broken(f"the header scan refuses what the read accepts: {ents}")
        if isinstance(members, Exception): raise members
        theirs = tarfile_files(tar) if _posix_names(tar, ents) and not padded_long_names(tar) else None
        if theirs is not None and theirs != members:
            raise Broken(f"tarfile reads {[(n, len(d)) for n, d in theirs][:8]}, shardkit "
                         f"{[(n, len(d)) for n, d in members][:8]}")
        for s in read_samples(io.BytesIO(tar), "fuzz.tar"):
            if not isinstance(s.get("__key__"), str): raise Broken(f"a sample without a key: {list(s)}")
    return one


# ---------------------------------------------------------------- keys and fields
def webdataset_split(name: str):
    "WebDataset's own rule (its regex), the reference split_key must match."
    import re
    m = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
    return (m.group(1), m.group(2)) if m else (None, None)


@target("keys")
def keys():
    "Sample key and field splitting (shards/fields.py): split_key as WebDataset splits, field types, unsafe names."
    from shardkit.shards.fields import field_ext, is_image_key, is_jpeg_key, is_mask_key, refuse_pickle, split_key
    from shardkit.shards.tar import is_meta_member, read_samples, unsafe_name

    def one(data: bytes):
        names = data.decode("utf-8", "surrogateescape").split("\0")[:64]
        for name in names:
            k, f = split_key(name)
            if len(name) <= 2000 and (k, f) != webdataset_split(name):
                raise Broken(f"split_key({name!r}) = {(k, f)}, WebDataset's rule gives {webdataset_split(name)}")
            if k is not None and f"{k}.{f}" != name: raise Broken(f"split_key({name!r}) = {(k, f)} loses characters")
            if f is not None:
                field_ext(f); is_image_key(f); is_jpeg_key(f); is_mask_key(f); refuse_pickle(f)
            why = unsafe_name(name)
            if why is None and (name.startswith("/") or ".." in name.split("/") or "\0" in name):
                raise Broken(f"unsafe_name({name!r}) is None")
            is_meta_member(name)
        # the same names as members of a tar, grouped into samples as the loader groups them
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for i, name in enumerate(names):
                if not name or name.endswith("/"): continue
                ti = tarfile.TarInfo(name); body = str(i).encode(); ti.size = len(body)
                try: tf.addfile(ti, io.BytesIO(body))
                except (ValueError, UnicodeError): return
        got = list(read_samples(io.BytesIO(buf.getvalue()), "fuzz.tar"))
        n = sum(1 for name in names if name and not name.endswith("/") and split_key(name)[0] is not None
                and not (name.startswith("__") and name.endswith("__")))
        if sum(len([k for k in s if not k.startswith("__")]) for s in got) > n:
            raise Broken(f"{n} members with keys became more fields: {got}")
    return one


# ---------------------------------------------------------------- the sample index on disk
_INDEX_PARTS = ("meta.json", "shard.npy", "offset.npy", "size.npy", "keys.npy", "key_end.npy", "shard_bytes.npy")
SEP = b"\n--8<--\n"


@target("index")
def index():
    "The on-disk sample index (loading/index.py load_index): meta.json and .npy arrays, memory-mapped, then used."
    from shardkit.loading.index import load_index
    root = _scratch("fuzz-index-")

    def one(data: bytes):
        folder = root / "idx"
        folder.mkdir(exist_ok=True)
        parts = data.split(SEP)
        for i, name in enumerate(_INDEX_PARTS):
            p = folder / name
            if i < len(parts) and parts[i] != b"-": p.write_bytes(parts[i])
            else: p.unlink(missing_ok=True)
        idx = load_index(folder)
        n = len(idx)
        repr(idx); idx.nbytes
        for i in {0, n // 2, n - 1} if n else ():
            if idx.keys is not None: idx.key(i)
            idx.shards[int(idx.shard[i])]
    return one


# ---------------------------------------------------------------- manifests
@target("manifest")
def manifest():
    "Conversion manifests (shards/manifest.py): read, resumed from, summarised, counted, listed (shards/tar.py)."
    from shardkit.shards.manifest import incomplete_jobs, manifest_fields, read_manifest, resume_point, summarize
    from shardkit.shards.tar import list_shards
    from shardkit.stores import open_store
    root = _scratch("fuzz-manifest-")
    (root / "shard-000000.tar").write_bytes(b"\0" * 1024)
    store = open_store(str(root))

    def one(data: bytes):
        (root / "shard-manifest.json").write_bytes(data)
        m = read_manifest(store, "shard-")
        incomplete_jobs(store); manifest_fields(store); list_shards(store)
        if isinstance(m, dict):
            summarize(m)
            resume_point(store, m, {"prefix": "shard-", "maxcount": m.get("maxcount")})  # the caller's settings
    return one


ETL_SETTINGS = dict(kind="shardkit-etl", src="/data/src", transform="m:f", decode="pil", seed=0)


@target("etl_manifest")
def etl_manifest():
    "The ETL manifest (etl/receipt.py): read back, resumed from (done_shards), written again; counted (list_shards)."
    from shardkit.etl.receipt import MANIFEST, done_shards, read_etl_manifest, write_etl_manifest
    from shardkit.shards.tar import list_shards
    from shardkit.stores import open_store
    root = _scratch("fuzz-etl-manifest-")
    (root / "part-000.tar").write_bytes(b"\0" * 1024)
    store = open_store(str(root))
    other = ETL_SETTINGS

    def one(data: bytes):
        (root / MANIFEST).write_bytes(data)
        m = read_etl_manifest(store)
        list_shards(store)
        if not isinstance(m, dict): raise Broken(f"a manifest file read back as {m!r}")
        own = {k: m.get(k) for k in other}  # the settings of the run that wrote it: the resume is reached
        done = done_shards(store, m, own)
        if any(store.size(n) != sh["bytes"] for n, sh in done.items()):
            raise Broken("a shard resumed at another size than its manifest's")
        again = write_etl_manifest(store, own, [*done, *m["missing"]], done, failed=m["missing"], engine=m["engine"])
        if read_etl_manifest(store) != again: raise Broken("a manifest written back reads back otherwise")
        done_shards(store, m, other)  # another run's settings: resumed where they are the same, else refused
    return one


# ---------------------------------------------------------------- saved loader states
def _shards(n: int = 40):
    import contextlib
    from shardkit import write_shards
    root = _scratch("fuzz-shards-")
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), contextlib.redirect_stdout(null):
        write_shards(({"__key__": f"{i:05d}", "cls": i % 4, "txt": f"s{i}"} for i in range(n)), str(root),
                     maxcount=10, total=n)
    return root


def _state(data: bytes, base: dict):
    "A state from `data`: JSON as a loader's `state_dict()` is, else one field of `base` set to a value from the bytes."
    s = _json(data)
    if s is not None: return s
    if not data: return base
    keys = sorted(base)
    k = keys[data[0] % len(keys)]
    v = data[1:].decode("latin-1")
    choices = [v, len(v), -len(v), float(len(v)) / 3, None, [len(v)] * (data[0] % 5), {"x": v}, 2**63, True,
               float("nan"), float("inf")]
    return {**base, k: choices[(data[0] >> 4) % len(choices)]}


def _snapshot(*objs):
    return [(o, dict(vars(o))) for o in objs]


def _restore(snap):
    for o, d in snap: vars(o).clear(); vars(o).update(d)


def _names_field(e: Exception, state) -> bool:
    msg = str(e)
    return any(str(k) in msg for k in (state if isinstance(state, dict) else {})) or "state" in msg


@target("stream_state")
def stream_state():
    "The streaming loader's load_state_dict (loading/stream.py, resume.py, elastic.py): loads to its place or refuses."
    from shardkit import create_dataloader, create_dataset
    from shardkit.errors import ShardkitError
    loader = create_dataloader(create_dataset(str(_shards()), fields=("cls", "txt"), seed=1, batch_size=4),
                               num_workers=2)
    snap = _snapshot(loader, loader.dataset, loader.dataset.shards)
    base = loader.state_dict()

    def one(data: bytes):
        _restore(snap)
        state = _state(data, base)
        try: loader.load_state_dict(state)
        except ShardkitError as e:
            if not _names_field(e, state): raise Broken(f"refused without naming a field: {e}") from None
            raise
        if isinstance(state, dict) and all(state.get(k) == base[k] for k in ("num_workers", "rank", "world_size")):
            got = loader.state_dict()  # the same shape: the loader is where the state says
            want = (int(state.get("epoch")), [int(x) for x in state["batches"]], int(state.get("next_worker", 0)))
            if (got["epoch"], got["batches"], got["next_worker"]) != want:
                raise Broken(f"loaded {state}, the loader says {got}")
    return one


@target("random_state")
def random_state():
    "The random-access loader's load_state_dict (loading/random_access.py): loads to the same position or refuses."
    from shardkit import create_dataloader, create_dataset
    from shardkit.errors import ShardkitError
    loader = create_dataloader(create_dataset(str(_shards()), fields=("cls", "txt"), seed=1, batch_size=4,
                                              access="random"), num_workers=2)
    snap = _snapshot(loader)
    base = loader.state_dict()
    import contextlib

    def one(data: bytes):
        _restore(snap)
        state = _state(data, base)
        try:
            with open(os.devnull, "w") as null, contextlib.redirect_stderr(null): loader.load_state_dict(state)
        except ShardkitError as e:
            if not _names_field(e, state): raise Broken(f"refused without naming a field: {e}") from None
            raise
        got = loader.state_dict()
        if got["epoch"] == int(state["epoch"]) and "position" in state and got["position"] != int(state["position"]):
            raise Broken(f"loaded position {state['position']}, the loader is at {got['position']}")
    return one


# ---------------------------------------------------------------- shardkit train checkpoints
def _tensors(x):
    "JSON with `{'__tensor__': [...]}` for tensors, as a checkpoint holds them."
    import torch
    if isinstance(x, dict):
        if set(x) == {"__tensor__"}:
            try: return torch.tensor(x["__tensor__"])
            except (TypeError, ValueError, RuntimeError, OverflowError): return x["__tensor__"]
        return {k: _tensors(v) for k, v in x.items()}
    if isinstance(x, list): return [_tensors(v) for v in x]
    return x


@target("train_checkpoint")
def train_checkpoint():
    "`shardkit train` checkpoints past torch.load (train/loop.py load_checkpoint), then resumed as run_epochs resumes."
    import contextlib
    import torch
    from shardkit import create_dataloader, create_dataset
    from shardkit.train.loop import OPTIMIZERS, load_checkpoint
    root = _scratch("fuzz-train-")
    model = torch.nn.Linear(3, 2)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    loader = create_dataloader(create_dataset(str(_shards()), fields=("cls", "txt"), seed=1, batch_size=4),
                               num_workers=2)
    snap = _snapshot(loader, loader.dataset, loader.dataset.shards)
    ck = root / "ck.pt"

    def one(data: bytes):
        saved = _json(data)
        if not isinstance(saved, dict): return
        _restore(snap); model.load_state_dict(weights)
        saved = _tensors(saved)
        if isinstance(saved.get("model"), dict): saved["model"] = {**weights, **saved["model"]}
        try: torch.save(saved, ck)
        except (TypeError, RuntimeError, OverflowError): return
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            got = load_checkpoint(ck, model, torch.device("cpu"), 1)
            OPTIMIZERS["sgd"](model.parameters(), lr=0.1).load_state_dict(got["opt"])  # as run_epochs does
            if got["loader"] is not None: loader.load_state_dict(got["loader"])
            stats, history = got["stats"].cpu() * 1.0, list(got["history"])
        ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        if not (all(ok(got[k]) for k in ("epoch", "done", "steps")) and stats.shape == (3,)
                and isinstance(history, list)):
            raise Broken(f"accepted a checkpoint at epoch {got['epoch']!r}, done {got['done']!r}, stats {stats!r}")
    return one


# ---------------------------------------------------------------- S3 and AIStore listings, HTTP answers
@target("s3_listing")
def s3_listing():
    "S3 ListObjectsV2 pages and error bodies (s3.py: _page, s3_code, s3_refusal)."
    from shardkit.s3 import S3Client, S3Settings, listing_page, s3_code, s3_refusal
    client = S3Client(S3Settings(endpoint_url="http://127.0.0.1:9", anonymous=True))

    def one(data: bytes):
        text = data.decode("utf-8", "replace")
        code, msg = s3_code(text)
        e = s3_refusal(client, "bucket", "s3://bucket/x", 403 if data[:1] == b"<" else 404, text=text)
        str(e)
        objs, more, token = listing_page(data)
        for o in objs:
            if not (isinstance(o.key, str) and isinstance(o.size, int) and o.size >= 0 and isinstance(o.etag, str)):
                raise Broken(f"a listed object {o!r}")
        if not isinstance(more, bool) or not isinstance(token, str): raise Broken(f"more={more!r} token={token!r}")
    return one


@target("ais_listing")
def ais_listing():
    "AIStore's JSON listing (the SDK's BucketList), indexed as random access indexes a bucket (loading/index.py)."
    import msgspec
    from aistore.sdk.types import BucketList
    from shardkit.loading.index import index_listing

    class Bucket:
        name = "fuzz"
        entries = []
        def list_objects_iter(self, **kw): return iter(self.entries)

    class Store:
        bucket, prefix, endpoint, spec = Bucket(), "", "http://127.0.0.1:9", "ais://fuzz"

    store = Store()

    def one(data: bytes):
        try: listing = msgspec.json.decode(data, type=BucketList)
        except (msgspec.MsgspecError, UnicodeDecodeError): return  # the SDK refuses it before shardkit sees it
        Bucket.entries = listing.entries or []
        idx = index_listing(store, ("cls", "jpg"), None)
        for i in range(min(len(idx), 4)): idx.key(i)
    return one


@target("http_answers")
def http_answers():
    "What shardkit reads from HTTP answers' headers (remote.py): Retry-After, versions, sizes, fault causes."
    import requests
    from shardkit.remote import Retries, answer_size, content_version, retry_after_seconds

    def one(data: bytes):
        parts = data.decode("latin-1").split("\n")
        r = requests.Response()
        r.status_code = 200 if len(parts) < 4 else 206
        names = ("Retry-After", "Content-Range", "Content-Length", "ETag", "Ais-Checksum-Value", "Ais-Version")
        r.headers.update({k: v for k, v in zip(names, parts)})
        s = retry_after_seconds(parts[0])
        if s is not None and not (isinstance(s, float) and math.isfinite(s) and s >= 0):
            raise Broken(f"Retry-After {parts[0]!r} gave {s!r} seconds")
        if s is not None:
            d = Retries(wait=5).delay(1, s)
            if not (math.isfinite(d) and d >= 0): raise Broken(f"a delay of {d!r}")
        n = answer_size(r)
        if n is not None and not (isinstance(n, int) and n >= 0): raise Broken(f"a size of {n!r}")
        content_version(r.headers)
    return one


# ---------------------------------------------------------------- sources: brace templates, s3:// URLs with settings
@target("sources")
def sources():
    "Brace templates and `s3://` URLs with settings (store.py expand_names, s3.py parse_s3_url, loading/sources.py)."
    from shardkit.loading.sources import shard_urls
    from shardkit.s3 import parse_s3_url, s3_name, s3_url
    from shardkit.stores import expand_names, parse_size

    def one(data: bytes):
        text = data.decode("utf-8", "replace")[:512]
        if text.startswith("s3://"):
            bucket, key, settings = parse_s3_url(text)
            again = parse_s3_url(s3_url(bucket, key, settings))
            if again != (bucket, key, settings) and "?" not in key:
                raise Broken(f"{text!r} -> {(bucket, key, settings)} -> {s3_url(bucket, key, settings)!r} -> {again}")
            s3_name(text)
            return
        if text.startswith("size:"): parse_size(text[5:]); return
        if text.count("{") > 4 or re.search(r"\d{6}", text): return  # ranges are as large as written: by design
        names = expand_names(text)
        if "{" in text and "/" not in text: shard_urls(["http://127.0.0.1:9/" + n for n in names[:100]])
    return one


# ---------------------------------------------------------------- the ETL server's HTTP requests
@target("etl_http", allowed=())
def etl_http():
    "The ETL sidecar's HTTP handling (etl/sidecar.py, etl/server.py), driven in-process: refusals, transforms, no 500."
    import logging
    from starlette.testclient import TestClient
    from shardkit.etl.sidecar import sidecar_server
    for name in ("uvicorn", "httpx"): logging.getLogger(name).setLevel(logging.CRITICAL)
    import socket
    import threading
    import httpx
    import uvicorn
    with socket.socket() as sock: sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]
    src = _shards(8)
    server = sidecar_server(lambda sample: sample, str(src), port=port, decode=None)
    server.logger.setLevel(logging.CRITICAL)
    # the same app also listens on `port`: a GET pulls the shard from it (`/_source/...`), as from an AIStore target
    real = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="critical"))
    threading.Thread(target=real.run, daemon=True).start()
    while not real.started: time.sleep(0.01)
    client = TestClient(server.app, raise_server_exceptions=False).__enter__()  # its start-up runs, as uvicorn's
    methods = ("GET", "PUT", "HEAD", "POST", "DELETE", "OPTIONS", "PATCH")

    def one(data: bytes):
        if len(data) < 2: return
        head, _, body = data[2:].partition(b"\n\n")
        lines = head.decode("latin-1").split("\n")
        path = lines[0].replace(" ", "%20").replace("#", "%23") or "/"
        hdrs = {}
        for line in lines[1:8]:
            k, _, v = line.partition(":")
            if k.strip() and k.strip().isascii() and k.strip().isprintable(): hdrs[k.strip()] = v.strip()
        try:
            r = client.request(methods[data[0] % len(methods)], "/" + path.lstrip("/"), headers=hdrs, content=body)
        except (ValueError, UnicodeError, httpx.InvalidURL):
            return  # the HTTP client refuses to send it (a header it cannot encode): nothing reaches the server
        if r.status_code >= 500: raise Broken(f"HTTP {r.status_code}: {r.text[:300]}")
    return one


# ---------------------------------------------------------------- the JPEG header probe (Python)
@target("jpeg_header")
def jpeg_header():
    "The JPEG header probe that refuses bombs (shards/fields.py image_size): what libjpeg then decodes is that size."
    import torch
    from torchvision.io import ImageReadMode, decode_image
    from shardkit.shards.fields import SkipSample, image_size

    def one(data: bytes):
        try: w, h = image_size(data, max_pixels=4_000_000)
        except SkipSample: return
        if not data.startswith(b"\xff\xd8") or len(data) > 200_000: return
        try: x = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError: return
        if tuple(x.shape[1:]) != (h, w):
            raise Broken(f"the probe says {w} x {h}, libjpeg decodes {x.shape[2]} x {x.shape[1]}")
    return one
