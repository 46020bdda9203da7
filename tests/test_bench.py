"""Benchmarks: the loader benchmark's command line, and one peer row where that peer is installed. The full runs
(every loader row, the converter's and the ETL's benchmarks) are nbs/35_bench.loader's, flagged slow."""
import importlib.util
import numpy as np
import pytest
import webdataset as wds
from shardkit.ingest.synth import draw_animal, jpeg_bytes, png_bytes
from conftest import main_cli


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


def test_bench_loader_cli_reads_well_and_refuses_bad_input(tmp_path):
    "The command line around `bench_loader_cli`; a full run of it (every row, --peers, the chart) is nbs/35_bench.loader's."
    r = main_cli("bench", "loader", "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--workers", "--repeats", "--samples", "--peers", "--cold", "--max-shards", "--cache", "--plot", "--json", "shardkit[peers]"):
        assert opt in r.stdout, (opt, r.stdout)
    r = main_cli("bench", "loader", tmp_path / "nowhere")
    assert r.returncode == 1 and "no file or directory" in r.stderr and "nowhere" in r.stderr
    r = main_cli("bench", "loader", tmp_path, "--repeats", "0")
    assert r.returncode == 2 and "repeats must be >= 1" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not importable("litdata"), reason="litdata is in the peers extra, not in dev: to run this row, "
                    "pip install -e \".[dev,peers]\" then python -m pytest tests/test_bench.py -k litdata")
def test_bench_loader_litdata_row(shards, tmp_path):
    from shardkit.bench.peers import LOADER_ROWS
    from shardkit.bench.loader import bench_loader, loader_table
    res = bench_loader(shards, num_workers=1, samples=30, repeats=1, peers=True, only=("default", "litdata"),
                       cache=tmp_path / "cache", progress=False, ceiling_seconds=0.5)
    row = res["rows"][LOADER_ROWS["litdata"]]
    assert row["status"] == "ok" and row["exact"], loader_table(res)
    assert row["rate"] > 0 and row["cpu_ms"] > 0
    assert any((tmp_path / "cache").glob("*/litdata-x2"))  # converted once into the cache, for the next run


@pytest.mark.slow
def test_bench_scale_cli_on_aistore(tmp_path, ais_endpoint):
    "`shardkit bench scale` at two tiny sizes, every stage (local and AIStore): rows in the JSON, the picture, the ratio note."
    from shardkit.bench.scale import AIS_STAGES, LOCAL_STAGES
    stages = ",".join(LOCAL_STAGES + AIS_STAGES)
    r = main_cli("bench", "scale", tmp_path / "work", "--n", "150,300", "--stages", stages, "--decoded", "64",
                 "--json", tmp_path / "rows.json", "--plot", tmp_path / "scale.png")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    rows = __import__("json").loads((tmp_path / "rows.json").read_text())
    assert [(r["n"], r["stage"]) for r in rows] == [(n, s) for n in (150, 300) for s in stages.split(",")]
    assert not [r for r in rows if "error" in r]
    by = {(r["n"], r["stage"]): r for r in rows}
    assert [by[300, s]["samples"] for s in LOCAL_STAGES[:6]] == [300] * 6
    assert all(64 <= by[300, s]["samples"] <= 256 for s in LOCAL_STAGES[6:])  # the decoded epochs: a bounded subset, whole batches
    assert by[300, "verify"]["read_mb"] > by[300, "convert"]["written_mb"] / 2 > 300 * 2000 / 2e6  # every shard read back
    assert by[300, "index"]["index_b_per_sample"] <= 32
    assert all(r["cluster_cpu_ms"] > 0 for r in rows if r["stage"] in ("ais getbatch", "ais getbatch+index"))  # ~1 ms a member
    # streaming costs the cluster far less per sample than GetBatch (0.004 vs ~1-3 ms in the facts); a stream of 300
    # samples may take under the clock's 10 ms tick, so its figure can be 0, but it is measured and below GetBatch's
    for n in (150, 300):
        stream, batch = by[n, "ais stream"]["cluster_cpu_ms"], by[n, "ais getbatch"]["cluster_cpu_ms"]
        assert stream is not None and stream < batch, (n, stream, by[n, "ais getbatch"])
    assert "ais getbatch+index at 300: " in out and "x the streaming rate from the same bucket" in out, out
    # the shard cache: a whole epoch of the bucket 'ais stream' streams, its span, the cluster's CPU, its ratio
    assert by[300, "ais cache"]["samples"] == by[300, "ais stream"]["samples"] == 300
    assert by[300, "ais cache"]["cluster_cpu_ms"] is not None and by[300, "ais cache"]["span"] == 16
    assert "ais cache at 300: " in out, out
    assert (tmp_path / "scale.png").stat().st_size > 10_000
    r = main_cli("bench", "scale", tmp_path, "--n", "1e3")
    assert r.returncode == 2 and "comma-separated sample counts" in r.stderr  # a usage error, said plainly
