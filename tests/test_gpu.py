"""Decoding on the GPU: the CPU run of the same code path (exact epochs over workers and ranks, shapes, seeds, errors),
and the CUDA checks, which skip with the reason where there is no GPU that decodes JPEGs."""
import numpy as np
import pytest
import torch
import webdataset as wds
from shardkit.cli import main as cli_main
from shardkit.loading.gpu import create_gpu_loader, why_no_gpu
from shardkit.bench.gpu import bench_gpu_decode
from shardkit.loading.sources import LoaderError
from shardkit.synth import draw_animal, jpeg_bytes, png_bytes

N_SHARDS, PER_SHARD = 6, 5
ALL = sorted(f"s{s}_{i}" for s in range(N_SHARDS) for i in range(PER_SHARD))
NO_GPU = why_no_gpu()
cuda = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU JPEG decoding here: {NO_GPU}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder, rng, paths = tmp_path_factory.mktemp("gpu"), np.random.default_rng(0), []
    for s in range(N_SHARDS):
        paths.append(str(folder / f"pets-{s:05d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for i in range(PER_SHARD):
                cls = int(rng.integers(0, 37))
                img, tri = draw_animal(cls, rng, size=(int(rng.integers(40, 90)), int(rng.integers(40, 90))))
                w.write({"__key__": f"s{s}_{i}", "image.jpg": jpeg_bytes(img), "cls": cls, "trimap.png": png_bytes(tri)})
    return paths


def _loader(shards, **kw):
    kw = {"keys": ("__key__", "cls", "image.jpg"), "batch_size": 7, "num_workers": 2, "seed": 1, "device": "cpu", "size": 32, **kw}
    return create_gpu_loader(shards, **kw)


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_every_sample_exactly_once_per_epoch(shards, workers):
    dl = _loader(shards, num_workers=workers)
    epochs = [[k for keys, _, _ in dl for k in keys] for _ in range(2)]
    for keys in epochs:
        assert sorted(keys) == ALL
    assert epochs[0] != epochs[1], "a new order every epoch"


def test_ranks_split_an_epoch(shards):
    parts = [[k for keys, _, _ in _loader(shards, rank=r, world_size=2) for k in keys] for r in (0, 1)]
    assert sorted(parts[0] + parts[1]) == ALL and parts[0] and parts[1]


def test_shapes_dtypes_and_labels(shards):
    batches = list(_loader(shards))
    assert [len(b[0]) for b in batches] == [7, 7, 7, 7, 2]
    keys, cls, images = batches[0]
    assert images.dtype == torch.uint8 and images.shape == (7, 3, 32, 32) and images.device.type == "cpu"
    truth = {s["__key__"]: int(s["cls"]) for s in wds.WebDataset(shards, shardshuffle=False)}
    assert cls.dtype == torch.int64 and cls.tolist() == [truth[k] for k in keys]
    (x,) = next(iter(_loader(shards, keys=("image.jpg",), normalize=True)))
    assert x.dtype == torch.float32 and x.shape == (7, 3, 32, 32)


def test_seeded_repeatability(shards):
    a, b, c = list(_loader(shards, seed=4)), list(_loader(shards, seed=4)), list(_loader(shards, seed=5))
    assert [x[0] for x in a] == [x[0] for x in b]
    assert all(torch.equal(x[2], y[2]) for x, y in zip(a, b)), "the same crops and flips"
    assert [x[0] for x in a] != [x[0] for x in c]
    dl = _loader(shards, seed=4)
    list(dl), list(dl)
    dl.set_epoch(0)
    assert [x[0] for x in dl] == [x[0] for x in a]


def test_errors_say_what_to_do(shards, tmp_path):
    with pytest.raises(LoaderError, match="create_dataloader"):
        _loader(shards, keys=("cls", "image.jpg", "trimap.png"))
    with pytest.raises(LoaderError, match="is not a JPEG"):
        with wds.TarWriter(str(tmp_path / "png.tar")) as w:
            w.write({"__key__": "p0", "image.jpg": png_bytes(np.zeros((8, 8), np.uint8)), "cls": 0})
        next(iter(_loader([str(tmp_path / "png.tar")], num_workers=0)))
    with pytest.raises(LoaderError, match="sample 'bad'"):
        with wds.TarWriter(str(tmp_path / "bad.tar")) as w:
            w.write({"__key__": "bad", "image.jpg": jpeg_bytes(draw_animal(0, np.random.default_rng(0), (32, 32))[0])[:200] + b"x" * 50, "cls": 0})
        next(iter(_loader([str(tmp_path / "bad.tar")], num_workers=0)))


@pytest.mark.skipif(NO_GPU is None, reason="this machine has GPU decoding; the no-GPU errors cannot be seen here")
def test_without_a_gpu_cuda_is_refused_with_the_reason(shards, capsys):
    with pytest.raises(LoaderError, match="create_dataloader"):
        create_gpu_loader(shards)
    assert bench_gpu_decode(shards) == [] and NO_GPU in capsys.readouterr().err
    assert cli_main(["bench", "gpu", str(shards[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardkit bench gpu: nothing to measure") and NO_GPU in err


def test_bench_cli_on_cpu(shards, capsys):
    assert cli_main(["bench", "gpu", str(shards[0]), "--device", "cpu", "--samples", "20", "--workers", "1", "--size", "32"]) == 0
    out = capsys.readouterr().out
    assert "shardkit, decode on cpu" in out and "shardkit CPU loader" in out


@cuda
def test_cuda_batches_live_on_the_device(shards):
    batches = list(_loader(shards, device="cuda"))
    assert sorted(k for keys, _, _ in batches for k in keys) == ALL
    keys, cls, images = batches[0]
    assert images.device.type == "cuda" and images.dtype == torch.uint8 and images.shape == (7, 3, 32, 32)
    assert cls.device.type == "cuda" and cls.dtype == torch.int64
    cpu = list(_loader(shards))
    assert [b[0] for b in cpu] == [b[0] for b in batches], "the same samples and crops; only the decoder differs"
    assert (images.float().cpu() - cpu[0][2].float()).abs().mean() < 8


@cuda
def test_cuda_seeded_and_normalized(shards):
    a, b = list(_loader(shards, device="cuda", seed=9)), list(_loader(shards, device="cuda", seed=9))
    assert all(torch.equal(x[2], y[2]) for x, y in zip(a, b))
    (x,) = next(iter(_loader(shards, device="cuda", keys=("image.jpg",), normalize=True)))
    assert x.device.type == "cuda" and x.dtype == torch.float32


@cuda
def test_cuda_bench_runs(shards):
    rows = bench_gpu_decode(shards, batch_size=8, num_workers=2, samples=64, size=64)
    assert rows[0]["name"].startswith("shardkit, decode on cuda") and all(r["rate"] > 0 for r in rows)
