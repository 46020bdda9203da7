"""The display utilities and `shardkit ls` / `shardkit show`: listings that agree with tar and manifests,
figures titled with key and class name, loader batches of every shape, and clear errors."""
import io, json, subprocess, tarfile, uuid
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from shardkit.display import (class_name, display_loader_images, display_shard_images, shard_listing, show_image_tensor,
                              to_hwc, trimap_overlay, view_data)
from shardkit.ingest.pets import CLASS_NAMES
from shardkit.stores import shown_path
from shardkit.shards.fields import IMAGENET_MEAN, IMAGENET_STD
from shardkit.shards.tar import count_samples, list_shards, read_samples
from shardkit.shards.write import write_shards
from shardkit.errors import StoreError, UsageError
from shardkit.stores import open_store
from conftest import main_cli
from shardkit.ingest.synth import draw_animal, jpeg_bytes, png_bytes


def iter_samples(f):
    "(key, {field: bytes}) for each sample of tar stream `f`."
    for s in read_samples(f):
        yield s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}


def _samples(n=10, seed=0, start=0):
    rng = np.random.default_rng(seed)
    for j in range(start, start + n):
        cls = j * 5 % 37
        img, tri = draw_animal(cls, rng, size=(120, 90))
        yield {"__key__": f"img{j:03d}", "image.jpg": jpeg_bytes(img), "cls": cls, "trimap.png": png_bytes(tri)}


