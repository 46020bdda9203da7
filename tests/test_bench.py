"""Benchmarks: the loader benchmark end to end through the command line, and one peer row where that peer is
installed (the converter's and the ETL's benchmarks run in their notebook, the ETL's flagged slow)."""
import importlib.util
import numpy as np
import pytest
import webdataset as wds
from shardkit.synth import draw_animal, jpeg_bytes, png_bytes

BASE_ROWS = ("shardkit default", "shardkit default, whole-image decode", "shardkit random access", "AIStore post's pipeline", "webdataset, done well",
             "torchvision ImageFolder (same decoder)", "ceiling: decode+augment")
PEERS = {"LitData": "litdata", "MosaicML Streaming": "streaming", "DALI (CPU)": "nvidia.dali", "FFCV": "ffcv"}


def importable(module: str) -> bool:
    try: return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError): return False


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    "3 small Pet-like shards of 5 samples (image, class, trimap)."
    folder, rng, paths = tmp_path_factory.mktemp("bench") / "shards", np.random.default_rng(0), []
    folder.mkdir()
    for s in range(3):
        paths.append(str(folder / f"pets-{s:05d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for i in range(5):
                cls = int(rng.integers(0, 37))
                img, tri = draw_animal(cls, rng, size=(64, 48))
                w.write({"__key__": f"s{s}_{i}", "image.jpg": jpeg_bytes(img), "cls": cls, "trimap.png": png_bytes(tri)})
    return paths


def row_of(stdout: str, label: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(label))


def test_bench_loader_cli(shards, cli, tmp_path):
    r = cli("bench", "loader", "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--workers", "--repeats", "--samples", "--peers", "--cold", "--max-shards", "--cache", "--out", "shardkit[peers]"):
        assert opt in r.stdout, (opt, r.stdout)
    r = cli("bench", "loader", tmp_path / "nowhere")
    assert r.returncode == 2 and "nowhere" in r.stderr
    png = tmp_path / "bench.png"
    # --peers on this interpreter: a peer that is not installed is a row saying so, and the command still succeeds
    r = cli("bench", "loader", str(shards[0]).replace("00000", "{00000..00002}"), "--workers", "1", "--samples", "40",
            "--repeats", "1", "--peers", "--cache", tmp_path / "cache", "--out", png, timeout=400)
    assert r.returncode == 0, r.stderr
    for row in BASE_ROWS + ("goal: default >=", "goal: default CPU/sample", "goal: default first batch", "page cache warm"):
        assert row in r.stdout, (row, r.stdout)
    for row in ("shardkit default", "shardkit default, whole-image decode", "shardkit random access", "webdataset, done well", "torchvision ImageFolder (same decoder)"):
        assert row_of(r.stdout, row).rstrip().endswith("yes"), (row, r.stdout)
    for label, module in PEERS.items():
        if not importable(module): assert row_of(r.stdout, label).rstrip().endswith("not installed"), (label, r.stdout)
    if not all(importable(m) for m in PEERS.values()): assert 'pip install "shardkit[peers]"' in r.stdout
    assert "decodes only the window of each JPEG" in r.stdout, r.stdout  # the README installs gcc and libjpeg-dev
    assert png.stat().st_size > 10_000


@pytest.mark.skipif(not importable("litdata"), reason="litdata is not installed (pip install \"shardkit[peers]\")")
def test_bench_loader_litdata_row(shards, tmp_path):
    from shardkit.bench import LOADER_ROWS, bench_loader, loader_table
    res = bench_loader(shards, num_workers=1, samples=30, repeats=1, peers=True, only=("default", "litdata"),
                       cache=tmp_path / "cache", progress=False, ceiling_seconds=0.5)
    row = res["rows"][LOADER_ROWS["litdata"]]
    assert row["status"] == "ok" and row["exact"], loader_table(res)
    assert row["rate"] > 0 and row["cpu_ms"] > 0
    assert any((tmp_path / "cache").glob("*/litdata-x2"))  # converted once into the cache, for the next run
