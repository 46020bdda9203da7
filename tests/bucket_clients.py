"""Reading the same objects from fake-gcs-server and Azurite: shardkit's requests (`shardkit.remote`) against each
store's own client library (google-cloud-storage, azure-storage-blob; pip install them first). Whole objects (a
streamed shard) and 40 KB ranges (a sample read by random access); medians of 3 interleaved runs: samples/s, client
CPU ms per sample, MB/s. Run from the repository root: python tests/bucket_clients.py"""
import os, random, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from bucketservers import fake_gcs_server, azurite, connection_string
N_SHARDS, PER, SIZE, RANGES = 4, 50, 40_000, 200
root = Path(tempfile.mkdtemp())
data = [os.urandom(PER * SIZE) for _ in range(N_SHARDS)]
names = [f"m-{i:03d}.tar" for i in range(N_SHARDS)]
rnd = random.Random(0)
ranges = [(rnd.randrange(N_SHARDS), rnd.randrange(PER) * SIZE) for _ in range(RANGES)]

def clock(f):
    t, c = time.perf_counter(), time.process_time(); n = f(); return time.perf_counter() - t, time.process_time() - c, n

with fake_gcs_server(root) as gep, azurite(root) as aep:
    os.environ["STORAGE_EMULATOR_HOST"] = gep
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(aep)
    from shardkit.stores import open_store
    gs, az = open_store("gs://bench/m", create=True), open_store("az://bench/m", create=True)
    for n, d in zip(names, data): gs.put_bytes(d, n); az.put_bytes(d, n)
    from google.cloud import storage
    from azure.storage.blob import ContainerClient
    gcli = storage.Client.create_anonymous_client()  # honours STORAGE_EMULATOR_HOST
    gb = gcli.bucket("bench")
    acli = ContainerClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"], "bench")
    ways = {
      "gs shardkit stream": lambda: sum(len(gs.open(n).read()) for n in names),
      "gs google-cloud-storage stream": lambda: sum(len(gb.blob(f"m/{n}").download_as_bytes()) for n in names),
      "az shardkit stream": lambda: sum(len(az.open(n).read()) for n in names),
      "az azure-storage-blob stream": lambda: sum(len(acli.download_blob(f"m/{n}").readall()) for n in names),
      "gs shardkit range": lambda: sum(len(gs.read_range(names[s], o, o + SIZE)) for s, o in ranges),
      "gs google-cloud-storage range": lambda: sum(len(gb.blob(f"m/{names[s]}").download_as_bytes(
          start=o, end=o + SIZE - 1)) for s, o in ranges),
      "az shardkit range": lambda: sum(len(az.read_range(names[s], o, o + SIZE)) for s, o in ranges),
      "az azure-storage-blob range": lambda: sum(len(acli.download_blob(
          f"m/{names[s]}", offset=o, length=SIZE).readall()) for s, o in ranges),
    }
    res = {k: [] for k in ways}
    for f in ways.values(): f()  # warm: connections, the libraries' first calls
    for rep in range(3):
        for k, f in ways.items(): res[k].append(clock(f))
    for k, runs in res.items():
        samples = N_SHARDS * PER if "stream" in k else RANGES
        wall = statistics.median(r[0] for r in runs); cpu = statistics.median(r[1] for r in runs)
        mb = runs[0][2] / wall / 1e6
        print(f"| {k} | {samples / wall:,.0f} | {cpu / samples * 1e3:.3f} | {mb:.0f} |", flush=True)
