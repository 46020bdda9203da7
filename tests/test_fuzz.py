"""The fuzz targets' smoke run (tests/fuzz): every target over its corpus, the inputs earlier runs found among them,
plus a second or two of new inputs from a small mutator; the C decoder under libFuzzer with ASan and UBSan for a few
seconds. And one test per bug the fuzzing found, named after what went wrong. The smoke runs are `slow` (the whole
suite, so CI, runs them: about 20 s on 2 cores); the bugs' tests are in the fast tier too."""
import io
import json
import random
import re
import shutil
import subprocess
import time
import pytest
from tests.fuzz import targets  # noqa: F401  (registers the targets)
from tests.fuzz.core import TARGETS, corpus_files, mutate, peak_rss_mb
from tests.fuzz.run import C_TARGET, build_c, why_no_clang

NEW_INPUTS_S = 1.0  # seconds of new inputs per target: the smoke run adds seconds, not minutes, to the suite
SLOW_BOUND_S = 5.0  # the fuzzing bound is 1 s an input; the suite's machine may be loaded, so 5x here


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_smoke(name):
    t = TARGETS[name]
    seeds = [p.read_bytes() for p in corpus_files(name)]
    assert seeds, f"no seed corpus for {name}: run python -m tests.fuzz.make_corpus"
    t.ready()
    t.check(seeds[0])  # the first input imports what the parser imports lazily: not timed
    for data in seeds:  # the seeds and every crash or slow input found so far (regression inputs)
        took = t.check(data)
        assert took < SLOW_BOUND_S, f"{name}: a corpus input took {took:.1f} s"
    rng, n, end = random.Random(name), 0, time.monotonic() + NEW_INPUTS_S
    while time.monotonic() < end:
        data = mutate(rng.choice(seeds), rng, seeds)
        took = t.check(data)
        assert took < SLOW_BOUND_S, f"{name}: {data[:200]!r} took {took:.1f} s"
        n += 1
    assert n > 0 and peak_rss_mb() < 4096


@pytest.mark.slow
def test_c_decoder_smoke(tmp_path):
    if why := why_no_clang(): pytest.skip(f"the C decoder's libFuzzer smoke run needs clang: {why}")
    binary = build_c(tmp_path)  # a private temporary folder: nothing else can write the binary there
    (tmp_path / "new").mkdir()
    corpus = str(corpus_files(C_TARGET)[0].parent)
    r = subprocess.run([str(binary), "-max_total_time=4", "-timeout=60", "-rss_limit_mb=3072",
                        f"-artifact_prefix={tmp_path}/", str(tmp_path / "new"), corpus],
                       capture_output=True, text=True, timeout=300)
    tail = r.stderr[-3000:]
    assert r.returncode == 0 and "ERROR" not in r.stderr and "runtime error" not in r.stderr, tail
    assert "Done" in r.stderr, tail


# ---- one test per bug found -------------------------------------------------------------------------------------
def tar_member(name: bytes, body: bytes, kind: bytes = b"0", size: int | None = None) -> bytes:
    h = bytearray(512)
    h[:len(name)] = name; h[100:108] = b"0000644\0"; h[124:136] = b"%011o\0" % (len(body) if size is None else size)
    h[156:157] = kind; h[257:263] = b"ustar\0"; h[263:265] = b"00"
    h[148:156] = b" " * 8; h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h) + body + b"\0" * (-len(body) % 512)


def test_pax_record_of_length_zero_is_refused_not_looped():
    from shardkit.shards.fields import ShardError
    from shardkit.shards.tar import tar_members
    tar = tar_member(b"PaxHeader", b"0 path=a.txt\n", b"x") + tar_member(b"x.txt", b"hello") + b"\0" * 1024
    t0 = time.monotonic()
    with pytest.raises(ShardError, match="broken pax header"): list(tar_members(io.BytesIO(tar)))
    assert time.monotonic() - t0 < 5


def test_split_key_is_webdatasets_rule_in_linear_time():
    from shardkit.shards.fields import split_key
    from tests.fuzz.targets import webdataset_split
    rng = random.Random(0)
    for _ in range(20_000):
        name = "".join(rng.choice("ab./\n") for _ in range(rng.randrange(14)))
        assert split_key(name) == webdataset_split(name), name
    t0 = time.monotonic()
    assert split_key("a/" * 200_000 + "k.jpg") == ("a/" * 200_000 + "k", "jpg")  # the regex: minutes
    assert time.monotonic() - t0 < 1


