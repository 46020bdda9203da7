"""Benchmarks: the loader benchmark end to end through the command line (the converter's and the ETL's run in
their notebooks, the ETL's flagged slow)."""
import numpy as np
import pytest
import webdataset as wds
from shardkit.synth import draw_animal, jpeg_bytes, png_bytes


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


def test_bench_loader_cli(shards, cli, tmp_path):
    r = cli("bench", "loader", "--help")
    assert r.returncode == 0 and "--workers" in r.stdout and "--cold" in r.stdout
    r = cli("bench", "loader", tmp_path / "nowhere")
    assert r.returncode == 2 and "nowhere" in r.stderr
    png = tmp_path / "bench.png"
    r = cli("bench", "loader", str(shards[0]).replace("00000", "{00000..00002}"), "--workers", "1", "--cold", "--samples", "40", "--out", png, timeout=120)
    assert r.returncode == 0, r.stderr
    for row in ("AIStore post", "shardkit default", "map-style ImageFolder", "decode+augment ceiling", "goal: default >= 2.0x seed"):
        assert row in r.stdout, (row, r.stdout)
    assert "page cache" in r.stdout
    assert png.stat().st_size > 10_000
