"""Faults and cluster changes survived on the real local AIStore: one target killed with SIGKILL in the middle of
an epoch (streaming, and random access through the shard cache) and while `shardkit ais put` uploads, then started
again within the retry window. The epoch is exactly a clean epoch's samples in order; every shard arrives intact; the retries are reported.
(AIStore drops a target that stays down for about 30 s from its cluster map, and its objects then answer 404 until it
is back: the restart here comes after 3 s.) A rebalance: the actions it refuses or stops (`index-shard`, dSort)
wait for it, say so once, and blame no version. Targets that leave and join in the middle of an epoch. These run on
`changing_cluster`, a cluster of their own: each change starts a rebalance of about 40 s, which no test of the
session's cluster meets, and nothing waits for the last one (the cluster is stopped at the end)."""
import hashlib, json, os, signal, subprocess, sys, threading, time, uuid
from pathlib import Path
import numpy as np
import pytest
import requests
import webdataset as wds
from test_faults import keys_of, random_loader, reported, stream_keys
from shardkit.remote import Retries

NAMES = [f"k-{s:03d}.tar" for s in range(8)]


def write_shards(folder: Path, per_shard: int = 40, payload: int = 30_000) -> Path:
    "8 shards of `per_shard` samples of `payload` random bytes (about 1.2 MB a shard: a read is under way a while)."
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for s, name in enumerate(NAMES):
        with wds.TarWriter(str(folder / name)) as w:
            for i in range(per_shard):
                w.write({"__key__": f"k{s}_{i:02d}", "cls": i % 5, "bin": rng.integers(0, 256, payload, np.uint8).tobytes()})
    return folder


def _nodes(root: Path) -> dict:
    return json.loads((Path(root) / "cluster.json").read_text())


def late_target(endpoint: str, bucket: str, keys: list[str]) -> str:
    """The name of the target (target1, target2) holding the shard an epoch of `keys` (`k{s}_{i}`: shard s) reaches
    last: no worker has opened it yet when the first batch arrives (each reads at most its shuffle buffer and its
    prefetched batches ahead, under 3 of its 4 shards), so killing that target is sure to meet a read."""
    first = {}
    for i, k in enumerate(keys): first.setdefault(int(k[1:].split("_")[0]), i)
    shard = NAMES[max(first, key=first.get)]
    port = requests.get(f"{endpoint}/v1/objects/{bucket}/{shard}?provider=ais", allow_redirects=False,
                        timeout=10).headers["Location"].split("/")[2].split(":")[1]
    return next(n["name"] for n in _nodes_of(endpoint) if str(n["port"]) == port)


