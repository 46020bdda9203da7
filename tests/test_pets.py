"""Pet data set and its conversion: exact counts on a quirky synthetic set, byte-reproducible and resumable
shards, the CLI, the offline download, and conversion into a real AIStore bucket."""
import hashlib, io, json, os, subprocess, sys, tarfile, textwrap, time, uuid
from pathlib import Path
import pytest
import webdataset as wds
from PIL import Image
from shardkit.ingest import pets
from shardkit.apps.cli import main as cli_main
from shardkit.ingest.pets import (CLASS_NAMES, PET_QUIRKS, PetsError, convert_pets, download_pets, pet_records, pet_samples,
                           synthesize_pets)
from shardkit.shards.manifest import read_manifest
from shardkit.shards.write import write_shards
from shardkit.errors import StoreError
from shardkit.stores import open_store

N = 50  # listed images: enough for every quirk and a few shards, small enough to draw in seconds


@pytest.fixture(scope="module")
def quirky(tmp_path_factory):
    "A synthetic Pet folder with every planted defect, and the plan of what a converter must report."
    root = tmp_path_factory.mktemp("pets") / "quirky"
    plan = synthesize_pets(root, n=N, seed=3, quirks=True, processes=2)
    return root, plan


def shard_bytes(dest, m):
    store = open_store(dest)
    return {s["name"]: store.read_bytes(s["name"]) for s in m["shards"]}


def without_store(m): return {k: v for k, v in m.items() if k != "store"}


def expected_keys(plan, root, split="all"):
    bad = {plan["quirks"][q] for q, (action, _) in PET_QUIRKS.items() if action == "skip"}
    return [r[0] for r in pet_records(root, split) if r[0] not in bad]


