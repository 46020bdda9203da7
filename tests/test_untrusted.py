"""Shards, data set folders and HTTP requests come from other people. Each test here feeds shardkit a real
hostile or unlucky input (a member that climbs out of its folder, a link, a decompression bomb, a full disk,
a kill -9, a flipped bit) and checks that it gets a clear error or a counted skip: never silent loss,
never a file outside the roots it was given, never a hang."""
import io, json, os, signal, subprocess, sys, tarfile, textwrap, time, uuid
from pathlib import Path
import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from shardkit.apps.cli import main as cli_main
from shardkit.ingest.pets import PetsError, convert_pets, pet_records, synthesize_pets
from shardkit.shards.fields import ShardError
from shardkit.shards.manifest import read_manifest, verify_shards
from shardkit.shards.tar import read_samples, sample_digests
from shardkit.shards.write import write_shards
from shardkit.shuffle import shuffle_shards
from shardkit.errors import StoreError
from shardkit.stores import open_store
from shardkit.ingest.synth import draw_animal, jpeg_bytes, png_bytes


def _tar(members) -> bytes:
    "A tar of (name, kind, data) members; kind: 'file', 'sym' (to /etc/passwd) or 'hard' (to the first member)."
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, data in members:
            ti = tarfile.TarInfo(name)
            if kind == "sym": ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"; tf.addfile(ti)
            elif kind == "hard": ti.type, ti.linkname = tarfile.LNKTYPE, members[0][0]; tf.addfile(ti)
            else: ti.size = len(data); tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _sample_members(key, seed=0):
    img, tri = draw_animal(seed % 37, np.random.default_rng(seed), size=(48, 36))
    return [(f"{key}.image.jpg", "file", jpeg_bytes(img)), (f"{key}.cls", "file", str(seed % 37).encode()),
            (f"{key}.trimap.png", "file", png_bytes(tri))]


def _imagenet_members(key, seed=0):
    "An ImageNet-style sample (NAME.jpg + NAME.cls), what the ETL transforms expect."
    img, _ = draw_animal(seed % 37, np.random.default_rng(seed), size=(48, 36))
    return [(f"{key}.jpg", "file", jpeg_bytes(img)), (f"{key}.cls", "file", str(seed % 37).encode())]


@pytest.mark.parametrize("evil", [("../escape.cls", "file", b"1"), ("/abs/x.cls", "file", b"1"),
                                  ("link.jpg", "sym", b""), ("hard.jpg", "hard", b"")], ids=["dotdot", "absolute", "symlink", "hardlink"])
def test_reader_refuses_dangerous_members(evil):
    data = _tar(_sample_members("a") + [evil])
    with pytest.raises(ShardError, match="evil.tar has a member") as e: list(read_samples(io.BytesIO(data), "evil.tar"))
    assert repr(evil[0]) in str(e.value)


def test_shuffle_never_writes_a_dangerous_member(tmp_path):
    src = open_store(tmp_path / "src", create=True)
    src.put_bytes(_tar(_sample_members("a", 1) + [("../escape.cls", "file", b"1"), ("b.jpg", "sym", b"")] + _sample_members("c", 2)), "in-0.tar")
    res = shuffle_shards(src, tmp_path / "out", "1MB", progress=False)
    names = [m for n in res.names for m in tarfile.open(tmp_path / "out" / n).getnames()]
    assert sorted(names) == sorted(n for n, _, _ in _sample_members("a", 1) + _sample_members("c", 2))
    assert res.skipped == 2  # counted, and reported by the CLI


def test_writer_refuses_unsafe_keys(tmp_path):
    for key in ("../up", "/abs/key"):
        with pytest.raises(ValueError, match="safe to extract"):
            write_shards([{"__key__": key, "txt": "x"}], tmp_path / "w", progress=False)
    assert not list((tmp_path.parent).glob("up*"))


@pytest.fixture
def pets(tmp_path):
    root = tmp_path / "pets"
    synthesize_pets(root, n=40, seed=5)
    return root


