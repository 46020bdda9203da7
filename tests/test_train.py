"""`shardkit train`: data parallel runs under torchrun, training over HTTP and from AIStore, bad input."""
import contextlib, io, json, os, socket, subprocess, sys, time
from pathlib import Path
import numpy as np
import pytest
import webdataset as wds
from PIL import Image

COLOURS = [(200, 40, 40), (40, 180, 40), (40, 60, 200)]


def _jpeg(cls, rng):
    x = np.clip(np.array(COLOURS[cls], np.float32) + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO(); Image.fromarray(x).save(buf, "jpeg"); return buf.getvalue()


def write_shards(dest: Path, sizes, prefix="t-"):
    "Shards prefix00.tar, ... holding `sizes[i]` samples each (keys s0000, s0001, ... across all shards)."
    dest.mkdir(parents=True, exist_ok=True)
    rng, k = np.random.default_rng(0), 0
    for s, n in enumerate(sizes):
        with wds.TarWriter(str(dest / f"{prefix}{s:02d}.tar")) as w:
            for _ in range(n):
                w.write({"__key__": f"s{k:04d}", "jpg": _jpeg(k % 3, rng), "cls": k % 3}); k += 1
    return f"{dest}/{prefix}{{00..{len(sizes) - 1:02d}}}.tar"


def torchrun(*args, nproc=2, timeout=120):
    "Run `shardkit train ARGS` under torchrun with `nproc` CPU ranks; the CompletedProcess."
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "shardkit", "train", *map(str, args)]  # `python -m shardkit`, as the README runs it
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


@pytest.mark.slow
def test_ddp_ranks_disjoint_equal_and_finish(tmp_path):
    """Over HTTP, one shard meeting faults: every GET of t-01.tar is cut halfway (each read resumes where it stopped).
    The ranks still train on disjoint shares of the epoch's order, the same number of steps each, and finish together."""
    from faults import FaultServer
    write_shards(tmp_path / "shards", [20, 20, 6])  # uneven shards: the ranks share samples, not shards
    with FaultServer(tmp_path / "shards") as server:
        server.fault("cut", pattern="t-01.tar", when="fresh")
        r = torchrun("--base", server.base + "/", "--shards", "t-{00..02}.tar", "--size", 32, "--batch-size", 8,
                     "--workers", 1, "--epochs", 2, "--keys-out", tmp_path / "keys", "--json", tmp_path / "hist.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert server.faults_played() and "retried" in r.stderr and "connection cut" in r.stderr, r.stderr[-3000:]
    seen = [(tmp_path / "keys" / f"keys-rank{i}.txt").read_text().split() for i in range(2)]
    # 46 samples // (2 ranks x 8) = 2 full steps per epoch, on both ranks
    assert [len(s) for s in seen] == [2 * 2 * 8] * 2
    for e in (0, 1):  # within an epoch no sample twice, on either rank or across them
        epoch = seen[0][16 * e:16 * (e + 1)] + seen[1][16 * e:16 * (e + 1)]
        assert len(set(epoch)) == 32 and set(epoch) <= {f"s{k:04d}" for k in range(46)}, epoch
    hist = json.loads((tmp_path / "hist.json").read_text())
    assert [h["samples"] for h in hist] == [32, 32] and hist[-1]["steps"] == 4
    assert "2 ranks," in r.stdout


@pytest.mark.slow
def test_ddp_checkpoint_resumes_exactly_on_any_shape(tmp_path):
    """Two ranks stopped mid-epoch (--max-steps) and run again with --checkpoint train on exactly the uninterrupted run's
    keys, per rank, even when one rank's checkpoint is lost; stopped again and resumed on one rank with the same
    samples a step (--batch-size 8), the steps are the uninterrupted run's too: its two ranks' batches, in order."""
    shards = write_shards(tmp_path / "shards", [20, 20, 6, 18])
    args = ["--shards", shards, "--size", 32, "--workers", 1, "--epochs", 2, "--every", 2]
    r = torchrun(*args, "--batch-size", 4, "--checkpoint", tmp_path / "whole.pt", "--keys-out", tmp_path / "whole")
    assert r.returncode == 0, r.stdout + r.stderr
    r = torchrun(*args, "--batch-size", 4, "--checkpoint", tmp_path / "ck.pt", "--keys-out", tmp_path / "resumed",
                 "--max-steps", 5)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.glob("ck*.pt")) == ["ck-rank0.pt", "ck-rank1.pt"]
    (tmp_path / "ck-rank1.pt").unlink()  # lost, as if killed before its save: every rank goes on from rank 0's
    r = torchrun(*args, "--batch-size", 4, "--checkpoint", tmp_path / "ck.pt", "--keys-out", tmp_path / "resumed",
                 "--max-steps", 11)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "epoch 1, after 5 of its steps (5 steps in all)" in r.stdout, r.stdout
    whole = [(tmp_path / "whole" / f"keys-rank{k}.txt").read_text().split() for k in range(2)]
    resumed = [(tmp_path / "resumed" / f"keys-rank{k}.txt").read_text().split() for k in range(2)]
    assert [len(w) for w in whole] == [2 * 8 * 4] * 2  # 64 samples // (2 ranks x 4) = 8 steps an epoch
    assert resumed == [w[:11 * 4] for w in whole]
    r = torchrun(*args, "--batch-size", 8, "--checkpoint", tmp_path / "ck.pt", "--keys-out", tmp_path / "one",
                 "--workers", 2, "--json", tmp_path / "hist.json", nproc=1)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "epoch 2, after 3 of its steps (11 steps in all)" in r.stdout, r.stdout
    one = (tmp_path / "one" / "keys-rank0.txt").read_text().split()
    steps = [whole[0][4 * i:4 * i + 4] + whole[1][4 * i:4 * i + 4] for i in range(16)]  # the 2-rank run's steps
    assert one == [k for s in steps[11:] for k in s]
    assert [h["samples"] for h in json.loads((tmp_path / "hist.json").read_text())] == [64, 64]