def test_quirky_set_converts_with_exact_counts(quirky, tmp_path):
    root, plan = quirky
    m = convert_pets(root, tmp_path / "out", maxcount=16, progress=False)
    src = m["source"]
    assert src["listed"] == N and src["kept"] + sum(src["skipped"].values()) == src["listed"]
    for k in ("kept", "skipped", "converted", "unlisted", "ignored"): assert src[k] == plan[k], k
    assert src["skipped"] == {"empty image": 1, "missing image": 1, "missing trimap": 1, "truncated image": 1}
    assert src["converted"] == {"JPEG CMYK": 1, "JPEG L": 1, "PNG RGBA": 1}
    assert (src["unlisted"], src["ignored"]) == (2, 4)
    assert m["complete"] and m["samples"] == plan["kept"] == N - 4
    assert [s["samples"] for s in m["shards"]] == [16, 16, 14]
    # what is in the shards: exactly the expected keys, every image an RGB JPEG, classes 0-based
    got = list(wds.WebDataset(open_store(tmp_path / "out").urls([s["name"] for s in m["shards"]]), shardshuffle=False))
    assert [s["__key__"] for s in got] == expected_keys(plan, root)
    for s in got:
        img = Image.open(io.BytesIO(s["image.jpg"]))
        assert (img.format, img.mode) == ("JPEG", "RGB"), s["__key__"]
        assert CLASS_NAMES[int(s["cls"])] == s["__key__"].rsplit("_", 1)[0]
        assert Image.open(io.BytesIO(s["trimap.png"])).size == img.size
    assert sorted(k for k in got[0] if not k.startswith("__")) == ["cls", "image.jpg", "trimap.png"]
    # valid RGB JPEGs are stored byte for byte, not re-encoded
    k = got[0]["__key__"]
    assert got[0]["image.jpg"] == (root / "images" / f"{k}.jpg").read_bytes()
    # the manifest's per-shard facts are the stored objects' facts
    for s in m["shards"]:
        data = (tmp_path / "out" / s["name"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (s["bytes"], s["sha256"])
    assert read_manifest(tmp_path / "out", "pets-") == m


@pytest.mark.parametrize("split", ["trainval", "test"])
def test_splits_account_for_every_listed_record(quirky, split):
    root, plan = quirky
    stats = {}
    keys = [s["__key__"] for s in pet_samples(root, split, processes=1, stats=stats)]
    assert stats["listed"] == plan[split] == len(pet_records(root, split))
    assert stats["kept"] + sum(stats["skipped"].values()) == stats["listed"]
    assert keys == expected_keys(plan, root, split)


def test_extras_and_fast_check(quirky, tmp_path):
    root, plan = quirky
    m = convert_pets(root, tmp_path / "x", extras=True, check="fast", progress=False)
    assert m["source"]["skipped"] == plan["skipped"] and m["source"]["converted"] == plan["converted"]
    s = next(iter(wds.WebDataset(open_store(tmp_path / "x").urls(m["shards"][0]["name"]), shardshuffle=False).decode()))
    assert s["pet.json"]["class_id"] == s["cls"] + 1 and s["species.cls"] == s["pet.json"]["species"] - 1


def test_post_pipeline_and_tar_listing(quirky, tmp_path):
    root, plan = quirky
    m = convert_pets(root, tmp_path / "out", maxcount=20, progress=False)
    urls = open_store(tmp_path / "out").urls([s["name"] for s in m["shards"]])
    n = 0
    for cls, image, trimap in wds.WebDataset(urls, shardshuffle=False).decode("torchrgb").to_tuple("cls", "image.jpg", "trimap.png"):
        assert 0 <= cls < 37 and image.shape[0] == 3 and image.shape[1:] == trimap.shape[1:]
        n += 1
    assert n == plan["kept"]
    listing = subprocess.run(["tar", "-tvf", urls[0]], capture_output=True, text=True, check=True).stdout.splitlines()
    names = [line.split()[-1] for line in listing]
    keys = [nm.split(".", 1)[0] for nm in names]
    assert len(names) == 3 * 20
    assert all(keys[i] == keys[i + 1] == keys[i + 2] for i in range(0, len(keys), 3)), "members not grouped per sample"
    assert names[:3] == [f"{keys[0]}.cls", f"{keys[0]}.image.jpg", f"{keys[0]}.trimap.png"]
    assert all(" 1970-01-01 00:00 " in line and line.startswith("-r--r--r--") for line in listing)


def test_bytes_are_deterministic(quirky, tmp_path):
    root, _ = quirky
    a = convert_pets(root, tmp_path / "a", maxcount=16, processes=2, progress=False)
    b = convert_pets(root, tmp_path / "b", maxcount=16, processes=1, progress=False)
    assert without_store(a) == without_store(b)
    assert shard_bytes(tmp_path / "a", a) == shard_bytes(tmp_path / "b", b)
    assert (tmp_path / "a/pets-manifest.json").read_text().replace(str(tmp_path / "a"), "") == \
           (tmp_path / "b/pets-manifest.json").read_text().replace(str(tmp_path / "b"), "")


def test_resume_after_exception_is_exact(quirky, tmp_path, monkeypatch):
    root, _ = quirky
    full = convert_pets(root, tmp_path / "full", maxcount=10, progress=False)
    real = pets.pet_samples

    def dies_after(n):
        def gen(*a, **k):
            for i, s in enumerate(real(*a, **k)):
                if i == n: raise KeyboardInterrupt("killed")
                yield s
        return gen
    monkeypatch.setattr(pets, "pet_samples", dies_after(23))
    with pytest.raises(KeyboardInterrupt): convert_pets(root, tmp_path / "part", maxcount=10, progress=False)
    part = read_manifest(tmp_path / "part", "pets-")
    assert not part["complete"] and [s["samples"] for s in part["shards"]] == [10, 10]
    assert not list(Path(tmp_path / "part").glob("pets-00002.tar"))  # the unfinished shard never reached the store
    monkeypatch.setattr(pets, "pet_samples", real)
    resumed = convert_pets(root, tmp_path / "part", maxcount=10, progress=False)
    assert without_store(resumed) == without_store(full)
    assert shard_bytes(tmp_path / "part", resumed) == shard_bytes(tmp_path / "full", full)


KILLER = textwrap.dedent("""
    import os, signal, sys
    import shardkit.ingest.pets as p, shardkit.shards.write as sh
    from shardkit.stores import LocalStore
    point, after = sys.argv[1], int(sys.argv[2])
    real_save, real_put = sh.save_manifest, LocalStore.put_file
    done = []
    def save(store, m):
        real_save(store, m)
        if point == "after_manifest" and len(m["shards"]) == after: os.kill(os.getpid(), signal.SIGKILL)
    def put(self, src, name=None):
        r = real_put(self, src, name)
        done.append(name)
        if point == "before_manifest" and len(done) == after: os.kill(os.getpid(), signal.SIGKILL)
        return r
    sh.save_manifest, LocalStore.put_file = save, put
    p.convert_pets(sys.argv[3], sys.argv[4], maxcount=8, processes=2, progress=False)
""")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_manifest", "before_manifest"])
def test_resume_after_sigkill(quirky, tmp_path, point):
    "A conversion killed outright (SIGKILL) after its second shard resumes into the same bytes."
    root, _ = quirky
    full = convert_pets(root, tmp_path / "full", maxcount=8, progress=False)
    r = subprocess.run([sys.executable, "-c", KILLER, point, "2", str(root), str(tmp_path / "part")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == -9, r.stderr
    part = read_manifest(tmp_path / "part", "pets-")
    assert not part["complete"]
    # killed after storing shard 2: recorded (after_manifest) or stored but not yet recorded (before_manifest)
    assert len(part["shards"]) == (2 if point == "after_manifest" else 1)
    resumed = convert_pets(root, tmp_path / "part", maxcount=8, progress=False)
    assert without_store(resumed) == without_store(full)
    assert shard_bytes(tmp_path / "part", resumed) == shard_bytes(tmp_path / "full", full)
    assert sorted(open_store(tmp_path / "part").list()) == sorted(open_store(tmp_path / "full").list())


def test_rerun_is_a_noop_and_other_settings_are_refused(quirky, tmp_path, capsys):
    root, _ = quirky
    m = convert_pets(root, tmp_path / "out", maxcount=16, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    capsys.readouterr()
    assert convert_pets(root, tmp_path / "out", maxcount=16) == m
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == stamps
    with pytest.raises(StoreError, match="other settings"): convert_pets(root, tmp_path / "out", maxcount=17, progress=False)
    with pytest.raises(StoreError, match="other settings"): convert_pets(root, tmp_path / "out", maxcount=16, split="test", progress=False)
    # a missing shard in a complete conversion is rewritten, not ignored
    (tmp_path / "out" / m["shards"][-1]["name"]).unlink()
    again = convert_pets(root, tmp_path / "out", maxcount=16, progress=False)
    assert without_store(again) == without_store(m) and (tmp_path / "out" / m["shards"][-1]["name"]).exists()


def test_resume_refuses_changed_input(tmp_path):
    samples = [{"__key__": f"k{i:02d}", "txt": str(i)} for i in range(10)]
    def dies(xs):
        for i, s in enumerate(xs):
            if i == 7: raise RuntimeError("stop")
            yield s
    with pytest.raises(RuntimeError): write_shards(dies(samples), tmp_path, prefix="t-", maxcount=3, progress=False)
    changed = [{"__key__": f"j{i:02d}", "txt": str(i)} for i in range(10)]
    with pytest.raises(StoreError, match="input changed"): write_shards(changed, tmp_path, prefix="t-", maxcount=3, progress=False)
    with pytest.raises(StoreError, match="fewer samples"): write_shards(samples[:4], tmp_path, prefix="t-", maxcount=3, progress=False)


def test_maxsize_is_an_upper_bound(quirky, tmp_path):
    root, plan = quirky
    m = convert_pets(root, tmp_path / "out", maxcount=1000, maxsize=300_000, progress=False)
    assert len(m["shards"]) > 3 and m["samples"] == plan["kept"]
    assert all(s["bytes"] <= 300_000 for s in m["shards"]), [s["bytes"] for s in m["shards"]]
    assert all((tmp_path / "out" / s["name"]).stat().st_size == s["bytes"] for s in m["shards"])


def test_cli_help(capsys):
    for cmd, opts in [(["convert", "pets"], ["--split", "--maxcount", "--maxsize", "--processes", "--prefix", "--check", "--extras"]),
                      (["synth", "pets"], ["--n", "--seed", "--quirks", "--processes"]),
                      (["download", "pets"], ["root"]),
                      (["bench", "convert"], ["--processes", "--repeat", "--check"])]:
        with pytest.raises(SystemExit) as e: cli_main(cmd + ["--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert all(o in out for o in opts), (cmd, out)


@pytest.mark.slow
def test_cli_synth_and_convert(tmp_path, cli, capsys):
    assert cli_main(["synth", "pets", str(tmp_path / "p"), "--n", "16", "--quirks", "--seed", "5", "--processes", "2"]) == 0
    assert "planted quirks: grayscale, cmyk" in capsys.readouterr().out
    plan = json.loads((tmp_path / "p/synth.json").read_text())
    # the conversion as a user runs it: a separate process
    r = cli("convert", "pets", tmp_path / "p", tmp_path / "s", "--maxcount", "5", "--maxsize", "200KB", "--processes", "2")
    assert r.returncode == 0, r.stderr
    assert f"{plan['kept']} samples in" in r.stdout and "skipped 4: empty image 1" in r.stdout
    assert "\r" not in r.stderr, r.stderr  # its output goes to a pipe: no progress bar drawn into it
    m = read_manifest(tmp_path / "s", "pets-")
    assert m["complete"] and m["samples"] == plan["kept"] and all(s["bytes"] <= 200_000 and s["samples"] <= 5 for s in m["shards"])


def test_cli_bad_input(quirky, tmp_path, capsys):
    root, _ = quirky
    cases = [(["convert", "pets", str(root), str(tmp_path), "--split", "val"], "unknown split 'val'; use one of all, trainval, test"),
             (["convert", "pets", str(root), str(tmp_path), "--maxsize", "lots"], "cannot read size 'lots'"),
             (["convert", "pets", str(root), str(tmp_path), "--maxsize", "1k"], "maxsize must be >= 10240 bytes"),
             (["convert", "pets", str(root), str(tmp_path), "--maxcount", "0"], "maxcount must be >= 1, got 0"),
             (["convert", "pets", str(root), str(tmp_path), "--check", "quick"], "check must be one of decode, fast, got 'quick'"),
             (["convert", "pets", str(tmp_path / "nope"), str(tmp_path)], "is not an Oxford-IIIT Pet folder"),
             (["synth", "pets", str(tmp_path / "q"), "--n", "5", "--quirks"], "quirks=True needs n >= 14 images"),
             (["bench", "convert", str(tmp_path / "nope")], "is not an Oxford-IIIT Pet folder"),
             (["synth", "pets", str(root), "--n", "20"], "already holds a data set (n=50, seed=3)")]
    for argv, msg in cases:
        assert cli_main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
    # a destination that holds another conversion: one line saying so, exit 1 as for data in the way (a StoreError)
    assert cli_main(["convert", "pets", str(root), str(tmp_path / "d"), "--maxcount", "30"]) == 0
    assert cli_main(["convert", "pets", str(root), str(tmp_path / "d"), "--maxcount", "31"]) == 1
    assert "other settings" in capsys.readouterr().err


@pytest.mark.timed
def test_download_fails_fast_offline(tmp_path, capsys):
    if pets.reachable("www.robots.ox.ac.uk", timeout=2):
        pytest.skip("this machine reaches www.robots.ox.ac.uk; the offline path cannot be tested here")
    t0 = time.monotonic()
    with pytest.raises(PetsError) as e: download_pets(tmp_path / "real")
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    for part in ("cannot reach www.robots.ox.ac.uk", "images.tar.gz", "annotations.tar.gz", "by hand",
                 str(tmp_path / "real" / "images"), str(tmp_path / "real" / "annotations"), "shardkit synth pets"):
        assert part in msg, part
    t0 = time.monotonic()
    assert cli_main(["download", "pets", str(tmp_path / "real")]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "by hand" in err


def test_download_uses_archives_put_there_by_hand(tmp_path, monkeypatch):
    "Archives already in ROOT with the right MD5 are extracted without touching the network."
    import hashlib as h
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True); (src / "annotations").mkdir()
    (src / "images" / "Abyssinian_1.jpg").write_bytes(b"jpeg")
    (src / "annotations" / "list.txt").write_text("#header\nAbyssinian_1 1 1 1\n")
    root = tmp_path / "root"; root.mkdir()
    archives = []
    for part in ("images", "annotations"):
        with tarfile.open(root / f"{part}.tar.gz", "w:gz") as t: t.add(src / part, arcname=part)
        archives.append((f"https://example.invalid/data/{part}.tar.gz", h.md5((root / f"{part}.tar.gz").read_bytes()).hexdigest()))
    monkeypatch.setattr(pets, "PETS_ARCHIVES", tuple(archives))
    monkeypatch.setattr(pets, "reachable", lambda *a, **k: pytest.fail("the network was consulted"))
    assert download_pets(root) == root
    assert (root / "images" / "Abyssinian_1.jpg").read_bytes() == b"jpeg" and pet_records(root) == [("Abyssinian_1", 1, 1, 1)]


def test_convert_into_aistore(quirky, tmp_path, ais_endpoint):
    root, plan = quirky
    bucket = f"ais://pets-test-{uuid.uuid4().hex[:8]}"
    local = convert_pets(root, tmp_path / "local", maxcount=16, progress=False)
    m = convert_pets(root, bucket, maxcount=16, progress=False)
    assert m["store"] == bucket and m["complete"] and m["samples"] == plan["kept"]
    store = open_store(bucket)
    assert store.list() == [s["name"] for s in m["shards"]] + ["pets-manifest.json"]
    # the same bytes as the local conversion, and readable over HTTP with plain webdataset
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in local["shards"]]
    keys = [s["__key__"] for s in wds.WebDataset(store.urls([s["name"] for s in m["shards"]]), shardshuffle=False)]
    assert keys == expected_keys(plan, root)
    assert read_manifest(bucket, "pets-") == m
    assert convert_pets(root, bucket, maxcount=16, progress=False) == m  # no-op
    for name in store.list(): store.delete(name)