def test_list_txt_cannot_pull_files_from_outside(pets, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jpg").write_bytes((pets / "images" / "Abyssinian_1.jpg").read_bytes())
    lst = pets / "annotations" / "list.txt"
    lst.write_text(lst.read_text() + "../../outside/secret 1 1 1\n")
    with pytest.raises(PetsError, match="is a path, not a file name"): pet_records(pets)
    assert cli_main(["convert", "pets", str(pets), str(tmp_path / "out")]) == 2


def test_links_out_of_the_data_set_are_skipped(pets, tmp_path):
    secret = tmp_path / "secret.jpg"
    secret.write_bytes((pets / "images" / "Bengal_1.jpg").read_bytes())
    (pets / "images" / "Abyssinian_1.jpg").unlink()
    (pets / "images" / "Abyssinian_1.jpg").symlink_to(secret)
    m = convert_pets(pets, tmp_path / "out", progress=False)
    assert m["source"]["skipped"] == {"link out of the data set": 1}
    assert "Abyssinian_1" not in sample_digests(tmp_path / "out")


@pytest.mark.timed
def test_decompression_bomb_is_a_counted_skip(pets, tmp_path):
    bomb = io.BytesIO()
    Image.new("L", (20000, 20000)).save(bomb, "PNG")  # a few hundred KB on disk, 400 M pixels decoded
    (pets / "annotations" / "trimaps" / "Bengal_1.png").write_bytes(bomb.getvalue())
    t0 = time.monotonic()
    m = convert_pets(pets, tmp_path / "out", progress=False)
    assert m["source"]["skipped"] == {"oversized image": 1} and m["samples"] == 39
    assert time.monotonic() - t0 < 120  # no 400 MB decode per check


@pytest.mark.timed
def test_listed_names_are_not_templates(tmp_path):
    "A file literally named odd-{0..3000000}.tar is one shard, not three million."
    from shardkit import create_dataset
    d = tmp_path / "odd"
    d.mkdir()
    (d / "odd-{0..3000000}.tar").write_bytes(_tar(_sample_members("a", 3)))
    t0 = time.monotonic()
    samples = list(create_dataset(str(d), fields=("__key__", "cls"), batch_size=None, shuffle=0))
    assert time.monotonic() - t0 < 60
    assert [s[0] for s in samples] == ["a"]


@pytest.fixture
def tiny_disk(tmp_path):
    "A 600 KB tmpfs: a destination that fills up. Skips where mounting is not permitted."
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode: pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode})")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_full_disk_says_where_and_resumes(tiny_disk, tmp_path):
    rng = np.random.default_rng(0)
    samples = [{"__key__": f"s{i:03d}", "bin": rng.bytes(60_000)} for i in range(20)]  # 1.2 MB of noise
    with pytest.raises(StoreError, match="no space left") as e:
        write_shards(samples, tiny_disk, prefix="big-", maxcount=2, progress=False)
    msg = str(e.value)
    assert str(tiny_disk) in msg and "run the same command again" in msg
    part = read_manifest(tiny_disk, "big-")
    assert part["complete"] is False and len(part["shards"]) >= 1
    stored = [s["name"] for s in part["shards"]]
    subprocess.run(["mount", "-o", "remount,size=4m", str(tiny_disk)], check=True)
    m = write_shards(samples, tiny_disk, prefix="big-", maxcount=2, progress=False)
    assert m["complete"] and m["samples"] == 20 and [s["name"] for s in m["shards"]][:len(stored)] == stored
    assert not [p for p in Path(tiny_disk).iterdir() if p.name.startswith(".")]  # no temp files left behind


KILL_SHUFFLE = textwrap.dedent("""
    import os, signal, sys
    from shardkit import shuffle
    from shardkit.shards import manifest
    real = manifest.save_manifest
    def save(store, m):
        real(store, m)
        if len(m["shards"]) == 2 and not m["complete"]: os.kill(os.getpid(), signal.SIGKILL)
    shuffle.save_manifest = save
    shuffle.shuffle_shards(sys.argv[1], sys.argv[2], "100KB", seed=3, progress=False)
""")


