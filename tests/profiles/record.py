"""Re-record the profiles in this folder: `python tests/profiles/record.py` from the repository root.

The first six are real runs of `profile_pipeline` on the machine that recorded them (small synthetic Pet shards, an
ImageFolder of synthetic images, a loader the profiler cannot see into); the rest are copies of them with a few
numbers edited (their label says which) so that every verdict template is reached: a GPU present, idle cores, slow
reads, a stage that would otherwise not be the costliest. tests/test_profile.py runs the verdicts over all of them."""
import json, sys, tempfile, time
from dataclasses import replace
from pathlib import Path
import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms as T
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))
from shardkit.bench.peers import post_loader
from shardkit.ingest.folder import synthesize_folder
from shardkit import create_dataloader, create_dataset
from shardkit.loading.pipeline import create_dataloader, create_dataset
from shardkit.loading.decode import train_transform
from shardkit.profile import profile_pipeline
sys.path.insert(0, str(HERE.parent.parent / "tests"))
from conftest import write_pet_shards

step = lambda b: time.sleep(0.004)  # a stand-in GPU step: the CPU stays free


def real(tmp: Path) -> dict:
    urls = write_pet_shards(tmp / "shards", 4, 16, (320, 240), 0, True)
    sk = lambda workers, crop_decode=True: create_dataloader(create_dataset(
        urls, fields=("cls", "image.jpg", "trimap.png"), transform=train_transform(crop_decode=crop_decode), seed=0),
        num_workers=workers, batch_size=16)
    synthesize_folder(tmp / "folder", classes=4, per_class=12, val_per_class=0, progress=False)
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])
    folder = DataLoader(datasets.ImageFolder(tmp / "folder" / "train", transform=tf), batch_size=16, num_workers=2)
    opaque = [(torch.zeros(16, 3, 8, 8), torch.arange(16)) for _ in range(4)]
    gpu = create_dataloader(create_dataset(urls, fields=("cls", "image.jpg"), batch_size=16, seed=0, decode_on="gpu"),
                            num_workers=2, device="cpu")
    return {"shardkit-0-workers": profile_pipeline(sk(0), step, label="shardkit, no workers"),
            "shardkit-2-workers": profile_pipeline(sk(2), label="shardkit, 2 workers, no step"),
            "post-2-workers": profile_pipeline(post_loader(urls, num_workers=2), step, label="the post's pipeline"),
            "imagefolder": profile_pipeline(folder, step, label="an ImageFolder DataLoader"),
            "gpu-loader-on-cpu": profile_pipeline(gpu, step, label="the GPU loader on the CPU"),
            "opaque": profile_pipeline(opaque, step, label="a list of batches")}


def edited(r: dict) -> dict:
    "Copies of the real profiles with the numbers a branch needs; each label says what was edited."
    st = lambda p, **kw: {**p.stages, **{k: dict(wall=w, cpu=c) for k, (w, c) in kw.items()}}
    e = lambda name, what, **kw: replace(r[name], label=f"{r[name].label} (edited: {what})", **kw)
    busy = dict(load=99.0)
    return {
        "gpu-decode-bound": e("shardkit-2-workers", "a GPU, decode-bound, a slow copy to the GPU", gpu=True, **busy,
                              stages=st(r["shardkit-2-workers"], decode=(4.0, 4.0)),
                              main={**r["shardkit-2-workers"].main, "device": 0.5}),
        "idle-cores-add-workers": e("shardkit-2-workers", "8 idle cores, 1 worker", cores=8, load=0.0, workers=1,
                                    cpu_ms=0.01),
        "idle-cores-no-workers": e("shardkit-0-workers", "8 idle cores", cores=8, load=0.0, cpu_ms=0.01),
        "slow-reads": e("shardkit-2-workers", "slow reads that were retried", read_mb_s=0.8, **busy,
                        stages=st(r["shardkit-2-workers"], read=(50.0, 1.0)), retries={"connection cut": 1},
                        retry_wait=0.4),
        "slow-reads-many-retries": e("shardkit-0-workers", "slow reads, 3 retried, 4 idle cores", cores=4, load=0.0, read_mb_s=0.5,
                                     cpu_ms=0.01, stages=st(r["shardkit-0-workers"], read=(50.0, 1.0)),
                                     retries={"connection cut": 2, "HTTP 503": 1}, retry_wait=1.5),
        "windows-off": e("shardkit-2-workers", "windows available but off", windows="available but off", **busy),
        "windows-unavailable": e("shardkit-2-workers", "windows unavailable, a GPU", gpu=True, **busy,
                                 windows="unavailable: no libjpeg-turbo with crop and skip calls here."),
        "webdataset-decode": e("post-2-workers", "decode-bound, no rebatch", **busy,
                               stages=st(r["post-2-workers"], decode=(6.0, 6.0)),
                               main={**r["post-2-workers"].main, "rebatch": 0.0, "receive": 8.0}, rate=100.0),
        "augment-gpu": e("shardkit-2-workers", "augment-bound, a GPU", gpu=True, **busy,
                         stages=st(r["shardkit-2-workers"], augment=(5.0, 5.0))),
        "augment-no-gpu": e("shardkit-2-workers", "augment-bound", **busy,
                            stages=st(r["shardkit-2-workers"], augment=(5.0, 5.0))),
        **{f"{s}-bound": e("shardkit-2-workers", f"{s}-bound", **busy, stages=st(r["shardkit-2-workers"], **{s: (7.0, 7.0)}))
           for s in ("parse", "shuffle", "collate", "other")},
        "not-input-bound": e("shardkit-0-workers", "a slow step", wait_share=0.05, step_rate=150.0, **busy),
        "gpu-loader-device-bound": e("gpu-loader-on-cpu", "decode on the device limits, parse-bound", **busy,
                                     stages=st(r["gpu-loader-on-cpu"], parse=(3.0, 1.0)),
                                     device_stages={"copy": 0.1, "decode": 9.0, "augment": 0.5}),
        "gpu-loader-fast-device": e("gpu-loader-on-cpu", "fast device stages", **busy,
                                    device_stages={"copy": 0.01, "decode": 0.1, "augment": 0.1}),
        "input-bound-nothing-timed": e("shardkit-2-workers", "a step, nothing timed inside next()", **busy,
                                       step_rate=500.0, wait_share=0.5, main={k: 0.0 for k in r["shardkit-2-workers"].main}),
        "workers-wait-for-cores": e("shardkit-2-workers", "stages waited for a core", load=4.0,
                                    stages=st(r["shardkit-2-workers"], decode=(4.0, 1.0))),
        "small-jpegs": e("shardkit-2-workers", "96-px JPEGs for 224-px crops", **busy, image_px=96.0, out_px=224),
        "large-jpegs": e("shardkit-2-workers", "1000-px JPEGs for 224-px crops", **busy, image_px=1000.0, out_px=224),
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        r = real(Path(tmp))
    for name, p in {**r, **edited(r)}.items():
        (HERE / f"{name}.json").write_text(json.dumps(p.to_dict(), indent=1) + "\n")
        print(name, p.kind, p.bottleneck)
