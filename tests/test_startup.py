"""Start-up: what a fresh process imports. The front and the default loader import no torchvision (a second of
torch._dynamo through torchvision.models), `shardkit train` with the default pipeline neither (torch._dynamo only
through torch.optim's first use), `shardkit train` lets idle torch threads sleep, every command's --help imports
no torch (its page is kept as data, and that page is the command's own); a wrong step is one line and an exit status.
Each check runs a fresh interpreter and looks at its sys.modules: times are measured by `shardkit bench startup`."""
import contextlib, io, json, os, subprocess, sys
from pathlib import Path
import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def fresh(code: str, *args, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    "Run `code` in a fresh interpreter with this checkout first on the path; `env`: variables to set (None: unset)."
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "COLUMNS": "120", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def own_shards(tmp_path_factory) -> Path:
    "A small ImageFolder tree converted as the README's own-data steps do: 48 JPEGs, 4 classes, 8 shards."
    from shardkit.ingest.folder import convert_folder
    root, rng = tmp_path_factory.mktemp("own"), np.random.default_rng(0)
    for i in range(48):
        (d := root / "mydata" / "abcd"[i % 4]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40 + i, 50, 3), dtype=np.uint8)).save(d / f"{i}.jpg", quality=85)
    convert_folder(root / "mydata", root / "myshards", maxcount=6, progress=False)
    return root / "myshards"


def test_the_default_loader_imports_no_torchvision(own_shards):
    r = fresh("import json, sys\n"
              "from shardkit.loading.jpeg import why_no_window_decode\n"
              "from shardkit import create_dataset, create_dataloader\n"
              "front = sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision')\n"
              "loader = create_dataloader(create_dataset(sys.argv[1], batch_size=8), num_workers=0)\n"
              "labels, images = next(iter(loader))  # fields by name: cls, then jpg\n"
              "print(json.dumps(dict(why=why_no_window_decode(), shape=list(images.shape), front=front,\n"
              "                      loaded='torchvision' in sys.modules)))", own_shards)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if got["why"] is not None: pytest.skip(f"no window decoding here ({got['why']}): whole images go through torchvision")
    assert got == dict(why=None, shape=[8, 3, 224, 224], front=[], loaded=False), got  # decoded and cropped in C


def test_train_with_the_default_pipeline_imports_no_torchvision_and_dynamo_only_through_torch_optim(own_shards):
    """No torchvision; torch._dynamo (1.3-1.8 s) only where torch.optim's first use imports it, as in any training
    script: the start-up target counts it in the baseline, so nothing of shardkit's may import it first."""
    r = fresh("import json, sys, traceback\n"
              "class Spy:  # the stack that first imports torch._dynamo\n"
              "    stack = None\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'torch._dynamo' and Spy.stack is None:\n"
              "            Spy.stack = [f.filename for f in traceback.extract_stack()]\n"
              "sys.meta_path.insert(0, Spy())\n"
              "from shardkit.train import train\n"
              "train(sys.argv[1], epochs=1, max_steps=2, batch_size=8, num_workers=0, size=32)\n"
              "print(json.dumps(dict(torchvision='torchvision' in sys.modules, stack=Spy.stack)))", own_shards)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert not got["torchvision"], got
    assert got["stack"], "torch.optim's first use imports torch._dynamo: the baseline of the start-up target"
    first_torch = next((f for f in got["stack"] if f"{os.sep}torch{os.sep}" in f), "")
    assert f"{os.sep}torch{os.sep}optim{os.sep}" in first_torch, got["stack"]  # torch.optim, not shardkit, imports it


@pytest.mark.slow
@pytest.mark.parametrize("policy,given", [(None, None), ("ACTIVE", None), (None, "1")])
def test_shardkit_train_lets_idle_threads_sleep_unless_told(policy, given, own_shards):
    "`shardkit train` sets OMP_WAIT_POLICY=PASSIVE before torch loads, then uses every core; a caller's settings win."
    r = fresh("import os, sys\nfrom shardkit.apps.cli import main\n"
              "assert 'torch' not in sys.modules\n"
              "main(['train', '--shards', sys.argv[1], '--epochs', '1', '--max-steps', '1', '--batch-size', '8',\n"
              "      '--size', '32', '--num-workers', '2'])\n"
              "import torch\nprint(os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads())", own_shards,
              env={"OMP_WAIT_POLICY": policy, "OMP_NUM_THREADS": given})
    assert r.returncode == 0, r.stderr[-3000:]
    cores = os.cpu_count()
    want = f"ACTIVE {max(1, cores // 3)}" if policy else f"PASSIVE {given or cores}"
    assert r.stdout.strip().splitlines()[-1] == want, r.stdout


def test_every_help_imports_no_torch_and_shows_the_commands_own_page():
    """Every command's --help, and `shardkit --help`'s list of every command with its description, in one fresh process:
    no torch, no command module imported; each page is the live one."""
    from shardkit.apps.cli import COMMANDS, EXAMPLES, overview, parser_of
    r = fresh("import contextlib, io, json, sys\n"
              "from shardkit.apps.cli import COMMANDS, main\n"
              "pages = {}\n"
              "for cmd in [*COMMANDS, ()]:\n"
              "    out = io.StringIO()\n"
              "    with contextlib.redirect_stdout(out):\n"
              "        try: main([*cmd, '--help'])\n"
              "        except SystemExit as e: assert e.code == 0, cmd\n"
              "    pages[' '.join(cmd)] = out.getvalue()\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'webdataset'))\n"
              "mods = sorted(m for m in sys.modules if m.startswith('shardkit'))\n"
              "print(json.dumps(dict(pages=pages, heavy=heavy, mods=mods)))")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["heavy"] == [], got["heavy"]
    assert got["mods"] == ["shardkit", "shardkit.apps", "shardkit.apps.cli", "shardkit.command", "shardkit.errors"]
    os.environ["COLUMNS"] = "120"  # the same width as the fresh process's pages
    try:
        for cmd in COMMANDS:
            assert got["pages"][" ".join(cmd)] == parser_of(cmd).format_help(), cmd
    finally: del os.environ["COLUMNS"]
    assert "torchrun --nproc_per_node 2 -m shardkit train" in got["pages"]["train"] and ("train",) in EXAMPLES
    assert got["pages"][""] == overview() + "\n" and "  train " in got["pages"][""]  # `shardkit --help`: the list


