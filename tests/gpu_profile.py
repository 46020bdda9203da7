"""Where the GPU path's main thread spends its time: cProfile and torch.profiler over the loaders feeding a step.

Run on a GPU machine by `tests/gpu_check.sh` (GPU_CHECK_PROFILE=1), or alone:
    python tests/gpu_profile.py SHARDS OUT.txt [--workers 4] [--cpu-workers 15] [--batches 30]
It writes, for the GPU loader alone, the GPU loader + a ResNet-50 step, and the CPU loader (DeviceLoader) + the step:
the main thread's top functions by own time (cProfile), the top torch operators by CPU time (torch.profiler), and a
split of each batch's wall time into waiting for the workers and the rest. With `--device cpu` it runs tiny, to check
the script itself, not to time anything.
"""
from __future__ import annotations
import argparse
import cProfile
import io
import pstats
import time
import warnings
from itertools import islice

import torch

from shardkit.bench.gpu import make_step
from shardkit import create_dataloader, create_dataset
from shardkit.loading.pipeline import create_dataloader, create_dataset
from shardkit.loading.decode import train_transform

warnings.filterwarnings("ignore")


def _timed_next(it, waits: list):
    "next(it), with the seconds spent in the workers' hand-over (the ShardLoader's own next) added to `waits`."
    t = time.perf_counter()
    x = _next(it)
    waits.append(time.perf_counter() - t)
    return x


def _loop(batches, step, n: int, sync) -> dict:
    "Feed `n` batches to `step` (None: take them only); wall seconds, main CPU seconds, seconds inside next()."
    it, waits = iter(batches), []
    _warm(it, step, sync)
    t0, c0, got = time.perf_counter(), time.process_time(), 0
    for _ in range(n):
        x = _timed_next(it, waits)
        if step: step(x)
        got += len(x)
    sync()
    return dict(samples=got, secs=time.perf_counter() - t0, cpu=time.process_time() - c0, in_next=sum(waits), it=it)


def _images(loader, dev):
    "The loader's image batches, pass after pass; None at the end of each pass."
    while True:
        yield from (batch[0] for batch in loader)
        yield None


def _warm(it, step, sync):
    "A whole pass, to warm up: every batch size cuDNN will see tuned before the clock starts (as bench gpu does)."
    for x in it:
        if x is None: break
        if step: step(x)
    sync()


def _next(it):
    x = next(it)
    return next(it) if x is None else x


def _section(title: str, out: io.StringIO): out.write(f"\n{'=' * 100}\n== {title}\n{'=' * 100}\n")


def profile_case(title, make, step, n, *, sync, dev, out, torch_prof: bool = True):
    "cProfile (and torch.profiler) over `n` batches of `make()` fed to `step`."
    _section(title, out)
    r = _loop(_images(make(), dev), step, n, sync)
    out.write(f"plain: {r['samples']} samples in {r['secs']:.3f} s = {r['samples'] / r['secs']:.0f} samples/s; main CPU "
              f"{r['cpu'] / r['samples'] * 1e3:.3f} ms/sample; inside next(): {r['in_next'] / r['secs']:.0%} of the wall "
              "time\n")
    r["it"].close()
    prof = cProfile.Profile()
    it = _images(make(), dev)
    _warm(it, step, sync)
    prof.enable()
    t0 = time.perf_counter()
    for _ in range(n):
        x = _next(it)
        if step: step(x)
    sync()
    secs = time.perf_counter() - t0
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
    out.write(f"cProfile ({n} batches, {secs:.3f} s with the profiler on), by own time:\n")
    out.write("\n".join(l for l in s.getvalue().splitlines() if l.strip() and not l.startswith("   Ordered")) + "\n")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(22)
    out.write("cProfile, by cumulative time:\n")
    out.write("\n".join(l for l in s.getvalue().splitlines()[6:] if l.strip()) + "\n")
    if torch_prof:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as tp:
            for _ in range(min(n, 15)):
                x = _next(it)
                if step: step(x)
            sync()
        out.write("torch.profiler (15 batches), by self CPU time:\n")
        out.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60) + "\n")
        if dev.type == "cuda":
            out.write("torch.profiler, by device time:\n")
            out.write(tp.key_averages().table(sort_by="self_device_time_total", row_limit=14,
                                              max_name_column_width=60) + "\n")
    it.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shards"); p.add_argument("out")
    p.add_argument("--workers", type=int, default=4); p.add_argument("--cpu-workers", type=int, default=15)
    p.add_argument("--batches", type=int, default=30); p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="cuda"); p.add_argument("--step", default="resnet50")
    p.add_argument("--image", default="jpg"); p.add_argument("--size", type=int, default=224)
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda": torch.backends.cudnn.benchmark = True
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out = io.StringIO()
    out.write(f"torch {torch.__version__}, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
              f"batch {a.batch_size}, {a.step}\n")
    step = make_step(a.step, dev)
    gpu = lambda: create_dataloader(create_dataset(a.shards, fields=(a.image,), batch_size=a.batch_size, seed=0,
                                                   transform=train_transform(a.size), decode_on="gpu"),
                                    num_workers=a.workers, device=dev)
    def cpu():
        ds = create_dataset(a.shards, fields=(a.image,), transform=train_transform(a.size), seed=0, batch_size=a.batch_size)
        return create_dataloader(ds, num_workers=a.cpu_workers, batch_size=a.batch_size, device=dev)
    profile_case(f"GPU loader alone, {a.workers} workers", gpu, None, a.batches, sync=sync, dev=dev, out=out)
    profile_case(f"GPU loader + {a.step} step, {a.workers} workers", gpu, step, a.batches, sync=sync, dev=dev, out=out)
    profile_case(f"CPU loader (DeviceLoader) + {a.step} step, {a.cpu_workers} workers", cpu, step, a.batches, sync=sync,
                 dev=dev, out=out)
    with open(a.out, "w") as f: f.write(out.getvalue())
    print("\n".join(l for l in out.getvalue().splitlines() if l.startswith(("==", "plain"))))


if __name__ == "__main__":
    main()