@pytest.mark.slow
def test_ddp_folder_ranks_disjoint(tmp_path):
    for c in range(2):
        d = tmp_path / "tree" / "train" / f"c{c}"; d.mkdir(parents=True)
        for j in range(9): (d / f"img{j}.jpg").write_bytes(_jpeg(c, np.random.default_rng(j)))
    r = torchrun("--folder", tmp_path / "tree", "--size", 32, "--batch-size", 4, "--workers", 0,
                 "--keys-out", tmp_path / "keys")
    assert r.returncode == 0, r.stdout + r.stderr
    seen = [(tmp_path / "keys" / f"keys-rank{i}.txt").read_text().split() for i in range(2)]
    assert [len(s) for s in seen] == [8, 8]  # DistributedSampler(drop_last): 18 // 2 = 9 per rank, 2 full batches of 4
    assert not set(seen[0]) & set(seen[1])


@pytest.mark.timed
@pytest.mark.slow
def test_ddp_too_few_samples_fails_fast(tmp_path):
    shards = write_shards(tmp_path / "shards", [6])
    t0 = time.time()
    r = torchrun("--shards", shards, "--size", 32, "--batch-size", 4, "--workers", 0, timeout=600)  # a hang guard only
    assert r.returncode != 0
    assert "6 samples make no full step of batch_size 4 x 2 ranks" in r.stderr, r.stderr[-2000:]
    took = time.time() - t0  # fast: the ranks refuse before training, not when a collective times out (minutes)
    assert took < 120, f"the ranks took {took:.0f} s to refuse 6 samples for 2 ranks x 4 (about 15-40 s here)"


@contextlib.contextmanager
def http_server(folder: Path):
    "python -m http.server on a free 127.0.0.1 port serving `folder`; yields the base URL."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0: break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/"
    finally:
        p.terminate(); p.wait(10)


def shardkit(capsys, *args):
    "Run `shardkit ARGS` in this process (one torch import for all these tests): (exit status, stdout, stderr)."
    from shardkit.apps.cli import main
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_train_over_http(tmp_path, capsys):
    write_shards(tmp_path / "shards", [12, 12], prefix="imagenet-train-")
    write_shards(tmp_path / "shards", [6], prefix="imagenet-val-")
    with http_server(tmp_path / "shards") as url:
        for base in (url, f"pipe:curl -fsS {url}"):
            rc, out, err = shardkit(capsys, "train", "--base", base, "--shards", "imagenet-train-{00..01}.tar",
                                    "--val-shards", "imagenet-val-{00..00}.tar", "--size", 32, "--batch-size", 8,
                                    "--workers", 1, "--json", tmp_path / "h.json")
            assert rc == 0, out + err
            h = json.loads((tmp_path / "h.json").read_text())[0]
            assert (h["samples"], h["val_samples"]) == (24, 6)
            assert "samples/s" in out and "val acc" in out
            rc, out, err = shardkit(capsys, "train", "--base", base, "--shards", "missing-{00..01}.tar", "--size", 32)
            assert rc == 1 and "cannot read shard" in err and "missing-00.tar" in err, err  # a data error: 1


