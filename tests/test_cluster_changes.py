"""The cluster changes under an epoch, on a real local AIStore of its own: a target goes into maintenance, a target
joins, a target is decommissioned, each in the middle of an epoch of a streaming loader and of a random-access loader
(the default for `ais://`: the shard cache) read side by side. Each change starts a rebalance (about 45 s here);
both epochs wait half-way until it is over (the target has left or holds its objects), so each reads before, during
and after the change. Both epochs are exactly a clean epoch's samples, in its order, with no error."""
import json, time, uuid
from pathlib import Path
import pytest
from test_faults import keys_of, random_loader, stream_keys
from test_faults_ais import NAMES, write_shards
from shardkit.remote import Retries

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("aistore-changes")]  # (tests/conftest.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    "A cluster of its own: the changes leave it with other targets than it started with."
    from conftest import _start_cluster, _stop_cluster
    c = _start_cluster(tmp_path_factory, "ais-changes")
    yield c
    _stop_cluster(c, request)


@pytest.fixture(scope="module")
def data(cluster, tmp_path_factory):
    "8 shards in a bucket of the cluster; a clean epoch's keys for each loader, read from the local files."
    from shardkit.apps.cluster import ais_put
    src = write_shards(tmp_path_factory.mktemp("changes") / "shards")
    name = f"changes-{uuid.uuid4().hex[:8]}"
    ais_put(src, f"ais://{name}", endpoint=cluster["endpoint"], quiet=True)
    clean = dict(streaming=stream_keys([str(src / n) for n in NAMES]),
                 random=keys_of(random_loader(str(src), "cache", workers=0, shard_cache=2)))
    return name, clean


def _loaders(name: str, retries: Retries) -> dict:
    "A streaming and a random-access loader over the bucket, 2 workers each, batches of 16 (as the clean epochs)."
    from shardkit.loader import create_dataloader, create_dataset
    ds = create_dataset(f"ais://{name}", fields=("__key__", "cls"), seed=0, batch_size=16, shuffle=50,
                        retry_wait=retries)
    return dict(streaming=create_dataloader(ds, num_workers=2, batch_size=16),
                random=random_loader(f"ais://{name}", "cache", retry_wait=retries, shard_cache=2))


def _epochs_through(change, loaders: dict, endpoint: str) -> tuple[dict, float]:
    """Both loaders' epochs side by side, batch by batch (a slow consumer: their workers wait at their prefetch);
    `change()` after each has yielded its first batch; after 4 more, both wait until the rebalance is over, then end.
    The keys of each epoch, and the seconds the rebalance ran."""
    from shardkit.apps.cluster import await_rebalance
    its, keys, t_reb = {k: iter(v) for k, v in loaders.items()}, {k: [] for k in loaders}, 0.0
    for step in range(10_000):
        for k in list(its):
            try: keys[k] += next(its[k])[0]
            except StopIteration: del its[k]
        if not its: return keys, t_reb
        if step == 0: change(); t0 = time.monotonic()
        if step == 4: await_rebalance(endpoint, timeout=300); t_reb = time.monotonic() - t0
        time.sleep(0.05)


def test_maintenance_join_and_decommission_mid_epoch(cluster, data, monkeypatch, capfd):
    from shardkit.apps.cluster import ais_decommission, ais_join, ais_maintenance, ais_status
    monkeypatch.setenv("AIS_ENDPOINT", cluster["endpoint"])
    name, clean = data
    root, joined = cluster["root"], []
    changes = [("target2 into maintenance", lambda: ais_maintenance("target2", root)),
               ("a target joins", lambda: joined.append(ais_join(root))),
               ("target1 decommissioned", lambda: ais_decommission("target1", root))]
    rows = []
    for what, change in changes:
        retries = Retries(backoff=0.1, max_backoff=1.0, wait=120)
        capfd.readouterr()
        keys, t_reb = _epochs_through(change, _loaders(name, retries), cluster["endpoint"])
        err = capfd.readouterr().err
        for k in clean: assert keys[k] == clean[k], f"{what}: the {k} epoch is not a clean one ({len(keys[k])} keys)\n{err}"
        assert "Error" not in err and "Traceback" not in err, err
        rows.append(f"| {what} | {t_reb:.0f} s | exact ({len(keys['streaming'])}) | exact ({len(keys['random'])}) | "
                    f"{retries.counts() or 'none'} |")
    st = ais_status(root)
    states = {n["name"]: "left" if n.get("left") else "maintenance" if n.get("maintenance") else n["alive"]
              for n in st["nodes"] if n["role"] == "target"}
    assert states == {"target1": "left", "target2": "maintenance", joined[0]: True}, states
    print("\n| change mid-epoch | rebalance | streaming epoch | random-access epoch (cache) | retries |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps(states))
