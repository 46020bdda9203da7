"""The pipeline profiler (nbs/41_profile.timing, nbs/42_profile.measure): stage times that add up, verdicts that name the stage a pipeline was built
to be limited by (decoding, reading over a slow HTTP source), the same samples in the same order, and a bounded
overhead. Everything is real: webdataset, torch, a local HTTP server on 127.0.0.1, shards written here."""
import functools, http.server, json, re, shutil, threading, time
from pathlib import Path
import numpy as np
import pytest
import torch
import webdataset as wds
from torch.utils.data import DataLoader, Dataset
from shardkit import create_dataloader, create_dataset
from shardkit.loading.decode import train_transform
from dataclasses import replace
from shardkit.loading.gpu_decode import why_no_gpu
from shardkit.loading.pipeline import create_dataloader, create_dataset
from shardkit.loading.jpeg import why_no_window_decode
from shardkit.profile import Profile, build_loader, profile_overhead, profile_pipeline, profile_report, suggested_change, verdicts
from shardkit.profile.timing import SLOTS
from conftest import main_cli, write_pet_shards


def _write(folder: Path, n_shards: int, per_shard: int, size, *, seed=0, trimap=True):
    return write_pet_shards(folder, n_shards, per_shard, size=size, seed=seed, trimap=trimap)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    "Small Pet-like shards: 6 x 10 samples of 320 x 240."
    return _write(tmp_path_factory.mktemp("profile") / "shards", 6, 10, (320, 240))


def _loader(urls, workers=2, seed=0, batch_size=8, **kw):
    kw.setdefault("fields", ("__key__", "cls", "image.jpg"))
    return create_dataloader(create_dataset(urls, seed=seed, transform=train_transform(64), **kw),
                             num_workers=workers, batch_size=batch_size)


def test_the_stage_clocks_leave_little_of_the_loop_untimed(shards):
    """With no workers every stage runs inside the loop. The parts add up to the loop's wall time by construction
    (`untimed` is the wall time less the others: checked, but it cannot fail); what can fail is the size of that
    rest: the stages' clocks claim all but 5% of the loop, plus 20 ms for one scheduler stall landing there on a
    machine shared with other jobs (the run takes about half a second)."""
    p = profile_pipeline(_loader(shards * 2, workers=0), step=lambda b: time.sleep(0.003))
    per_sample = sum(v["wall"] for v in p.stages.values()) + p.main["device"] + p.main["step"] + p.main["untimed"]
    assert per_sample * p.samples / 1000 == pytest.approx(p.wall, rel=1e-6)  # by construction
    untimed = p.main["untimed"] * p.samples / 1000
    assert -1e-6 < untimed < 0.05 * p.wall + 0.02, (untimed, p.wall, p.main)
    fused = why_no_window_decode() is None  # the crop decoded, resized and flipped in one pass: all of it "decode"
    for slot in ("read", "parse", "decode", "collate") + ("augment",) * (not fused):
        assert p.stages[slot]["wall"] > 0, (slot, p.stages)
    assert p.samples == 120 and p.stages["read"]["cpu"] <= p.stages["read"]["wall"] * 1.05 + 0.01


def test_worker_stage_cpu_is_within_the_workers_cpu(shards):
    "With workers, the stages' CPU (their threads) is no more than the CPU of all processes, and most of the workers' part."
    p = profile_pipeline(_loader(shards, workers=2))
    stage_cpu = sum(v["cpu"] for k, v in p.stages.items() if k != "rebatch")
    assert 0 < stage_cpu <= p.cpu_ms * 1.05, (stage_cpu, p.cpu_ms)
    assert p.main["wait"] > 0 and p.capacity > 0


def _keys(loader, profiled: bool, epochs=2) -> list:
    out = []
    for e in range(epochs):
        got = []
        if profiled and e == 0: profile_pipeline(loader, step=lambda b: got.extend(b[0]))
        else: got = [k for b in loader for k in b[0]]
        out.append(got)
    return out


