"""shardkit's loaders over the same 32 shards (1,280 samples of 3 KB) in s3:// (the local AIStore's S3 API), gs://
(fake-gcs-server) and az:// (Azurite): streamed, and by random access with range reads; 2 workers, medians of 3
interleaved epochs: samples/s, CPU ms per sample (the process and its workers). Needs aisnode built (shardkit ais up)
and the emulators (python tests/bucketservers.py). Run from the repository root: python tests/bucket_speed.py"""
import os, resource, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from bucketservers import fake_gcs_server, azurite, connection_string
from faults import write_fault_shards, NAMES
from s3servers import ais_md5_bucket
from shardkit.stores.ais_cluster import ais_up, ais_down
root = Path(tempfile.mkdtemp()); shards = write_fault_shards(Path(tempfile.mkdtemp()))
ep = ais_up(targets=1, root=root / "ais", port=29480, quiet=True)
try:
    with fake_gcs_server(root) as g, azurite(root) as a:
        os.environ.update(STORAGE_EMULATOR_HOST=g, AZURE_STORAGE_CONNECTION_STRING=connection_string(a),
                          AWS_ENDPOINT_URL=f"{ep}/s3", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
                          AWS_EC2_METADATA_DISABLED="true", AWS_REGION="us-east-1", SHARDKIT_HOME=str(root / "home"))
        ais_md5_bucket(ep, "speed")
        from shardkit.stores import open_store
        from shardkit import create_dataloader, create_dataset
        urls = {}
        for k in ("s3", "gs", "az"):
            st = open_store(f"{k}://speed/p", create=True)
            for r in range(4):  # 32 shards, 1,280 samples
                for n in NAMES: st.put_file(shards / n, f"r{r}-{n}")
            urls[k] = f"{k}://speed/p"
        def epoch(url, **kw):
            ds = create_dataset(url, fields=("__key__", "bin"), seed=0, batch_size=16, **kw)
            return sum(len(b[0]) for b in create_dataloader(ds, num_workers=2))
        res = {}
        for mode, kw in (("stream", {}), ("random (range)", dict(access="random", read="range", index_cache=False))):
            for k in urls: epoch(urls[k], **kw)  # warm
            for rep in range(3):
                for k, u in urls.items():
                    t, c0, ch0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
                    n = epoch(u, **kw)
                    ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpu = time.process_time() - c0 + (ch1.ru_utime + ch1.ru_stime) - (ch0.ru_utime + ch0.ru_stime)
                    res.setdefault((mode, k), []).append((n / (time.perf_counter() - t), cpu / n * 1e3))
        for (mode, k), runs in res.items():
            print(f"| {mode} | {k}:// | {statistics.median(r[0] for r in runs):,.0f} | "
                  f"{statistics.median(r[1] for r in runs):.2f} |", flush=True)
finally: ais_down(root / "ais", wipe=True, quiet=True)
