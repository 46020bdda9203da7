"""The private parts of dependencies that shardkit reaches into, each from one helper that says why: each test fails
when the dependency changes what its helper relies on, so that a new torch or aistore says so here, not in a loader."""
import multiprocessing, time
import torch
from torch.utils.data import DataLoader
from shardkit.stores.ais import sdk_endpoint
from shardkit.loading.collate import shared_storage
from shardkit.loading.stream import restart_workers


def test_restart_workers_stops_a_dataloaders_persistent_workers():
    "torch's `_MultiProcessingDataLoaderIter._shutdown_workers`: the workers are gone after it, and a pass starts anew."
    dl = DataLoader(list(range(8)), batch_size=4, num_workers=2, persistent_workers=True)
    assert sum(len(b) for b in dl) == 8
    workers = [p for p in multiprocessing.active_children() if p.pid in {w.pid for w in dl._iterator._workers}]
    assert len(workers) == 2
    restart_workers(dl)
    assert dl._iterator is None
    deadline = time.time() + 30
    while any(w.is_alive() for w in workers) and time.time() < deadline: time.sleep(0.05)
    assert not any(w.is_alive() for w in workers), "the workers were not stopped"
    assert sum(len(b) for b in dl) == 8  # a new pass, new workers
    restart_workers(dl)


def test_shared_storage_is_made_in_shared_memory():
    "torch's `UntypedStorage._new_shared`: storage of the size asked, in shared memory, that a tensor can be set on."
    store = shared_storage(4 * 6)
    assert store.is_shared() and store.nbytes() == 24
    x = torch.empty(0).set_(store, 0, (2, 3))
    x.fill_(1.5)
    assert x.is_shared() and x.sum().item() == 9.0


def test_sdk_endpoint_reads_an_aistore_clients_endpoint():
    "aistore's `Client._request_client.base_url`: the endpoint it was made with (no request is sent)."
    from aistore import Client
    assert sdk_endpoint(Client("http://127.0.0.1:51080")) == "http://127.0.0.1:51080"
    assert sdk_endpoint(object()) == ""  # a stand-in without one