def test_the_kept_help_is_current():
    "The kept pages (apps/command_help.json) are what the commands' functions give now; else --help reads them."
    from shardkit.apps.cli import COMMANDS, HELP_TABLE, command_help, kept_help
    stale = [" ".join(c) for c in COMMANDS if kept_help(c) != command_help(c)]
    assert not stale, (f"{HELP_TABLE.name} is out of date for {stale}: run `python -c 'from shardkit.apps.cli import "
                       "write_help_table; write_help_table()'` and commit it")


def test_python_m_shardkit_is_the_command_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-m", "shardkit", "ls", "/no/such/dir"], capture_output=True, text=True, env=env,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("shardkit ls: directory /no/such/dir does not exist; check the path"), r.stderr


# each wrong step of a new user's first minute: (command line, exit status, what the one line must say)
WRONG_STEPS = [
    (["profile", "{tmp}/nonexistent"], 1, "no file or directory {tmp}/nonexistent: a source is a directory of .tar"),
    (["ls", "{tmp}/nonexistent"], 1, "directory {tmp}/nonexistent does not exist; check the path"),
    (["verify", "{tmp}/nonexistent"], 1, "directory {tmp}/nonexistent does not exist; check the path"),
    (["train", "--shards", "{tmp}/nonexistent"], 1, "no file or directory {tmp}/nonexistent: a source is"),
    (["train", "--shards", "{shards}/mydata-{{000000..000012}}.tar"], 1,
     "names 13 shards, 5 of which do not exist ({shards}/mydata-000008.tar .. mydata-000012.tar); {shards} holds 8 "
     "shards (mydata-000000.tar .. mydata-000007.tar)"),
    (["train", "--shards", "{shards}/mydata-{{000000..000007.tar"], 2, "unbalanced braces in '{shards}/mydata-{{000000"),
    (["train", "--shards", "{shards_typo}"], 1, "no file or directory {shards_typo} (did you mean {shards}?)"),
    (["train", "--shards", "{tmp}/empty"], 1, "no shards matching '*.tar' in {tmp}/empty; write some first: "
     "`shardkit convert folder SRC {tmp}/empty` from an ImageFolder tree, or write_shards(samples, '{tmp}/empty')"),
]


@pytest.mark.parametrize("argv, status, says", WRONG_STEPS, ids=[" ".join(a) for a, _, _ in WRONG_STEPS])
def test_a_wrong_step_is_one_line_and_an_exit_status(argv, status, says, own_shards, tmp_path):
    from shardkit.apps.cli import main
    (tmp_path / "empty").mkdir()
    names = dict(tmp=tmp_path, shards=own_shards, shards_typo=str(own_shards)[:-1])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([a.format(**names) for a in argv])
    assert rc == status, (rc, err.getvalue())
    assert err.getvalue().count("\n") == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    assert says.format(**names) in err.getvalue(), err.getvalue()
    assert "curl" not in err.getvalue() and "create it" not in err.getvalue() and "convert pets" not in err.getvalue()


def test_library_wrong_steps_are_said_before_any_worker(own_shards, tmp_path):
    "In Python: the same checks, raised by create_dataset in the main process, as shardkit's errors."
    from shardkit import create_dataset
    from shardkit.errors import DataError, UsageError
    from shardkit.loading.sources import MissingShards
    with pytest.raises(MissingShards, match=r"\(did you mean .*myshards\?\): a source is"):
        create_dataset(str(own_shards)[:-1])
    with pytest.raises(MissingShards, match="5 of which do not exist"):
        create_dataset(f"{own_shards}/mydata-{{000000..000012}}.tar")
    with pytest.raises(UsageError, match="unbalanced braces"): create_dataset(f"{own_shards}/mydata-{{000000..000007.tar")
    for access in ("stream", "random"):
        with pytest.raises(UsageError, match=r"weights must be positive numbers, got \{'b': 0\}"):
            create_dataset({"a": own_shards, "b": own_shards}, weights={"a": 1, "b": 0}, access=access)
    assert issubclass(MissingShards, DataError)


def test_a_shardkit_error_in_a_worker_reaches_the_caller_as_itself(tmp_path):
    "A shard that cannot be read, in a DataLoader worker: the same error type, its own message first."
    from shardkit import create_dataloader, create_dataset
    from shardkit.remote import RetriesExhausted
    import gc, psutil
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    loader = create_dataloader(create_dataset(["http://127.0.0.1:9/a.tar", "http://127.0.0.1:9/b.tar"],
                                              fields=("jpg", "cls"), retry_wait=0.5), num_workers=2)
    gc.disable()  # the error stops the workers itself: not left to the cycle collector (5 s a worker)
    try:
        with pytest.raises(RetriesExhausted) as e: next(iter(loader))
        workers = [p for p in me.children() if p.pid not in before]
        _, alive = psutil.wait_procs(workers, timeout=20)
    finally:
        gc.enable()
    assert str(e.value).startswith("gave up reading shard http://127.0.0.1:9/"), str(e.value)
    assert "Caught RetriesExhausted in DataLoader worker process" in str(e.value.__cause__)
    assert not alive, f"{len(alive)} DataLoader workers still running after the error"
