"""What the fault-tolerant reader costs when nothing fails: streaming epochs from a real local AIStore, read by two
checkouts of shardkit side by side in one run (issue 35's "no cost" target: rate >= 0.98x, CPU/sample <= 1.05x).

    git worktree add /tmp/sk-old fade0a2          # shardkit before shardkit.remote
    python tests/faults_overhead.py /tmp/sk-old   # this checkout is "new"; prints the table and the ratios

Each run is a fresh process that imports shardkit from the named checkout (PYTHONPATH first), streams one warm-up
epoch and then `--epochs` timed epochs of `ais://BUCKET` with `create_dataset(fields=("__key__", "cls"))` (no decode:
the read path is the whole cost) and 2 DataLoader workers. The two checkouts alternate, old first on even rounds,
new first on odd ones; the table gives each one's median over `--rounds`. CPU counts this process, its workers and
their children (webdataset's curl in the old reader). The cluster is started in a temporary folder and stopped after.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, gc
import shardkit
from shardkit import create_dataset, create_dataloader
from shardkit.bench.core import cpu_seconds
bucket, epochs, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ds = create_dataset(bucket, fields=("__key__", "cls"), seed=0, batch_size=64, shuffle=0)
dl = create_dataloader(ds, num_workers=workers, batch_size=64)
def epoch():
    n = 0
    for b in dl: n += len(b[0])
    return n
epoch()                                             # warm-up: the cluster's caches, the workers' imports
rates, cpus = [], []
for e in range(epochs):
    gc.collect(); c0, t0 = cpu_seconds(descendants=True), time.perf_counter()
    n = epoch()
    dt, cpu = time.perf_counter() - t0, cpu_seconds(descendants=True) - c0
    rates.append(n / dt); cpus.append(cpu / n * 1e3)
print(json.dumps(dict(file=shardkit.__file__, samples=n, rate=max(rates), cpu_ms=min(cpus))))
"""


def _synth(folder: Path, n: int, size: int):
    import numpy as np
    from shardkit.shards.write import write_shards
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    samples = ({"__key__": f"s{i:06d}", "cls": str(i % 10).encode(), "jpg": blob} for i in range(n))
    write_shards(samples, folder, prefix="overhead-", maxcount=n // 8, progress=False)


def _run(checkout: Path, bucket: str, epochs: int, workers: int, env: dict) -> dict:
    e = {**env, "PYTHONPATH": f"{checkout}{os.pathsep}{env.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", CHILD, bucket, str(epochs), str(workers)], capture_output=True,
                       text=True, env=e, cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL, timeout=900)
    if r.returncode: raise SystemExit(f"the run on {checkout} failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if not res["file"].startswith(str(checkout)):
        raise SystemExit(f"the run meant for {checkout} imported {res['file']}")
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path, help="a checkout of shardkit before the change")
    p.add_argument("--new", type=Path, default=HERE, help="the checkout after it (default: this one)")
    p.add_argument("--samples", type=int, default=16000)
    p.add_argument("--sample-bytes", type=int, default=32 * 1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run (the best one counts)")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    from shardkit.stores.ais_cluster import ais_down, ais_up
    from shardkit.stores import upload_shards
    with tempfile.TemporaryDirectory(prefix="sk-overhead-") as tmp:
        tmp = Path(tmp)
        _synth(tmp / "shards", a.samples, a.sample_bytes)
        endpoint = ais_up(targets=2, root=tmp / "ais", port=18680, quiet=True)
        try:
            env = {**os.environ, "AIS_ENDPOINT": endpoint}
            os.environ["AIS_ENDPOINT"] = endpoint
            upload_shards(tmp / "shards", "ais://sk-overhead", quiet=True)
            runs = {"old": [], "new": []}
            for r in range(a.rounds):
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    res = _run(a.old.resolve() if name == "old" else a.new.resolve(), "ais://sk-overhead",
                               a.epochs, a.workers, env=env)
                    runs[name].append(res)
                    print(f"round {r} {name}: {res['rate']:8,.0f} samples/s {res['cpu_ms']:.4f} CPU ms/sample",
                          flush=True)
        finally:
            ais_down(tmp / "ais")
    med = {k: dict(rate=statistics.median(x["rate"] for x in v), cpu_ms=statistics.median(x["cpu_ms"] for x in v))
           for k, v in runs.items()}
    print(f"\n{a.samples:,} samples of {a.sample_bytes // 1024} KB in 8 shards, ais stream, {a.workers} workers, "
          f"medians of {a.rounds} alternated runs")
    print(f"| code | samples/s | CPU ms/sample |\n|---|---:|---:|")
    for k in ("old", "new"): print(f"| {k} | {med[k]['rate']:,.0f} | {med[k]['cpu_ms']:.4f} |")
    print(f"new/old: rate {med['new']['rate'] / med['old']['rate']:.3f}x (target >= 0.98x), "
          f"CPU per sample {med['new']['cpu_ms'] / med['old']['cpu_ms']:.3f}x (target <= 1.05x)")


if __name__ == "__main__":
    main()