@pytest.mark.slow
def test_shuffle_killed_midway_resumes_exactly(tmp_path):
    src = open_store(tmp_path / "src", create=True)
    for s in range(4):
        src.put_bytes(_tar([m for i in range(10) for m in _sample_members(f"k{s}_{i}", s * 10 + i)]), f"in-{s}.tar")
    full = shuffle_shards(src, tmp_path / "full", "100KB", seed=3, progress=False)
    r = subprocess.run([sys.executable, "-c", KILL_SHUFFLE, str(tmp_path / "src"), str(tmp_path / "part")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == -9, r.stderr
    assert read_manifest(tmp_path / "part", "shuffled-")["complete"] is False
    assert list(tmp_path.glob("shardkit-shuffle-*")), "the killed run's staging folder is there to be cleaned"
    r = subprocess.run([sys.executable, "-m", "shardkit.apps.cli", "ls", str(tmp_path / "part")], capture_output=True, text=True, timeout=120)
    assert "did not finish" in r.stderr
    os.environ["TMPDIR"], old = str(tmp_path), os.environ.get("TMPDIR")
    try:
        import tempfile; tempfile.tempdir = None
        again = shuffle_shards(src, tmp_path / "part", "100KB", seed=3, progress=False)
    finally:
        if old is None: os.environ.pop("TMPDIR")
        else: os.environ["TMPDIR"] = old
        tempfile.tempdir = None
    assert again.names == full.names
    for n in full.names: assert (tmp_path / "part" / n).read_bytes() == (tmp_path / "full" / n).read_bytes()
    assert not list(tmp_path.glob("shardkit-shuffle-*")), "staging folders are cleaned"


def test_stale_temp_files_of_a_killed_conversion_are_cleaned(pets, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".pets-00003.tar.k2j3h4.tmp").write_bytes(b"half a shard")
    convert_pets(pets, out, maxcount=10, progress=False)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_second_writer_of_the_same_shards_is_refused_while_the_first_runs(pets, tmp_path, capsys):
    """Two conversions into one destination and prefix at once would share a staging folder: the second would empty
    the first's and interleave their shards. It is refused with the first one's pid; once the first ends (or dies:
    its lock goes with it), the next one runs."""
    from shardkit.shards.write import end_staging, staging_dir
    from shardkit.stores import open_store
    out = tmp_path / "out"
    first = staging_dir(open_store(out, create=True), "pets-")  # the first writer, mid-run, in this process
    (first / "pets-00000.tar").write_bytes(b"the first writer's shard")
    try:
        assert cli_main(["convert", "pets", str(pets), str(out), "--maxcount", "10"]) != 0
        err = capsys.readouterr().err
        assert f"another process (pid {os.getpid()}) is writing pets-* into" in err, err
        assert (first / "pets-00000.tar").read_bytes() == b"the first writer's shard"  # its files untouched
    finally: end_staging(first)
    assert convert_pets(pets, out, maxcount=10, progress=False)["complete"]


def test_bit_rot_is_found_by_verify(pets, tmp_path, capsys):
    m = convert_pets(pets, tmp_path / "out", maxcount=10, progress=False)
    assert cli_main(["verify", str(tmp_path / "out")]) == 0
    p = tmp_path / "out" / m["shards"][1]["name"]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    capsys.readouterr()
    assert convert_pets(pets, tmp_path / "out", maxcount=10, progress=False)["complete"]  # a re-run sees sizes only
    assert cli_main(["verify", str(tmp_path / "out")]) == 1  # a bad shard: a data error
    out = capsys.readouterr()
    assert f"{m['shards'][1]['name']}: SHA-256 differs" in out.out and "1 problem(s)" in out.err


# --- the ETL sidecar, a real server on 127.0.0.1 -------------------------------------------------------------

class _Marker:
    "Unpickling this creates a file: what a hostile shard's pickle would do (here, harmlessly)."
    def __init__(self, path): self.path = path
    def __reduce__(self): return (Path.touch, (Path(self.path),))


@pytest.fixture
def etl_src(tmp_path):
    src = open_store(tmp_path / "src", create=True)
    src.put_bytes(_tar(_imagenet_members("a", 1) + _imagenet_members("b", 2)), "good-0.tar")
    return src


@pytest.fixture
def sidecar(etl_src):
    from shardkit.etl.recipes import imagenet_val_npy
    from shardkit.etl.sidecar import Sidecar
    with Sidecar(imagenet_val_npy, etl_src) as sc: yield sc


@pytest.mark.slow
def test_sidecar_put_of_a_pickle_runs_no_code(sidecar, tmp_path):
    import pickle, requests
    marker = tmp_path / "pwned"
    for ext in ("pyd", "pickle", "pth"):
        data = _tar(_imagenet_members("a", 1) + [(f"a.meta.{ext}", "file", pickle.dumps(_Marker(marker)))])
        r = requests.put(f"{sidecar.url}/x.tar", data=data, timeout=120)
        assert r.status_code >= 400 or b"meta" not in r.content, (ext, r.status_code)
    assert not marker.exists(), "a pickle from the request body was unpickled in the sidecar"


@pytest.mark.slow
def test_sidecar_reads_nothing_outside_its_source(sidecar, tmp_path):
    import requests
    secret = tmp_path / "secret.tar"
    secret.write_bytes(_tar(_sample_members("s", 9)))
    r = requests.get(f"{sidecar.url}/good-0.tar", params={"etl_fqn": str(secret)}, timeout=60)
    assert r.status_code == 403 and "etl_fqn" in r.text
    r = requests.get(f"{sidecar.url}/{'..%2F' * 6}etc%2Fpasswd", timeout=60)
    assert r.status_code != 200 and "root:" not in r.text
    assert requests.get(f"{sidecar.url}/good-0.tar", timeout=120).status_code == 200  # what it is for still works


@pytest.mark.slow
def test_sidecar_makes_no_call_outs(sidecar):
    import http.server, threading, requests
    hits = []
    class Listener(http.server.BaseHTTPRequestHandler):
        def do_GET(self): hits.append(self.path); self.send_response(200); self.end_headers()
        do_PUT = do_POST = do_GET
        def log_message(self, *a): pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}/stolen"
        r = requests.get(f"{sidecar.url}/good-0.tar", headers={"Ais-Node-Url": url}, timeout=60)
        r2 = requests.put(f"{sidecar.url}/good-0.tar", data=b"x", headers={"Ais-Node-Url": url}, timeout=60)
        time.sleep(1)
        assert r.status_code == 403 and r2.status_code == 403 and hits == []
    finally: srv.shutdown()


@pytest.mark.timed
def test_sidecar_port_is_checked_fast(etl_src):
    t0 = time.monotonic()
    assert cli_main(["etl", "serve", "shardkit.etl.recipes:imagenet_val_npy", "--source", str(etl_src.root), "--port", "99999"]) == 2
    assert time.monotonic() - t0 < 30


def test_loader_and_etl_refuse_pickles(tmp_path):
    import pickle
    from shardkit import create_dataset
    from shardkit.etl.shard_transform import ShardTransform, ETLError
    marker = tmp_path / "pwned"
    (tmp_path / "p.tar").write_bytes(_tar(_sample_members("a", 1) + [("a.meta.pyd", "file", pickle.dumps(_Marker(marker)))]))
    with pytest.raises(Exception, match="allow_pickle=True"):
        list(create_dataset([str(tmp_path / "p.tar")], fields=("cls", "meta.pyd"), batch_size=None, shuffle=0, seed=0))
    with pytest.raises(Exception, match="pickle"):
        ShardTransform(lambda s: s, handler="strict")((tmp_path / "p.tar").read_bytes(), "p.tar")
    assert not marker.exists()


KILL_ETL = textwrap.dedent("""
    import os, signal, sys
    from shardkit import etl
    from shardkit.etl import local_engine
    real = local_engine.write_etl_manifest
    def save(store, settings, names, done, *, failed, engine="local"):
        m = real(store, settings, names, done, failed=failed, engine=engine)
        if len(done) == 2: os.kill(os.getpid(), signal.SIGKILL)
        return m
    local_engine.write_etl_manifest = save
    etl.run_etl("shardkit.etl.recipes:imagenet_val_npy", sys.argv[1], sys.argv[2], processes=1, progress=False)
""")


@pytest.mark.slow
def test_etl_run_killed_midway_resumes(tmp_path):
    from shardkit.etl.receipt import read_etl_manifest
    from shardkit.etl import run_etl
    src = open_store(tmp_path / "src", create=True)
    for s in range(4): src.put_bytes(_tar([m for i in range(3) for m in _imagenet_members(f"k{s}_{i}", s * 3 + i)]), f"in-{s}.tar")
    full = run_etl("shardkit.etl.recipes:imagenet_val_npy", src, tmp_path / "full", processes=1, progress=False)
    assert full["written"] == 4 and full["samples_out"] == 12 and read_etl_manifest(tmp_path / "full")["complete"]
    r = subprocess.run([sys.executable, "-c", KILL_ETL, str(tmp_path / "src"), str(tmp_path / "part")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    assert read_etl_manifest(tmp_path / "part")["complete"] is False
    r = subprocess.run([sys.executable, "-m", "shardkit.apps.cli", "ls", str(tmp_path / "part")], capture_output=True, text=True, timeout=120)
    assert "did not finish" in r.stderr
    again = run_etl("shardkit.etl.recipes:imagenet_val_npy", src, tmp_path / "part", processes=1, progress=False)
    assert (again["resumed"], again["written"]) == (2, 2)
    for n in src.list("*.tar"): assert (tmp_path / "part" / n).read_bytes() == (tmp_path / "full" / n).read_bytes()
    assert read_etl_manifest(tmp_path / "part")["complete"]