def test_bad_input(tmp_path, capsys):
    rc, out, err = shardkit(capsys, "train")
    assert rc == 2 and "exactly one" in err
    rc, out, err = shardkit(capsys, "train", "--shards", tmp_path / "nope-{0..1}.tar")
    assert rc == 1 and "2 of which do not exist" in err and "nope-0.tar" in err and "curl" not in err
    rc, out, err = shardkit(capsys, "train", "--folder", tmp_path)
    assert rc == 2 and "holds no images" in err
    shards = write_shards(tmp_path / "shards", [4])
    rc, out, err = shardkit(capsys, "train", "--shards", shards, "--arch", "resnet7", "--size", 32)
    assert rc == 2 and "unknown architecture 'resnet7'" in err


def test_train_from_aistore(tmp_path, ais_endpoint):
    from shardkit.stores import open_store
    from shardkit.train import train
    write_shards(tmp_path / "shards", [10, 10])
    store = open_store("ais://shardkit-test-train", create=True)
    for n in ("t-00.tar", "t-01.tar"): store.put_file(tmp_path / "shards" / n)
    try:
        urls = store.urls("t-{00..01}.tar")
        assert all(u.startswith("http") for u in urls)
        hist = train(urls, val_shards=urls[:1], size=32, batch_size=5, num_workers=1)
        assert (hist[0]["samples"], hist[0]["val_samples"]) == (20, 10)
    finally:
        for n in store.list(): store.delete(n)


def _why_no_cuda():
    from shardkit.loading.gpu_decode import why_no_gpu
    return why_no_gpu()


@pytest.mark.skipif(_why_no_cuda() is not None, reason=f"needs a CUDA GPU: {_why_no_cuda()}")
@pytest.mark.parametrize("how", [dict(), dict(precision="fp16"), dict(precision="fp32"), dict(decode_on="gpu"),
                                 dict(decode_on="auto"), dict(pipeline="example")])
def test_train_on_cuda(tmp_path, how):
    "The default (CPU decoding, batches copied one ahead, bf16), fp16 with its GradScaler, fp32, nvJPEG, and the example."
    from shardkit.train import train
    shards = write_shards(tmp_path / "shards", [12, 12])
    val = write_shards(tmp_path / "shards", [6], prefix="v-")
    hist = train(shards, val_shards=val, size=32, batch_size=8, num_workers=1, device="cuda", epochs=2, **how)
    assert [h["samples"] for h in hist] == [24, 24] and hist[-1]["val_samples"] == 6, hist
    assert all(0 <= h["wait_share"] <= 1 and h["loss"] == h["loss"] for h in hist), hist  # no NaN loss


@pytest.mark.skipif(_why_no_cuda() is not None, reason=f"needs a CUDA GPU: {_why_no_cuda()}")
def test_train_checkpoint_on_cuda_resumes_exactly(tmp_path):
    "On CUDA the loader copies one batch ahead: a run stopped and resumed still trains on the uninterrupted run's keys."
    from shardkit.train import train
    shards = write_shards(tmp_path / "shards", [20, 20, 6, 18])
    args = dict(shards=shards, size=32, batch_size=4, num_workers=2, epochs=2, device="cuda", seed=3, every=2)
    train(**args, checkpoint=str(tmp_path / "whole.pt"), keys_out=str(tmp_path / "whole"))
    train(**args, checkpoint=str(tmp_path / "run.pt"), keys_out=str(tmp_path / "resumed"), max_steps=11)
    train(**args, checkpoint=str(tmp_path / "run.pt"), keys_out=str(tmp_path / "resumed"))
    whole, resumed = [(tmp_path / d / "keys-rank0.txt").read_text().split() for d in ("whole", "resumed")]
    assert resumed == whole and len(whole) == 2 * 64


def test_example_pipeline_cannot_checkpoint(tmp_path, capsys):
    shards = write_shards(tmp_path / "shards", [4])
    rc, out, err = shardkit(capsys, "train", "--shards", shards, "--size", 32, "--pipeline", "example", "--checkpoint", tmp_path / "c.pt")
    assert rc == 2 and "--pipeline example cannot resume mid-epoch" in err, err
    rc, out, err = shardkit(capsys, "train", "--shards", shards, "--size", 32, "--decode-on", "nvjpeg")
    assert rc == 2 and "decode_on must be 'cpu', 'gpu' or 'auto'" in err, err