@pytest.mark.parametrize("access", ["stream", "random"])
@pytest.mark.parametrize("workers", [0, 2])
def test_profiling_keeps_samples_order_and_epoch(shards, workers, access):
    "A profiled epoch gives what an unprofiled loader with the same seed gives, and the next epoch is the same too."
    make = lambda: _loader(shards, workers, seed=5, access=access)
    plain, profiled = _keys(make(), False), _keys(make(), True)
    assert profiled == plain and len(set(plain[0])) == 60 and plain[0] != plain[1]
    p = profile_pipeline(make())
    assert p.kind == "shardkit" and p.stages["read"]["wall"] > 0 and p.stages["decode"]["wall"] > 0, p.stages


def test_profiling_keeps_a_plain_webdataset_pipeline_and_a_dataloader(shards):
    "The same for a plain webdataset pipeline in a WebLoader, and for a map-style torch DataLoader (stages timed in both)."
    make = lambda: wds.WebLoader(wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode("torchrgb")
                                 .to_tuple("__key__", "cls", "image.jpg").batched(8), num_workers=2, batch_size=None)
    got = []
    p = profile_pipeline(make(), step=lambda b: got.extend(b[0]))
    assert got == [k for b in make() for k in b[0]] and p.kind == "webdataset" and p.stages["decode"]["wall"] > 0
    ds = _Files(shards)
    plain = [k for b in DataLoader(ds, batch_size=8, num_workers=2) for k in b[0]]
    got = []
    p = profile_pipeline(DataLoader(ds, batch_size=8, num_workers=2), step=lambda b: got.extend(b[0]))
    assert got == plain and p.kind == "map-style" and p.stages["decode"]["wall"] > 0 and p.stages["augment"]["wall"] > 0
    assert not p.files  # its items are bytes in memory, not files


class _Files(Dataset):
    "A map-style dataset as torchvision's DatasetFolder is: `loader` reads and decodes, `transform` augments."
    def __init__(self, urls):
        self.items = [(s["__key__"], s["jpg" if "jpg" in s else "image.jpg"]) for s in wds.WebDataset(urls, shardshuffle=False)]
        self.transform = train_transform(64)
    def loader(self, data): return torch.from_numpy(np.frombuffer(data, np.uint8).copy())
    def __len__(self): return len(self.items)
    def __getitem__(self, i):
        from torchvision.io import decode_jpeg
        key, data = self.items[i]
        return key, self.transform(decode_jpeg(self.loader(data)))


@pytest.mark.slow
def test_a_decode_bound_pipeline_is_named_decoding(tmp_path):
    "Large JPEGs, one worker, a fast step: the verdict names decoding."
    urls = _write(tmp_path / "big", 2, 8, (1600, 1200), trimap=False)
    p = profile_pipeline(_loader(urls, workers=1, fields=("cls", "image.jpg"), batch_size=4), step=lambda b: time.sleep(0.001))
    v = verdicts(p)
    assert p.bottleneck == "decode" and any(line.startswith("decode is") for line in v), profile_report(p)
    assert v[0].startswith("input-bound"), v


class _SlowHandler(http.server.SimpleHTTPRequestHandler):
    "Serves files 16 KB at a time with a pause between pieces: a slow object store."
    def copyfile(self, source, outputfile):
        while chunk := source.read(16384):
            outputfile.write(chunk); outputfile.flush(); time.sleep(0.02)
    def log_message(self, *args): pass


@pytest.fixture
def slow_http(tmp_path):
    "A real HTTP server on 127.0.0.1 serving tmp_path/www slowly; stopped after the test."
    root = tmp_path / "www"; root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_SlowHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try: yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown(); server.server_close(); thread.join(10)