def kill_and_restart(root: Path, name: str, after: float = 3.0) -> threading.Thread:
    "SIGKILL node `name` of the cluster under `root` now, start it again (same command) `after` s later, in a thread."
    from shardkit.stores.ais_cluster import cluster_ready
    st = _nodes(root)
    node = next(n for n in st["nodes"] if n["name"] == name)
    os.kill(node["pid"], signal.SIGKILL)
    try: os.waitpid(node["pid"], 0)  # our child (ais_up started it in this process): no zombie left
    except ChildProcessError: pass
    def restart():
        time.sleep(after)
        with open(Path(node["dir"]) / "stdout.log", "ab") as log:
            p = subprocess.Popen(node["cmd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=node["dir"], start_new_session=True)
        node["pid"] = p.pid  # so that ais_down stops the new process
        (Path(root) / "cluster.json").write_text(json.dumps(st, indent=1))
        deadline = time.time() + 120
        while not cluster_ready(st["endpoint"], st["targets"]) and time.time() < deadline: time.sleep(0.3)
    t = threading.Thread(target=restart, daemon=True); t.start()
    return t


_ROOTS = {}
def _nodes_of(endpoint):
    return _nodes(_ROOTS[endpoint])["nodes"]


@pytest.fixture
def cluster(changing_cluster, monkeypatch):
    "The cluster whose targets these tests kill and restart, exported as AIS_ENDPOINT for the test."
    monkeypatch.setenv("AIS_ENDPOINT", changing_cluster["endpoint"])
    _ROOTS[changing_cluster["endpoint"]] = changing_cluster["root"]
    return changing_cluster


@pytest.fixture
def bucket(cluster, tmp_path):
    "A bucket holding the 8 shards (uploaded with upload_shards), and the local folder they came from."
    from shardkit.stores import upload_shards
    src = write_shards(tmp_path / "shards")
    name = f"faults-{uuid.uuid4().hex[:8]}"
    upload_shards(src, f"ais://{name}", quiet=True)
    yield name, src
    from shardkit.stores import open_store
    open_store(f"ais://{name}").bucket.delete(missing_ok=True)


def test_dsort_through_a_starting_rebalance(cluster, tmp_path, capfd, monkeypatch):
    """A rebalance that starts stops a running dSort job ("starting x-rebalance[...]"): the shuffle runs it again,
    says so once, and its shards hold every sample exactly once. (First on the cluster: no rebalance runs yet, so
    the one it starts begins at once.)"""
    import io, tarfile
    from shardkit import shuffle
    from shardkit.stores.ais_cluster import start_rebalance
    from shardkit.stores import upload_shards
    from shardkit.stores import open_store
    rng, folder = np.random.default_rng(2), tmp_path / "big"
    folder.mkdir()
    for s in range(24):
        with wds.TarWriter(str(folder / f"b-{s:03d}.tar")) as w:
            for i in range(100): w.write({"__key__": f"b{s}_{i:03d}", "cls": i % 5,
                                          "bin": rng.integers(0, 256, 8000, np.uint8).tobytes()})
    name = f"faults-dsort-{uuid.uuid4().hex[:8]}"
    upload_shards(folder, f"ais://{name}", quiet=True)
    wait, started = shuffle.wait_dsort, []
    def rebalance_then_wait(job, *a, **kw):  # the job has just started: a rebalance starts under it (the first time)
        if not started: started.append(start_rebalance(cluster["endpoint"]))
        return wait(job, *a, **kw)
    monkeypatch.setattr(shuffle, "wait_dsort", rebalance_then_wait)
    capfd.readouterr()
    res = shuffle.shuffle_shards(f"ais://{name}", f"ais://{name}-out", shard_size="2MB", progress=False)
    err = capfd.readouterr().err
    assert err.count("AIStore is rebalancing; waiting") == 1 and "dSort job" in err, err
    out, keys = open_store(f"ais://{name}-out"), []
    for n in res.names:
        with tarfile.open(fileobj=io.BytesIO(out.read_bytes(n))) as t: keys += [m.name for m in t.getmembers()]
    assert sorted(keys) == sorted(f"b{s}_{i:03d}.{f}" for s in range(24) for i in range(100) for f in ("bin", "cls"))
    for b in (name, f"{name}-out"): open_store(f"ais://{b}").bucket.delete(missing_ok=True)


def _epoch_through_a_kill(loader, root: Path, target: str) -> list[str]:
    "The keys of `loader`'s epoch, `target` killed after its first batch and restarted 3 s later; slow consumer."
    keys, restarting = [], None
    for b in loader:
        keys += b[0]
        if restarting is None: restarting = kill_and_restart(root, target)
        time.sleep(0.02)  # a training step: the workers stop at their prefetch, mid-shard
    restarting.join(150)
    return keys


def test_a_target_killed_mid_epoch_and_restarted(cluster, bucket, capfd):
    name, src = bucket
    clean = stream_keys([str(src / n) for n in NAMES])
    target = late_target(cluster["endpoint"], name, clean)
    retries = Retries(backoff=0.1, max_backoff=1.0, wait=60)
    from shardkit import create_dataloader, create_dataset
    ds = create_dataset(f"ais://{name}", fields=("__key__", "cls"), seed=0, batch_size=16, shuffle=50, retry_wait=retries)
    capfd.readouterr()
    assert _epoch_through_a_kill(create_dataloader(ds, num_workers=2, batch_size=16), cluster["root"], target) == clean
    err = capfd.readouterr().err
    assert sum(reported(err).values()) >= 1 and retries.counts(), err  # the faults met, reported by the workers
    print("streaming:", retries.counts(), f"{retries.waited:.1f} s")
    # random access through the shard cache, the same outage: its epoch is a clean one's too
    local = keys_of(random_loader(str(src), "cache", workers=0, shard_cache=2))  # spans of 2 shards: fetched as
    retries = Retries(backoff=0.1, max_backoff=1.0, wait=60)                    # the epoch goes, not all at first
    dl = random_loader(f"ais://{name}", "cache", retry_wait=retries, shard_cache=2)
    assert _epoch_through_a_kill(dl, cluster["root"], late_target(cluster["endpoint"], name, local)) == local
    assert retries.counts(), "the outage met no read of the shard cache"
    print("shard cache:", retries.counts(), f"{retries.waited:.1f} s")


def test_ais_put_through_a_target_restart(cluster, tmp_path):
    "`shardkit ais put` uploads while a target is down (killed as it starts, back 3 s later): every shard arrives intact."
    src = write_shards(tmp_path / "shards")
    name = f"faults-put-{uuid.uuid4().hex[:8]}"
    from shardkit.stores import open_store
    store = open_store(f"ais://{name}", create=True)  # (creating a bucket needs every target: not during the outage)
    cmd = [sys.executable, "-m", "shardkit.apps.cli", "ais", "put", str(src), f"ais://{name}", "--retry-wait", "60"]
    put = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    restarting = kill_and_restart(cluster["root"], "target1")  # about half the shards belong to each target
    out, err = put.communicate(timeout=180)
    restarting.join(150)
    assert put.returncode == 0, out + err
    for n in NAMES:  # (read, not listed: a listing would wait for the rebalance the restart started, about 40 s)
        assert hashlib.sha256(store.read_bytes(n)).digest() == hashlib.sha256((src / n).read_bytes()).digest(), n
    assert "uploaded 8 files" in out and "shardkit ais put:" in out and "connection refused" in out, out
    print(out)
    store.bucket.delete(missing_ok=True)


def _index_while_rebalancing(endpoint: str, name: str, src: Path, capfd, loaders: dict) -> str:
    """While a rebalance runs: epochs by GetBatch and through the shard cache are exact (`loaders`, made before it
    began: a listing waits for it); the shard index is built (AIStore refuses `index-shard` with HTTP 409 until the
    rebalance ends: asked again, the wait said once, no version blamed); then GetBatch reads with it."""
    from shardkit.stores.ais_cluster import rebalancing
    from shardkit.loading.readers import build_shard_index
    local = keys_of(random_loader(str(src), "local", workers=0))  # the global order; the cache's spans of 2 shards:
    spans = keys_of(random_loader(str(src), "cache", workers=0, shard_cache=2))
    assert keys_of(loaders["getbatch"]) == local
    assert keys_of(loaders["cache"]) == spans
    during = rebalancing(endpoint)
    assert during, "the rebalance was over before the shard index was asked for"
    capfd.readouterr()
    retries, t0 = Retries(backoff=0.5, max_backoff=5, wait=180), time.monotonic()
    assert build_shard_index(f"ais://{name}", retries=retries)
    waited, err = time.monotonic() - t0, capfd.readouterr().err
    said = [line for line in err.splitlines() if "AIStore is rebalancing; waiting (up to 3 min)" in line]
    assert len(said) == 1 and "index-shard" in said[0], err
    assert "5.0" not in err and retries.counts().get("store busy"), (err, retries.counts())
    assert keys_of(random_loader(f"ais://{name}", "getbatch")) == local
    return f"GetBatch and cache epochs exact during {during}; index-shard waited {waited:.0f} s, said once"


def _loaders(name: str, retries: Retries) -> dict:
    "A streaming and a random-access loader over the bucket, 2 workers each, batches of 16 (as the clean epochs)."
    from shardkit import create_dataloader, create_dataset
    ds = create_dataset(f"ais://{name}", fields=("__key__", "cls"), seed=0, batch_size=16, shuffle=50,
                        retry_wait=retries)
    return dict(streaming=create_dataloader(ds, num_workers=2, batch_size=16),
                random=random_loader(f"ais://{name}", "cache", retry_wait=retries, shard_cache=2))


def _epochs_through(change, loaders: dict, endpoint: str, meanwhile) -> tuple[dict, float, str]:
    """Both loaders' epochs side by side, batch by batch (a slow consumer: their workers wait at their prefetch);
    `change()` after each has yielded its first batch; after 4 more, `meanwhile()` runs (another job on the cluster
    while it rebalances), both wait until the rebalance is over, then end. The keys of each epoch, the seconds the
    rebalance ran, and what `meanwhile` said."""
    from shardkit.stores.ais_cluster import await_rebalance
    its, keys, t_reb, said = {k: iter(v) for k, v in loaders.items()}, {k: [] for k in loaders}, 0.0, ""
    for step in range(10_000):
        for k in list(its):
            try: keys[k] += next(its[k])[0]
            except StopIteration: del its[k]
        if not its: return keys, t_reb, said
        if step == 0: change(); t0 = time.monotonic()
        if step == 4:
            _await_rebalance_start(endpoint)  # a join's rebalance starts a few seconds after the target is in the map
            said = meanwhile()
            await_rebalance(endpoint, timeout=300); t_reb = time.monotonic() - t0
        time.sleep(0.05)


def _await_rebalance_start(endpoint: str, timeout: float = 30) -> list[str]:
    "Wait until a rebalance runs on the cluster (at most `timeout` s); the jobs running, [] if none started."
    from shardkit.stores.ais_cluster import rebalancing
    deadline = time.monotonic() + timeout
    while not (running := rebalancing(endpoint)) and time.monotonic() < deadline: time.sleep(0.2)
    return running or []


def _notebook_while_rebalancing(nb: str, endpoint: str):
    "Run notebook `nb` (every cell, test-sized) on the cluster while it rebalances; a line on how it went."
    from shardkit.stores.ais_cluster import rebalancing
    from test_notebooks import NBS_DIR, run_notebook
    during, t0 = rebalancing(endpoint), time.monotonic()
    assert during, f"the rebalance was over before {nb} started"
    run_notebook(NBS_DIR / nb, {**os.environ, "AIS_ENDPOINT": endpoint}, ("slow", "ais"))
    return f"{nb} passed in {time.monotonic() - t0:.0f} s, started during {during}"


def test_targets_leave_and_join_mid_epoch(cluster, bucket, capfd):
    """The cluster changes under an epoch: a target goes into maintenance, a target joins, a target is
    decommissioned, each in the middle of an epoch of a streaming loader and of a random-access loader (the default
    for `ais://`: the shard cache) read side by side. Each change starts a rebalance (about 40 s here); both epochs
    wait half-way until it is over (the target has left, or holds its objects), so each reads before, during and
    after the change. Both epochs are exactly a clean epoch's samples, in its order, with no error. While each
    rebalance runs, a random-access job runs beside them: the 27_random_access notebook, the 36_bench_random notebook (their
    full runs: the session's cluster never rebalances), the shard index. The test runs last on this cluster: it
    leaves it with other targets."""
    from shardkit.stores.ais_cluster import ais_decommission, ais_join, ais_maintenance, ais_status
    name, src = bucket
    root, endpoint, joined = cluster["root"], cluster["endpoint"], []
    clean = dict(streaming=stream_keys([str(src / n) for n in NAMES]),
                 random=keys_of(random_loader(str(src), "cache", workers=0, shard_cache=2)))
    later = dict(getbatch=random_loader(f"ais://{name}", "getbatch"),  # read during the last change's rebalance
                 cache=random_loader(f"ais://{name}", "cache", shard_cache=2))
    changes = [("target2 into maintenance", lambda: ais_maintenance("target2", root),
                lambda: _notebook_while_rebalancing("27_random_access.ipynb", endpoint)),
               ("a target joins", lambda: joined.append(ais_join(root)),
                lambda: _notebook_while_rebalancing("36_bench.access.ipynb", endpoint)),
               ("target1 decommissioned", lambda: ais_decommission("target1", root),
                lambda: _index_while_rebalancing(endpoint, name, src, capfd, loaders=later))]
    rows = []
    for what, change, meanwhile in changes:
        retries = Retries(backoff=0.1, max_backoff=1.0, wait=120)
        capfd.readouterr()
        try: keys, t_reb, said = _epochs_through(change, _loaders(name, retries), endpoint, meanwhile)
        except Exception as e: raise AssertionError(f"{what}, {time.strftime('%H:%M:%S')}: {e}") from e
        err = capfd.readouterr().err
        for k in clean: assert keys[k] == clean[k], f"{what}: the {k} epoch is not a clean one ({len(keys[k])} keys)\n{err}"
        assert "Error" not in err and "Traceback" not in err, err
        rows.append(f"| {what} | {t_reb:.0f} s | exact ({len(keys['streaming'])}) | exact ({len(keys['random'])}) | "
                    f"{retries.counts() or 'none'} | {said} |")
    states = {n["name"]: "left" if n.get("left") else "maintenance" if n.get("maintenance") else n["alive"]
              for n in ais_status(root)["nodes"] if n["role"] == "target"}
    assert states == {"target1": "left", "target2": "maintenance", joined[0]: True}, states
    print("\n| change mid-epoch | rebalance | streaming epoch | random-access epoch (cache) | retries | meanwhile |\n"
          "|---|---|---|---|---|---|\n" + "\n".join(rows))