def _plain_shards(store, n_shards=2, per=6):
    for s in range(n_shards):
        buf = io.BytesIO()
        with wds.TarWriter(buf, mtime=1_700_000_000) as w:
            for smp in _samples(per, seed=s, start=s * per): w.write({**smp, "cls": str(smp["cls"])})
        store.put_bytes(buf.getvalue(), f"part-{s:03d}.tar")
    return store


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_listing_agrees_with_tar(tmp_path):
    store = _plain_shards(open_store(tmp_path / "s", create=True))
    ours = shard_listing(store, "part-000.tar", limit=None).splitlines()
    theirs = subprocess.run(["tar", "-tvf", str(store.path("part-000.tar"))], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(ours) == len(theirs) == 18
    for a, b in zip(ours, theirs):
        a, b = a.split(), b.split()
        assert (a[0], a[2], a[-1]) == (b[0], b[2], b[-1])  # mode, size, name
    assert [l.split()[-1] for l in ours[:3]] == ["img000.cls", "img000.image.jpg", "img000.trimap.png"]
    short = shard_listing(store, "part-000.tar", limit=4).splitlines()
    assert len(short) == 5 and short[-1] == "... 14 more members (18 in all)"


@pytest.mark.slow
def test_ls_counts_and_uses_manifests(tmp_path, cli):
    store = _plain_shards(open_store(tmp_path / "s", create=True))
    r = cli("ls", tmp_path / "s")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("total: 2 shards, 12 samples,")
    assert "part-001.tar" in r.stdout
    # a conversion's manifest is used for its shards, and only while their sizes match
    m = write_shards(_samples(7), tmp_path / "conv", prefix="pets-", maxcount=3, progress=False)
    rows = list_shards(tmp_path / "conv")
    assert [(x["name"], x["samples"], x["source"]) for x in rows] == [(f"pets-{i:05d}.tar", n, "manifest") for i, n in enumerate((3, 3, 1))]
    assert [x["bytes"] for x in rows] == [s["bytes"] for s in m["shards"]]
    conv = open_store(tmp_path / "conv")
    conv.put_bytes(conv.read_bytes("pets-00000.tar") + b"\0" * 10240, "pets-00000.tar")  # changed after conversion
    assert [(x["samples"], x["source"]) for x in list_shards(conv)][0] == (3, "counted")
    r = main_cli("ls", tmp_path / "conv", "--pattern", "pets-0000{1,2}.tar")
    assert r.returncode == 0 and "total: 2 shards, 4 samples" in r.stdout


def test_ls_errors(tmp_path):
    r = main_cli("ls", tmp_path / "missing")
    assert r.returncode == 1 and "does not exist; check the path" in r.stderr  # a data error: 1
    (tmp_path / "empty").mkdir()
    r = main_cli("ls", tmp_path / "empty")
    assert r.returncode == 1 and "no shards matching '*.tar'" in r.stderr


def test_count_samples_groups_like_webdataset(tmp_path):
    store = _plain_shards(open_store(tmp_path / "s", create=True), 1, 5)
    assert count_samples(store, "part-000.tar") == 5 == len(list(wds.WebDataset(store.urls("part-000.tar"), shardshuffle=False)))


@pytest.mark.slow
def test_show_cli_writes_a_readable_png(tmp_path, cli, out_dir):
    store = _plain_shards(open_store(tmp_path / "s", create=True))
    out = out_dir / "show_part-001.png"
    r = cli("show", store.path("part-001.tar"), "--out", out, "--objects", "3", "--listing")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "img006.image.jpg" in r.stdout and f"wrote {shown_path(out)}" in r.stdout  # the CLI runs in this working directory
    im = Image.open(out)
    assert im.format == "PNG" and 500 < im.width < 1200 and im.height < 500  # small enough for a docs page
    assert np.asarray(im.convert("L")).std() > 10  # not a blank canvas


def test_show_cli_errors(tmp_path):
    r = main_cli("show", tmp_path / "nope.tar", "--out", tmp_path / "x.png")
    assert r.returncode == 1 and "no shard file" in r.stderr
    (tmp_path / "junk.tar").write_text("not a tar at all")
    r = main_cli("show", tmp_path / "junk.tar", "--out", tmp_path / "x.png")
    assert r.returncode == 1 and "junk.tar" in r.stderr and "not a readable tar" in r.stderr
    assert not (tmp_path / "x.png").exists()
    r = main_cli("show", "ais://", "--out", tmp_path / "x.png")
    assert r.returncode == 1 and "names no object" in r.stderr  # a StoreError: 1


def test_shard_figure_titles_and_overlay(tmp_path):
    store = _plain_shards(open_store(tmp_path / "s", create=True))
    fig = display_shard_images(store, "part-000.tar", objects=4, class_names=CLASS_NAMES)
    assert [a.get_title() for a in fig.axes] == [f"img{j:03d} · {CLASS_NAMES[j * 5 % 37]}" for j in range(4)]
    plain = display_shard_images(store, "part-000.tar", objects=2)  # no names given, none in a manifest: the class number
    assert [a.get_title() for a in plain.axes] == ["img000 · 0", "img001 · 5"]
    # the picture drawn is the photo with its trimap: background dimmed, outline yellow
    key, files = next(iter_samples(store.open("part-000.tar")))
    img = np.asarray(Image.open(io.BytesIO(files["image.jpg"])).convert("RGB"))
    tri = np.asarray(Image.open(io.BytesIO(files["trimap.png"])))
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), trimap_overlay(img, tri))
    assert display_shard_images(store, "part-000.tar", objects=50).axes.__len__() == 6
    custom = display_shard_images(store, "part-000.tar", objects=1, class_names=[f"c{i}" for i in range(37)])
    assert custom.axes[0].get_title() == "img000 · c0"


def test_pet_json_name_wins(tmp_path):
    store = open_store(tmp_path / "s", create=True)
    smp = next(_samples(1))
    buf = io.BytesIO()
    with wds.TarWriter(buf) as w: w.write({**smp, "cls": "0", "pet.json": json.dumps({"name": "Real_Breed"})})
    store.put_bytes(buf.getvalue(), "x.tar")
    assert display_shard_images(store, "x.tar").axes[0].get_title() == "img000 · Real_Breed"