@pytest.mark.slow
def test_a_read_bound_pipeline_is_named_reading(slow_http):
    "Small images behind a slow HTTP source: the verdict names reading, and that the reads wait."
    if not shutil.which("curl"): pytest.skip("webdataset opens HTTP URLs with curl: apt-get install curl")
    root, base = slow_http
    paths = _write(root, 2, 12, (64, 48), trimap=False)
    urls = [f"{base}/{Path(p).name}" for p in paths]
    p = profile_pipeline(_loader(urls, workers=1, fields=("cls", "image.jpg"), batch_size=4))
    v = verdicts(p)
    assert p.bottleneck == "read" and any(line.startswith("read is") and "reads wait" in line for line in v), profile_report(p)
    assert p.read_mb_s is not None and p.read_mb_s < 2, p.read_mb_s


@pytest.mark.slow
@pytest.mark.timed
def test_overhead_is_bounded(tmp_path):
    """Plain and profiled runs interleaved: the profiler costs little CPU per sample and does not slow the loader
    grossly. CPU per sample is measured with the stages in the main process: the profiler adds the same clock readings
    per stage there as in a worker, while a worker's CPU also counts its start and hand-over, whose noise on 2 shared
    cores (up to 15% between identical runs) would hide what is measured; its bound is 10% (the goal is 5%).
    Throughput is measured as used, with 2 loader workers, best run against best run of nine pairs of each (a run takes
    about a quarter of a second). Its figure is a benchmark's to report (`shardkit profile --overhead` prints its
    cost): inside the full suite the other worker's tests swing these short runs by 20% and more either way (measured:
    best against best from -5% to +20% between runs of the same code), so the test bounds it at half, several times
    the goal, which a profiler that serialised the workers or stalled the loop would still fail."""
    urls = _write(tmp_path / "ov", 8, 25, (500, 375))
    o = profile_overhead(lambda: _loader(urls, workers=2, batch_size=16, fields=("cls", "image.jpg")), repeats=9)
    c = profile_overhead(lambda: _loader(urls, workers=0, batch_size=16, fields=("cls", "image.jpg")), repeats=9)
    print("overhead", o["overhead"], "cpu", c["cpu_overhead"], c["cpu_runs"])
    best = 1 - max(o["runs"]["profiled"]) / max(o["runs"]["plain"])
    cpu = min(c["cpu_runs"]["profiled"]) / min(c["cpu_runs"]["plain"]) - 1
    assert best < 0.5 and cpu < 0.10, (best, cpu, o, c)


