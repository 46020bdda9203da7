"""What a newcomer meets in the first hour, each case run as a user runs it: the command's words and exit status.
Fast cases go through the command's own entry point in this process (`main_cli`); a real process (`run_cli`) where
the time a run takes, or what a terminal shows, is the point."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
import numpy as np
import pytest
from PIL import Image
from conftest import main_cli, run_cli


def photo_tree(root: Path, n: int = 8, classes=("cat", "dog")) -> Path:
    "A folder of `n` small JPEGs in one folder per class, as people's photo folders look (no train/ in it)."
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / classes[i % len(classes)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"IMG_{i:04d}.jpg")
    return root


# Options exactly: no prefixes, a wrong option in one line with the closest, an unknown command without its options
@pytest.mark.parametrize("wrong, meant", [("--epocs", "--epochs"), ("--epoch", "--epochs"), ("--shard", "--shards")])
def test_a_wrong_option_is_one_line_with_the_closest(wrong, meant):
    r = main_cli("train", wrong, "1")
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines() == [f"shardkit train: unknown option {wrong}; did you mean {meant}? "
                                             "(`shardkit train --help` lists its options)"], r.stderr


def test_an_unknown_command_is_named_without_its_options():
    r = main_cli("trian", "--shards", "x")
    assert r.returncode == 2
    assert "unknown command 'trian'; did you mean 'shardkit train'?" in r.stderr, r.stderr


# One way to name data: train takes a positional source as convert and profile do; an image tree is trained on
def test_train_takes_its_source_first(tmp_path):
    tree = photo_tree(tmp_path / "mydata")
    r = main_cli("train", tree, "--max-steps", 1, "--workers", 0, "--size", 32, "--batch-size", 4)
    assert r.returncode == 0, r.stderr
    assert "training small on folder: 2 classes" in r.stdout, r.stdout  # the README's own-data tree, no train/ in it
    r = main_cli("train", tree, "--shards", tree)
    assert r.returncode == 2 and "SRC" in r.stderr and "both given: give one" in r.stderr, r.stderr
    r = main_cli("train", tree, tree)
    assert r.returncode == 2 and "takes one SRC at most" in r.stderr, r.stderr


def test_a_folder_of_images_is_named_as_one(tmp_path):
    tree = photo_tree(tmp_path / "mydata")
    r = main_cli("profile", tree)
    assert r.returncode == 1, r
    assert f"{tree} holds images, not shards: make shards of them first, `shardkit convert folder {tree} " \
           f"{tree}-shards`" in r.stderr, r.stderr
    from shardkit import create_dataset
    with pytest.raises(Exception, match="holds images, not shards: make shards of them first"): create_dataset(tree)
    (tmp_path / "notes").mkdir(); (tmp_path / "notes" / "a.txt").write_text("x")
    r = main_cli("train", "--folder", tmp_path / "notes")
    assert r.returncode == 2 and "holds no images: an image tree is ROOT/<class>/*.jpg" in r.stderr, r.stderr


# No wait without a word: the first fault said at once, with the host; what cannot succeed ends within seconds
def closed_port() -> int:
    "A port on 127.0.0.1 that nothing listens on (bound, then let go)."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_first_fault_is_said_at_once():
    port = closed_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "shardkit.apps.cli", "train", "s3://mybucket/mydata"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stderr.readline()  # the first fault is met right after start-up: its line comes then, not later
        took = time.monotonic() - t0
    finally:
        proc.kill(); proc.wait()
    assert line.startswith(f"shardkit: cannot connect to 127.0.0.1:{port} (connection refused), listing "
                           "s3://mybucket/mydata/: retrying for up to 2 min; the endpoint is "
                           f"http://127.0.0.1:{port} ($AWS_ENDPOINT_URL)"), line
    assert took < 30, took  # start-up (torch) and one attempt: seconds, not the 120 s bound


@pytest.mark.slow
def test_a_host_that_does_not_resolve_ends_within_seconds():
    t0 = time.monotonic()
    r = run_cli("train", "s3://mybucket/mydata", env={"AWS_ENDPOINT_URL": "http://nosuchhost.invalid:9000"}, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 1, r
    assert "shardkit: the host name nosuchhost.invalid:9000 does not resolve, listing s3://mybucket/mydata/: " \
           "retrying for up to 5 s" in r.stderr, r.stderr
    assert "gave up listing s3://mybucket/mydata/" in r.stderr and "check the URL and the network" in r.stderr
    assert r.stderr.count("does not resolve, listing") == 1, r.stderr  # said once
    assert took < 15 + 10, took  # 5 s of tries after start-up (several seconds on a loaded machine)


def test_giving_up_advises_the_command_line(monkeypatch):
    from shardkit.remote import DEFAULT_RETRIES
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    r = main_cli("train", "s3://mybucket/mydata", "--retry-wait", 1)
    assert r.returncode == 1 and time.monotonic() - t0 < 20, r
    assert "gave up listing s3://mybucket/mydata/" in r.stderr, r.stderr
    assert "run `shardkit train` again (with --checkpoint PATH it goes on from its last one); a longer bound is " \
           "--retry-wait SECONDS (now 1 s)" in r.stderr, r.stderr
    assert "load_state_dict" not in r.stderr and DEFAULT_RETRIES.wait == 120, r.stderr  # the bound: this run's only


# Files as the user's umask says: shards and the manifest readable by others under 022, private under 077
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_shards_are_written_as_the_umask_says(tmp_path, umask, mode):
    tree = photo_tree(tmp_path / "mydata")
    old = os.umask(umask)
    try: r = main_cli("convert", "folder", tree, tmp_path / "myshards")
    finally: os.umask(old)
    assert r.returncode == 0, r.stderr
    written = sorted((tmp_path / "myshards").iterdir())
    assert any(p.suffix == ".tar" for p in written) and any(p.suffix == ".json" for p in written), written
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in written}
    assert set(modes.values()) == {oct(mode)}, modes


# The command line says what the library says: workers beyond the work, in shardkit's words, once
def test_workers_beyond_the_work_are_said_once(tmp_path):
    shards = tmp_path / "few"
    assert main_cli("convert", "folder", photo_tree(tmp_path / "mydata"), shards,
                    "--maxcount", 4).returncode == 0  # 2 shards
    cores = len(os.sched_getaffinity(0))
    r = main_cli("train", shards, "--workers", cores + 2, "--max-steps", 1, "--size", 32)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"--workers {cores + 2} is more than the 1 batch of an epoch can keep busy: 1 worker per "
                          "rank will read") == 1, r.stdout
    assert "1 worker per rank, device" in r.stdout, r.stdout
    r = main_cli("train", shards, "--workers", cores + 2, "--max-steps", 1, "--size", 32, "--pipeline", "example")
    assert r.returncode == 0, r.stderr
    assert "shards can keep busy (a worker reads whole shards)" in r.stdout, r.stdout
    assert "This DataLoader will create" not in r.stderr, r.stderr  # torch's own warning: not shown


# Output for people: the chosen fields said once; no bar's carriage returns where the output is not a terminal
def test_the_chosen_fields_are_said_once(tmp_path, capsys):
    from shardkit import create_dataset
    shards = tmp_path / "myshards"
    assert main_cli("convert", "folder", photo_tree(tmp_path / "mydata"), shards, "--maxcount", 4).returncode == 0
    capsys.readouterr()
    for _ in range(3): create_dataset(shards)
    assert capsys.readouterr().out.count("fields=('cls', 'jpg'): the fields every sample has") == 1


def test_progress_is_not_drawn_into_a_file(tmp_path):
    r = main_cli("convert", "folder", photo_tree(tmp_path / "mydata"), tmp_path / "myshards")  # into a StringIO
    assert r.returncode == 0, r.stderr
    assert "8 samples in" in r.stdout, r.stdout
    assert "\r" not in r.stdout + r.stderr, (r.stdout + r.stderr)[:500]  # tqdm draws bars only on a terminal


# Verdicts checked against the case they name: each on a profile built to trigger it, and on one built not to
def test_the_decode_and_idle_core_verdicts_fit_the_case(tmp_path):
    from dataclasses import replace
    from shardkit.profile import profile_shards
    from shardkit.profile.verdicts import verdicts
    shards = tmp_path / "myshards"
    assert main_cli("convert", "folder", photo_tree(tmp_path / "mydata"), shards, "--maxcount", 4).returncode == 0
    p = profile_shards(str(shards), num_workers=0, batch_size=4, out=tmp_path / "pictures")["profiles"][0]
    assert (p.image_px, p.out_px) == (48, 224), p  # the photos' side, read from their headers; the crops' side
    decode_bound = replace(p, stages={**p.stages, "decode": dict(wall=9.0, cpu=9.0)}, gpu=False,
                           windows="used", cores=2, load=0.0, cpu_ms=0.01, workers=1)
    text = " ".join(verdicts(decode_bound))
    assert "The JPEGs are small already (48 px a side for 224-px crops)" in text and "Decode smaller" not in text, text
    text = " ".join(verdicts(replace(decode_bound, image_px=1000.0)))
    assert "Decode smaller JPEGs (1,000 px a side for 224-px crops): resize them once" in text, text
    busy = lambda load, cores_busy: replace(decode_bound, load=load, cpu_ms=cores_busy * p.wall * 1000 / p.samples)
    text = " ".join(verdicts(busy(1.7, 1.3)))  # 1.3 of 2 busy, the load average the rest
    assert "no core is idle (this job keeps 1.3 of 2 busy; the load average, 1.7, counts the processes waiting " \
           "for a core too" in text, text
    text = " ".join(verdicts(busy(0.3, 0.3)))  # cores idle: more workers, not "would not help"
    assert "More workers would not help" not in text and "Add workers (1.7 of 2 cores are idle)" in text, text


# The rest of the list: the docs site opens on the tutorials; tutorial 03 says what create_dataset returns
ROOT = Path(__file__).resolve().parents[1]


def test_the_tutorials_come_right_after_the_index():
    from shardkit.docs.pages import site_nav
    nav = site_nav(ROOT / "nbs")
    assert [next(iter(d)) for d in nav[:2]] == ["shardkit", "Tutorials"], [next(iter(d)) for d in nav]


def test_tutorial_03_says_what_create_dataset_gives():
    import json
    nb = json.loads((ROOT / "nbs" / "tutorials" / "03_training_loader.ipynb").read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "batches of 64 (`batch_size=`). It returns a `ShardDataset`" in text
    assert "plain `webdataset.DataPipeline`" not in text


def test_a_bucket_that_needs_credentials_is_refused_at_once(monkeypatch):
    "A store that answers 403 to unsigned requests: said at once, with where credentials come from; not retried."
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class Denied(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            self.send_response(403); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args): pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Denied)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"): monkeypatch.setenv(k, "/nonexistent")
    try:
        t0 = time.monotonic()
        r = main_cli("train", "s3://mybucket/mydata")
        took = time.monotonic() - t0
    finally: server.shutdown()
    assert r.returncode == 1 and took < 30, (r, took)  # about 1 s on a quiet machine: one listing, refused
    assert "access denied (HTTP 403 AccessDenied)" in r.stderr and "give credentials: AWS_ACCESS_KEY_ID" in r.stderr, \
        r.stderr
    assert "retrying" not in r.stderr, r.stderr


def test_warnings_are_the_commands_lines_each_once(tmp_path):
    shards = tmp_path / "myshards"
    assert main_cli("convert", "folder", photo_tree(tmp_path / "mydata"), shards, "--maxcount", 4).returncode == 0
    workers = len(os.sched_getaffinity(0)) + 1  # more than the shards, and than the cores (torch warns twice)
    r = main_cli("profile", shards, "--workers", workers, "--batches", 1, "--out", tmp_path / "pictures")
    assert r.returncode == 0, r.stderr
    assert f"shardkit profile: {workers} workers x 1 ranks read 2 shards: {workers - 2} of them get no shard" in r.stderr
    assert "UserWarning: " + str(workers) not in r.stderr, r.stderr  # shardkit's own: no Python file and line
    assert r.stderr.count("This DataLoader will create") <= 1, r.stderr  # torch says it from two lines: once here