def test_a_header_claiming_gigabytes_is_not_allocated():
    import tracemalloc
    from shardkit.shards.fields import ShardError
    from shardkit.shards.tar import tar_members
    tar = tar_member(b"a.jpg", b"x" * 100, size=8 << 30)  # 8 GB claimed, 100 bytes there
    tracemalloc.start()
    with pytest.raises(ShardError, match="ends inside a member"): list(tar_members(io.BytesIO(tar)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20


def test_a_negative_size_is_refused_not_sought_back():
    "int(text, 8) takes a sign: a size of -512 sent the header scan back to the same header, for ever."
    from shardkit.shards.fields import ShardError
    from shardkit.shards.tar import tar_entries
    h = bytearray(tar_member(b"a.jpg", b"")); h[124:136] = b"-0001000\0   "
    h[148:156] = b" " * 8; h[148:156] = b"%06o\0 " % sum(h[:512])
    for data in (True, False):
        t0 = time.monotonic()
        with pytest.raises(ShardError, match="bad size"): list(tar_entries(io.BytesIO(bytes(h) * 3), data=data))
        assert time.monotonic() - t0 < 5


def test_etl_skips_a_sample_with_a_field_of_no_name():
    "A member named `000.` is a field with no name: the writer cannot write it (IndexError, HTTP 500 before)."
    import warnings
    from shardkit.etl.shard_transform import ShardTransform
    tar = tar_member(b"000.", b"x") + tar_member(b"001.cls", b"1") + b"\0" * 1024
    t = ShardTransform(lambda s: s, None, "skip", None)
    with warnings.catch_warnings(): warnings.simplefilter("ignore"); out = t(tar, "s.tar")
    assert t.counts["skipped"] == 1 and t.counts["out"] == 1 and b"001.cls" in out


def test_an_empty_long_name_is_an_empty_name():
    "An empty GNU long name names the next member '' (as tarfile reads it), refused; not the header's own name."
    from shardkit.shards.fields import ShardError
    from shardkit.shards.tar import tar_members
    tar = tar_member(b"././@LongLink", b"\0", b"L") + tar_member(b"a.txt", b"t") + b"\0" * 1024
    with pytest.raises(ShardError, match="empty name"): list(tar_members(io.BytesIO(tar)))


def test_a_long_name_is_read_to_its_size_not_into_its_padding():
    "A GNU long name of 5 bytes whose block goes on with letters: the name is the 5 bytes (tarfile reads on to a NUL)."
    from shardkit.shards.tar import tar_members
    from tests.fuzz.targets import padded_long_names
    tar = tar_member(b"././@LongLink", b"a.cls", b"L") + tar_member(b"x", b"1") + b"\0" * 1024
    tar = tar[:512 + 5] + b"txt" + tar[512 + 8:]  # the long name's padding holds "txt"
    assert [m["fname"] for m in tar_members(io.BytesIO(tar))] == ["a.cls"]
    assert padded_long_names(tar) and not padded_long_names(tar_member(b"a.txt", b"t") + b"\0" * 1024)


def test_an_old_style_directory_is_no_member():
    "A member of type '\\0' (old tars' regular file) whose name ends in '/' is a directory, as tarfile reads it."
    from shardkit.shards.tar import tar_members
    tar = tar_member(b"dir/", b"", kind=b"\0") + tar_member(b"dir/k.txt", b"t") + b"\0" * 1024
    assert [m["fname"] for m in tar_members(io.BytesIO(tar))] == ["dir/k.txt"]


def test_retry_after_and_sizes_from_odd_headers():
    import requests
    from shardkit.remote import answer_size, retry_after_seconds
    assert retry_after_seconds("nan") is None and retry_after_seconds("inf") is None
    assert retry_after_seconds("3") == 3.0
    r = requests.Response(); r.status_code = 206
    r.headers.update({"Content-Range": "bytes 0-9/³10"})  # str.isdigit() takes '³'
    assert answer_size(r) is None


def test_s3_listing_and_url_refusals():
    from shardkit.errors import StoreError
    from shardkit.s3 import listing_page, parse_s3_url
    for page in (b"", b"not xml", b'<?xml version="1.0" encoding="UTF-6"?><r/>', b"<r><Contents><Size>1</Size>"
                 b"</Contents></r>", b"<r><Contents><Key>k</Key><Size>x</Size></Contents></r>"):
        with pytest.raises(StoreError): listing_page(page)
    with pytest.raises(StoreError, match="not a bucket name"): parse_s3_url("s3://b?x=1/k.tar")


def test_unsound_manifest_is_refused(tmp_path):
    from shardkit.errors import StoreError
    from shardkit.shards.manifest import read_manifest
    ok = '"store": "x", "samples": 0, "bytes": 0'
    for text in ("", "{}", "[1]", '{"shards": [1], %s}' % ok,
                 '{"shards": [], "source": {"skipped": {"a": "1"}}, %s}' % ok):
        (tmp_path / "shard-manifest.json").write_text(text)
        with pytest.raises(StoreError, match="not a shardkit manifest"): read_manifest(str(tmp_path))


def test_unsound_etl_manifest_is_refused_naming_its_field(tmp_path):
    from shardkit.errors import StoreError
    from shardkit.etl.receipt import MANIFEST, done_shards, read_etl_manifest
    from shardkit.stores import open_store
    from tests.fuzz.targets import ETL_SETTINGS
    shard = dict(name="part-000.tar", samples=3, bytes=4, sha256="0" * 64)
    m = dict(ETL_SETTINGS, engine="local", complete=True, missing={}, updated="2026-11-29T06:00:00Z", shards=[shard])
    (tmp_path / "part-000.tar").write_bytes(b"tar!")
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    assert read_etl_manifest(str(tmp_path)) == m
    assert done_shards(open_store(str(tmp_path)), m, ETL_SETTINGS) == {"part-000.tar": shard}  # sound: resumed
    for said, bad in [("not JSON", "{"), ("not JSON", b"\xff{}"), ("a JSON list", []), ("kind", {**m, "kind": 1}),
                      ("src is not a string", {**m, "src": None}), ("engine is not a string", {**m, "engine": 2}),
                      ("decode is neither", {**m, "decode": 1}), ("seed is neither", {**m, "seed": 1.5}),
                      ("seed is neither", {**m, "seed": True}), ("complete is not true or false", {**m, "complete": 1}),
                      ("missing is not an object", {**m, "missing": ["a"]}),
                      ("missing is not an object", {**m, "missing": {"a": 1}}),
                      ("complete is true with shards missing", {**m, "missing": {"a": "not run"}}),
                      ("shards is not a list", {**m, "shards": {}}), ("shards[0] is not an object", {**m, "shards": [1]}),
                      ("shards[1].name", {**m, "shards": [shard, {**shard, "name": ""}]}),
                      ("shards[0].samples is not a count", {**m, "shards": [{**shard, "samples": "3"}]}),
                      ("shards[0].bytes is not a count", {**m, "shards": [{**shard, "bytes": -4}]}),
                      ("shards[0].bytes is not a count", {**m, "shards": [{**shard, "bytes": 4.0}]}),
                      ("shards[0].sha256", {**m, "shards": [{**shard, "sha256": "0" * 63}]})]:
        text = bad if isinstance(bad, (str, bytes)) else json.dumps(bad)
        (tmp_path / MANIFEST).write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(StoreError, match=f"etl-manifest.json in .* is not an ETL manifest \\({re.escape(said)}"):
            read_etl_manifest(str(tmp_path))


def test_a_local_store_refuses_names_no_file_can_have(tmp_path):
    from shardkit.errors import StoreError
    from shardkit.etl.receipt import done_shards, read_etl_manifest
    from shardkit.stores import open_store
    from tests.fuzz.core import CORPUS
    from tests.fuzz.targets import ETL_SETTINGS
    store = open_store(str(tmp_path))
    for name in ("a" * 256, "a/" * 2100, "\ud800.tar"):  # OSError (name too long), UnicodeEncodeError
        with pytest.raises(StoreError, match="longer than a file name can be|a lone surrogate"): store.exists(name)
    assert not store.exists("a" * 255) and not store.exists("\udcff.tar")  # a name that fits; a byte not UTF-8
    for kept in ("name-too-long", "name-lone-surrogate"):  # an ETL manifest's shard named so: resumed from
        shutil.copy(CORPUS / "etl_manifest" / kept, tmp_path / "etl-manifest.json")
        with pytest.raises(StoreError, match="object name"):
            done_shards(store, read_etl_manifest(store), ETL_SETTINGS)


def test_wall_clock_timeouts_of_a_loaded_machine_replay_in_milliseconds():
    "libFuzzer stopped two inputs at 10 s of wall time while the machine's load was 13; each takes about 1 ms of CPU."
    from tests.fuzz.core import CORPUS
    t = TARGETS["etl_manifest"]
    t.ready()
    kept = sorted((CORPUS / "etl_manifest").glob("timeout-*"))
    assert kept and all(t.check(p.read_bytes()) < 0.1 for p in kept)  # the C decoder's: its smoke run replays it


def test_damaged_index_is_refused(tmp_path):
    from shardkit.loading.index import RandomAccessError, load_index
    (tmp_path / "meta.json").write_text(json.dumps(dict(shards=["a.tar"], fields=["cls"], source="x", kind="local")))
    import numpy as np
    np.save(tmp_path / "shard.npy", np.array([0, 5], np.int32))  # shard 5 of 1
    np.save(tmp_path / "size.npy", np.ones((2, 1), np.int32))
    with pytest.raises(RandomAccessError, match="shard numbers past the shards"): load_index(tmp_path)
    (tmp_path / "shard.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': '<i4\n")
    with pytest.raises(RandomAccessError, match="damaged"): load_index(tmp_path)
    (tmp_path / "shard.npy").write_bytes(b"\x93NUMPY\x01\x00\x20\x00{'descr': b'', 'shape': (2,)}    \n")
    with pytest.raises(RandomAccessError, match="damaged"): load_index(tmp_path)  # TypeError in numpy's parser
    (tmp_path / "meta.json").unlink()
    with pytest.raises(RandomAccessError, match="damaged"): load_index(tmp_path)


def test_an_index_array_whose_shape_overflows_is_refused():
    "A .npy header whose shape multiplies past int64: numpy's memmap raised OverflowError."
    from tests.fuzz.core import CORPUS
    t = TARGETS["index"]
    t.ready()
    t.check((CORPUS / "index" / "crash-98bafc1380b1ba00").read_bytes())  # RandomAccessError only


def test_saved_states_are_refused_naming_their_field():
    from shardkit.errors import LoaderError
    from shardkit.loading.elastic import merge_states
    from tests.fuzz.core import TARGETS
    TARGETS["random_state"].ready()
    base = {"epoch": 0, "batch": 3, "seed": 1, "samples": 40, "span": None, "mix": None, "batch_size": 4,
            "rank": 0, "world_size": 1, "drop_last": False}
    with pytest.raises(LoaderError, match="pad"):
        TARGETS["random_state"].one(json.dumps(base).encode())  # no `pad`: a KeyError before
    s = {"epoch": 0, "batches": [1], "seed": 1, "shards": "", "num_workers": 1.0, "batch_size": 4, "rank": 0,
         "world_size": 1, "shuffle": 0}
    assert merge_states(s)["num_workers"] == 1 and type(merge_states(s)["num_workers"]) is int
    with pytest.raises(LoaderError, match="batches"): merge_states(dict(s, batches=3))


def test_train_checkpoint_without_a_field_is_refused(tmp_path):
    import torch
    from shardkit.train.loop import load_checkpoint
    from shardkit.train.data import TrainError
    model = torch.nn.Linear(3, 2)
    ck = dict(format=2, epoch=0, done=1, steps=1, history=[], stats=torch.zeros(3), model=model.state_dict(),
              opt=dict(state={}, param_groups=[dict(lr=0.1, params=[0, 1])]), loader=None)
    for broken, field in ((dict(ck, stats=[1]), "stats"), (dict(ck, done=-1), "done"),
                          (dict(ck, opt=dict(state={7: {}}, param_groups=ck["opt"]["param_groups"])), "opt"),
                          (dict(ck, loader="x"), "loader")):
        torch.save(broken, tmp_path / "ck.pt")
        with pytest.raises(TrainError, match=field): load_checkpoint(tmp_path / "ck.pt", model, "cpu", 1)
    torch.save(ck, tmp_path / "ck.pt")
    assert load_checkpoint(tmp_path / "ck.pt", model, "cpu", 1)["steps"] == 1


def test_sidecar_source_route_refuses_names_no_file_can_have(tmp_path):
    from starlette.testclient import TestClient
    from shardkit.etl.sidecar import sidecar_server
    server = sidecar_server(lambda s: s, str(tmp_path), decode=None)
    client = TestClient(server.app, raise_server_exceptions=False)
    assert client.get("/_source/" + "x" * 300).status_code == 400  # too long for the file system
    assert client.get("/_source/a%00b").status_code == 400  # a NUL byte: ValueError in the path's resolve()


def test_tarfile_agrees_on_the_corpus():
    "The differential check holds on every seed both readers accept (tar seeds carry a mode byte first)."
    from shardkit.shards.tar import tar_members
    from tests.fuzz.targets import tarfile_files
    agreed = 0
    for p in corpus_files("tar"):
        tar = p.read_bytes()[1:]
        theirs = tarfile_files(tar)
        try: ours = [(m["fname"], m["data"]) for m in tar_members(io.BytesIO(tar))]
        except Exception: continue
        if theirs is not None: assert ours == theirs, p.name; agreed += 1
    assert agreed >= 3


def test_runner_table(tmp_path):
    "The named command's table, from a run short enough for the suite (one fast target)."
    if shutil.which("nice") is None: pytest.skip("no nice")
    from tests.fuzz.run import fuzz_one, table
    pytest.importorskip("atheris")
    row = fuzz_one("http_answers", 1, None, tmp_path, nice=0)
    assert row["executions"] > 0 and row["crashes"] == 0, open(row["log"]).read()[-2000:]
    assert "| http_answers |" in table([row])