def test_cli_profiles_and_tries_a_change(shards, tmp_path):
    r = main_cli("profile", str(Path(shards[0]).parent), "--batches", "3", "--batch-size", "8", "--try", "workers=1",
                 "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "verdict: " in r.stdout and "tried default, 1 workers" in r.stdout, r.stdout
    assert (tmp_path / "out" / "stages.png").exists() and (tmp_path / "out" / "timeline.png").exists()
    bad = main_cli("profile", str(Path(shards[0]).parent), "--try", "threads=3")
    assert bad.returncode == 2 and "--try takes name=value pairs" in bad.stderr, bad.stderr


def test_the_transfer_to_the_device_is_timed_and_the_step_gets_the_moved_batch(shards):
    "With a device, each batch is moved before the step (here to the CPU: the same path as to a GPU, synchronised there)."
    seen = []
    p = profile_pipeline(_loader(shards, workers=0), step=lambda b: seen.append(b[2].device.type), device="cpu")
    assert p.main["device"] > 0 and set(seen) == {"cpu"} and len(seen) == p.batches, p.main


def _made_up(kind="shardkit", workers=2, cores=2, load=99.0, windows="used", **stages):
    "A Profile with the numbers a test chooses (from a real one): by default decode-bound, on cores kept busy."
    st = {s: dict(wall=0.1, cpu=0.1) for s in SLOTS}
    st["decode"] = dict(wall=2.0, cpu=2.0)
    st.update(stages)
    return replace(_made_up.base, kind=kind, workers=workers, cores=cores, load=load, windows=windows, stages=st,
                   cpu_ms=0.01)


@pytest.fixture(scope="module")
def _base_profile(shards):
    _made_up.base = profile_pipeline(_loader(shards, workers=0), batches=1)


def test_suggested_change_follows_the_verdicts(_base_profile):
    "What `--try auto` profiles, for each situation the verdicts name: it must change with the numbers, not be fixed."
    assert suggested_change(_made_up(read=dict(wall=50.0, cpu=1.0))) == dict(num_workers=4)  # reads that wait: 2x readers
    assert suggested_change(_made_up(workers=0, read=dict(wall=50.0, cpu=1.0))) == dict(num_workers=2)
    assert suggested_change(_made_up(read=dict(wall=50.0, cpu=45.0))) != dict(num_workers=4)  # reads on a core: work
    assert suggested_change(_made_up(load=0.0, workers=1, cores=8)) == dict(num_workers=8)  # idle cores: a worker each
    assert suggested_change(_made_up(load=7.8, workers=1, cores=8)) != dict(num_workers=8)  # cores busy with other jobs
    assert suggested_change(_made_up(kind="webdataset")) == dict(pipeline="default")
    assert suggested_change(_made_up(windows="available but off")) == dict(pipeline="default")
    on_gpu = dict(pipeline="gpu") if why_no_gpu() is None else dict(num_workers=3)  # decode-bound: the GPU if any
    assert suggested_change(_made_up()) == on_gpu
    waited = _made_up(other=dict(wall=12.0, cpu=0.1))  # a stage that mostly waited for a core: not the one to blame
    assert waited.bottleneck == "decode" and suggested_change(waited) == on_gpu
    header_bound = _made_up(kind="gpu", decode=dict(wall=0.0, cpu=0.0), header=dict(wall=3.0, cpu=3.0))
    assert suggested_change(header_bound) == dict(num_workers=3)


def test_report_says_whether_windows_were_used(shards):
    "`windows: used` when the crop windows were decoded; `available but off` for the same loader decoding whole JPEGs."
    why = why_no_window_decode()
    used, whole = (profile_pipeline(build_loader(shards, p, num_workers=0, batch_size=8), batches=2)
                   for p in ("default", "whole"))
    expected = ("used", "available but off") if why is None else (f"unavailable: {why}",) * 2
    assert (used.windows, whole.windows) == expected
    assert "windows: " + used.windows in profile_report(used) and "the first batch after" in profile_report(used)
    assert used.steady_rate is not None and whole.kind == used.kind == "shardkit"


def _gpu_keys(urls, device, profiled: bool, **kw):
    g = create_dataloader(create_dataset(urls, fields=("__key__", "cls", "image.jpg"), batch_size=8, seed=3,
                                         decode_on="gpu"), num_workers=2, device=device, **kw)
    got = []
    if not profiled: return [k for b in g for k in b[0]], None
    return got, (profile_pipeline(g, step=lambda b: got.extend(b[0]), label=f"gpu loader on {device}"), g)


def _check_gpu_profile(shards, device):
    plain, _ = _gpu_keys(shards, device, False)
    got, (p, g) = _gpu_keys(shards, device, True)
    assert got == plain and len(set(got)) == 60, "profiling changed the GPU loader's samples"
    assert p.kind == "gpu" and p.workers == 2 and p.samples == 60, profile_report(p)
    for s in ("read", "parse", "header", "collate"): assert p.stages[s]["wall"] > 0, (s, profile_report(p))
    assert p.stages["decode"]["wall"] == 0 and "not visible" not in profile_report(p), profile_report(p)
    assert {"copy", "decode", "augment"} <= set(p.device_stages), profile_report(p)
    assert all(v > 0 for v in p.device_stages.values()), profile_report(p)
    assert g.time_device is False and not g.device_events, "profiling leaves the loader's timing as it found it"
    assert "device: decode" in profile_report(p) and "workers: header" in profile_report(p), profile_report(p)
    return p


def test_the_gpu_loader_on_the_cpu_is_profiled_stage_by_stage(shards):
    "The GPU loader's path on the CPU: its workers' stages timed and counted, its samples unchanged, its device stages."
    _check_gpu_profile(shards, "cpu")


@pytest.mark.skipif(why_no_gpu() is not None, reason=f"needs a CUDA GPU with nvJPEG: {why_no_gpu()}")
def test_the_gpu_loader_on_cuda_is_profiled_stage_by_stage(shards):
    "On a GPU: the same, and the copy, decode and augmentation on the device timed by the loader's CUDA events."
    p = _check_gpu_profile(shards, "cuda")
    assert p.workers == 2 and p.device_stages["decode"] > 0, profile_report(p)  # queued inside next(), timed on the GPU


def test_cli_profiles_the_gpu_pipeline_on_the_cpu(shards, tmp_path):
    r = main_cli("profile", str(Path(shards[0]).parent), "--pipeline", "gpu", "--device", "cpu", "--batches", "3",
                 "--batch-size", "8", "--try", "pipeline=default", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "gpu, 2 workers on cpu: " in r.stdout and "workers: header" in r.stdout, r.stdout
    assert "tried default, 2 workers" in r.stdout, r.stdout


def test_the_gpu_loaders_device_stages_inside_next_are_accounted(shards):
    """No workers and no prefetching: the GPU loader's whole path runs inside `next()`, its worker stages and its device
    stages one after the other, so together with the step they leave little of the loop untimed (the same bound as
    the CPU pipeline's); device stages counted twice would make the rest negative, left out would make it large."""
    g = create_dataloader(create_dataset(shards, fields=("cls", "image.jpg"), batch_size=8, seed=0, decode_on="gpu"),
                          num_workers=0, device="cpu", prefetch=0)
    p = profile_pipeline(g, step=lambda b: time.sleep(0.003))
    assert p.workers == 0 and p.samples == 60, profile_report(p)
    assert p.device_stages["decode"] > 0 and p.device_stages["augment"] > 0, profile_report(p)
    untimed = p.main["untimed"] * p.samples / 1000
    assert -1e-6 < untimed < 0.05 * p.wall + 0.02, (untimed, p.wall, profile_report(p))


PROFILES = sorted((Path(__file__).parent / "profiles").glob("*.json"))  # recorded by tests/profiles/record.py
_TEMPLATES = {  # every sentence a verdict can say, by a fragment only it has
    "no step": r"^no step given: the loader delivered", "input-bound": r"^input-bound: \d+% of the loop",
    "not input-bound": r"^not input-bound: \d+% of the loop", "copy": r"^copying each batch to the device takes",
    "device stages": r"^the loader's device stages take", "device limits": r"fewer than its workers could deliver",
    "device fast": r"samples/s from them alone\.$", "bottleneck": r"^[a-z]+ is \d+% of the (workers'|pipeline's) work",
    "reads wait": r"; reads wait \d+% of it", "no workers in next": r"\(no workers: the pipeline itself runs inside",
    "nothing timed": r"\(nothing timed\)", "readers": r"^More readers: more workers",
    "windows unavailable": r"^Window decoding is unavailable", "windows off": r"^Decode only the crop's window",
    "webdataset decode": r"^Decode only the fields the step uses", "gpu decode": r"^Decode on the GPU \(nvJPEG",
    "smaller jpegs": r"^Decode smaller JPEGs", "small jpegs": r"^The JPEGs are small already \(\d+ px a side for ",
    "gpu loader workers": r"^The GPU loader's workers only parse",
    "augment gpu": r"^Keep images uint8 and normalise on the GPU",
    "augment no gpu": r"^Keep images uint8 and normalise whole batches in the step", "parse": r"^Tar parsing is per",
    "shuffle": r"^The shuffle buffer holds", "collate": r"^Keep images uint8 \(a quarter",
    "other": r"^It is a stage the profiler does not know", "to workers": r"^Run the pipeline in worker processes",
    "add workers": r"^Add workers \(\d+\.\d of \d+ cores are idle\)", "no more workers": r"^More workers would not help",
    "core waits": r"^the workers waited for a core", "rebatch": r"^the main process spends",
    "receive": r"^receiving the workers' batches", "one retry": r"^1 read was retried .* spent on it:",
    "retries": r"^\d+ reads were retried .* spent on them:", "opaque": r"^the loader's stages are not visible",
    "files": r"^the DataLoader opens one file per sample", "few batches": r"^only \d+ batch(es)? profiled",
}
_STARTS = ("no", "input-bound", "not", "copying", "receiving", "the", "only", *SLOTS)  # lower-case first words a verdict may begin with


def _sentences(verdict: str) -> list[str]:
    "A verdict's sentences: it breaks after a period followed by a capital."
    return re.split(r"(?<=\.) (?=[A-Z])", verdict)


def _grammar(s: str) -> list[str]:
    "What is wrong with sentence `s`, if anything."
    bad = [] if s[:1].isupper() or s.split()[0].rstrip(":") in _STARTS or s[:1].isdigit() else ["first word"]
    bad += [] if s.endswith(".") and not s.endswith("..") else ["no period at the end"]
    bad += [w for w in ("; or (", "None", "nan", "inf ", "np.", "()", "( ", " )", ", ,", ",.", ":.", ";.", " ,")
            if w in s.replace("next()", "next")]  # next() is a call, not an empty list
    bad += [f"doubled {m.group(0)!r}" for m in re.finditer(r"\b(\w+) \1\b", s, re.I)]
    bad += [] if s.count("(") == s.count(")") and s.count("`") % 2 == 0 else ["unbalanced ( or `"]
    bad += [f"unformatted {m.group(0)}" for m in re.finditer(r"\d\.\d{4,}|\b\d{4,}\b|-\d+%", s)]
    bad += [] if re.search(r"\b1 (workers|reads|cores are)\b", s) is None else ["1 with a plural"]
    return bad


def test_every_verdict_sentence_reads_well_and_every_template_is_reached():
    """The verdicts of recorded profiles (real runs on this machine, and copies with numbers edited to reach each
    branch: tests/profiles/record.py), sentence by sentence: grammar, numbers formatted, each sentence one of the
    known templates, every template reached; GPU advice only where the profile had a GPU, shards for files."""
    assert len(PROFILES) >= 20, PROFILES
    reached, wrong = set(), []
    for path in PROFILES:
        p = Profile(**json.loads(path.read_text()))
        vs = verdicts(p)
        for s in (s for v in vs for s in _sentences(v)):
            hits = {name for name, rx in _TEMPLATES.items() if re.search(rx, s)}
            reached |= hits
            wrong += [(path.name, why, s) for why in _grammar(s) + ["no template"] * (not hits)]
        text = " ".join(vs)
        assert ("on the GPU" in text or "nvJPEG" in text or "side stream" in text) <= p.gpu, (path.name, text)
        assert ("convert the folder to shards" in text) == p.files, (path.name, text)
        assert repr(p) == profile_report(p) and "np." not in repr(p) and p._repr_markdown_().startswith("```\n"), path.name
    assert not wrong, "\n".join(map(str, wrong))
    assert reached == set(_TEMPLATES), f"templates no recorded profile reaches: {set(_TEMPLATES) - reached}"
    assert Profile(**json.loads(PROFILES[0].read_text())).to_dict() == json.loads(PROFILES[0].read_text())


def test_a_dataloader_over_files_is_known_and_advised_shards(tmp_path):
    "A torchvision ImageFolder in a DataLoader: the profile knows it reads files and says what shards would change."
    from torchvision import datasets, transforms as T
    from shardkit.ingest.folder import synthesize_folder
    synthesize_folder(tmp_path, classes=2, per_class=2, val_per_class=0, progress=False)
    dl = DataLoader(datasets.ImageFolder(tmp_path / "train", transform=T.Compose([T.Resize((32, 32)), T.ToTensor()])),
                    batch_size=2)
    p = profile_pipeline(dl, device=None)
    assert p.kind == "map-style" and p.files and type(p.rate) is float and p.gpu == torch.cuda.is_available(), p
    assert any(v.startswith("the DataLoader opens one file per sample") for v in verdicts(p)), profile_report(p)
    assert repr(p) == profile_report(p) and "np.float64" not in repr(p.to_dict()), repr(p)