def test_image_tensors():
    img, _ = draw_animal(3, np.random.default_rng(0), size=(64, 48))
    ref = np.asarray(img) / 255
    u8 = torch.from_numpy(np.array(img)).permute(2, 0, 1)
    norm = (u8.float() / 255 - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    np.testing.assert_allclose(to_hwc(u8), ref)
    np.testing.assert_allclose(to_hwc(norm, denormalize=True), ref, atol=1e-5)
    assert np.abs(to_hwc(norm) - ref).max() > 0.2  # without denormalising it is a different picture
    np.testing.assert_allclose(to_hwc(u8[:1]), np.repeat(ref[..., :1], 3, -1))  # one channel: grey
    ax = show_image_tensor(norm, denormalize=True, title="t")
    np.testing.assert_allclose(ax.images[0].get_array(), ref, atol=1e-5)
    with pytest.raises(UsageError, match=r"1 or 3 channels, got shape \(2, 4, 4\)"): to_hwc(torch.zeros(2, 4, 4))


def _batch(n=4, size=64):
    rng = np.random.default_rng(1)
    pics = [draw_animal(c, rng, size=(size, size)) for c in range(n)]
    ims = torch.stack([torch.from_numpy(np.array(p[0])).permute(2, 0, 1) for p in pics])
    tris = torch.stack([torch.from_numpy(p[1]) for p in pics])
    return torch.arange(n) * 9, ims, tris


@pytest.mark.parametrize("form", ["tuple", "images_first", "torchrgb", "normalised_dict", "list_of_batches"])
def test_loader_batches(form, capsys):
    cls, ims, tris = _batch()
    norm = (ims.float() / 255 - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    loader = {"tuple": lambda: [(cls, ims, tris)],
              "images_first": lambda: iter([[ims, cls]]),
              "torchrgb": lambda: [(cls, ims.float() / 255, tris[:, None].repeat(1, 3, 1, 1).float() / 255)],
              "normalised_dict": lambda: [{"__key__": [f"k{i}" for i in range(4)], "cls": cls, "image.jpg": norm}],
              "list_of_batches": lambda: [(cls, ims, tris), (cls, ims, tris)]}[form]()
    fig = view_data(loader, objects=3, class_names=CLASS_NAMES)
    printed = capsys.readouterr().out
    assert "(4, 3, 64, 64)" in printed
    names = [CLASS_NAMES[int(c)] for c in cls[:3]]
    titles = [a.get_title() for a in fig.axes[:3]]
    assert titles == ([f"k{i} · {n}" for i, n in enumerate(names)] if form == "normalised_dict" else names)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), ims[0].permute(1, 2, 0).numpy() / 255, atol=1e-5)
    has_trimaps = form in ("tuple", "torchrgb", "list_of_batches")
    assert len(fig.axes) == (6 if has_trimaps else 3)
    if has_trimaps:  # the trimap drawn over its own picture
        np.testing.assert_allclose(fig.axes[3].images[0].get_array(),
                                   trimap_overlay(ims[0].permute(1, 2, 0).numpy(), tris[0].numpy()), atol=1e-6)


def test_loader_trimaps_of_another_size_and_errors():
    cls, ims, tris = _batch()
    fig = display_loader_images([(cls, ims, tris[:, :32, :32])], objects=2)
    assert fig.axes[2].get_title() == "trimap 32x32"
    with pytest.raises(UsageError, match="no image tensor"): display_loader_images([(cls,)])


def test_class_names():
    assert len(CLASS_NAMES) == 37 and class_name(0, CLASS_NAMES) == CLASS_NAMES[0] and class_name(b"36\n", CLASS_NAMES) == CLASS_NAMES[36]
    assert class_name(0) == "0"  # display knows no data set: names are passed in
    assert class_name(torch.tensor(2), ["a", "b", "c"]) == "c" and class_name(40) == "40" and class_name("x") == "x"


def test_ais_views(ais_endpoint, tmp_path, cli, out_dir):
    local = _plain_shards(open_store(tmp_path / "s", create=True))
    bucket = f"disp-{uuid.uuid4().hex[:8]}"
    ais = open_store(f"ais://{bucket}/sub", create=True)
    for n in local.list(): ais.put_file(local.path(n), n)
    assert shard_listing(ais, "part-000.tar", None) == shard_listing(local, "part-000.tar", None)
    r = cli("ls", ais.spec)
    assert r.returncode == 0 and "total: 2 shards, 12 samples" in r.stdout, r.stdout + r.stderr
    out = out_dir / "show_ais.png"
    r = cli("show", f"ais://{bucket}/sub/part-001.tar", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert Image.open(out).format == "PNG"
    r = cli("show", f"ais://{bucket}/sub/nope.tar", "--out", out)
    assert r.returncode == 1 and "no object 'nope.tar'" in r.stderr
