"Command line and bad input of `shardkit synth folder` / `shardkit convert folder`."
import subprocess, sys, tarfile
from pathlib import Path
import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from torchvision.datasets import ImageFolder
from shardkit.apps.cli import main


def shardkit(*args, check=True):
    r = subprocess.run([sys.executable, "-c", "import sys; from shardkit.apps.cli import main; sys.exit(main())", *map(str, args)], capture_output=True, text=True, timeout=120)
    if check: assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder") / "tree"
    r = shardkit("synth", "folder", root, "--classes", 3, "--per-class", 4, "--val-per-class", 2)
    assert "3 classes" in r.stdout
    return root


def test_synth_folder_layout(tree):
    for split, n in (("train", 12), ("val", 6)):
        ds = ImageFolder(tree / split)
        assert len(ds) == n and len(ds.classes) == 3
        assert ds.classes == sorted(ds.classes)


@pytest.mark.slow
def test_convert_folder_cli_matches_imagefolder(tree, tmp_path):
    r = shardkit("convert", "folder", tree / "train", tmp_path, "--prefix", "imagenet-train-", "--maxcount", 5)
    assert "12 samples in 3 shards" in r.stdout and "3 classes, numbered as ImageFolder does" in r.stdout, r.stdout
    names = sorted(p.name for p in tmp_path.glob("*.tar"))
    assert names == [f"imagenet-train-{i:06d}.tar" for i in range(3)]
    with tarfile.open(tmp_path / names[0]) as t:
        exts = [m.split(".", 1)[1] for m in t.getnames()]
    assert exts == ["cls", "jpg"] * 5
    ds = ImageFolder(tree / "train")
    seen = 0
    for key, img, cls in wds.WebDataset([str(tmp_path / n) for n in names], shardshuffle=False).decode("pil").to_tuple("__key__", "jpg", "cls"):
        path, label = ds.samples[int(key)]
        assert cls == label == ds.class_to_idx[Path(path).parent.name]
        assert np.array_equal(np.asarray(img), np.asarray(Image.open(path).convert("RGB")))
        seen += 1
    assert seen == 12


def test_convert_folder_maxsize_in_bytes(tree, tmp_path):
    assert main(["convert", "folder", str(tree / "val"), str(tmp_path), "--prefix", "imagenet-val-", "--maxsize", "10240"]) == 0
    # every sample is bigger than 10240 bytes (one tar record, the smallest limit): one sample per shard
    assert len(list(tmp_path.glob("imagenet-val-*.tar"))) == 6
    assert main(["convert", "folder", str(tree / "val"), str(tmp_path / "units"), "--maxsize", "1GB", "--maxcount", "100"]) == 0
    assert len(list((tmp_path / "units").glob("*.tar"))) == 1


def test_convert_folder_no_shuffle_keeps_imagefolder_order(tree, tmp_path):
    assert main(["convert", "folder", str(tree / "val"), str(tmp_path), "--prefix", "v-", "--no-shuffle-files", "--maxcount", "100"]) == 0
    keys = [s["__key__"] for s in wds.WebDataset(str(tmp_path / "v-000000.tar"), shardshuffle=False)]
    assert keys == [f"{i:07d}" for i in range(6)]


def test_convert_folder_bad_input(tmp_path, capsys):
    assert main(["convert", "folder", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1  # a data error
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "flat").mkdir(); (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    assert main(["convert", "folder", str(tmp_path / "flat"), str(tmp_path / "out")]) == 1
    assert "class subfolders" in capsys.readouterr().err
    assert main(["convert", "folder", str(tmp_path / "flat"), str(tmp_path / "out"), "--maxcount", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert main(["convert", "folder", str(tmp_path / "flat"), str(tmp_path / "out"), "--maxsize", "huge"]) == 2
    assert "cannot read size 'huge'" in capsys.readouterr().err


def test_convert_folder_skips_and_counts_junk(tree, tmp_path, capsys):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(tree / "val", src)
    cls0 = sorted(p.name for p in src.iterdir())[0]
    (src / cls0 / "broken.jpg").write_bytes(b"\x00" * 10)
    assert main(["convert", "folder", str(src), str(tmp_path / "out"), "--prefix", "v-"]) == 0
    out = capsys.readouterr().out
    assert "6 samples" in out and "skipped: 1 unreadable image" in out, out
