"""Shared fixtures: a real local AIStore cluster for the session, a way to run the CLI, headless Chromium; and the
two tiers. `slow` marks notebooks, AIStore, browsers, torchrun, the demo and benchmarks (pytest.ini); every test
that uses the session's cluster is slow without saying so. `python -m pytest -m "not slow"` is the fast tier; both
tiers run in three pytest-xdist workers (`-n 3 --dist loadgroup`, the README's commands); in the whole suite two of
them take the CPU-bound tests and the third the waiting ones (`WAITING_GROUPS`, below). `--dist loadgroup` sends the
largest group first (xdist's scope reordering): the cluster's tests, all on one worker, while another worker runs
the rest. A plain serial `python -m pytest` runs the same tests, the cluster's last."""
import atexit, contextlib, gc, os, shutil, signal, subprocess, sys, tempfile
from pathlib import Path
import pytest

# The suite runs two CPU-bound tests at once (-n 3: in the whole suite the third worker mostly waits) on the machine's
# cores: each torch process it starts (a `shardkit train`, a notebook's kernel, a worker of the suite) takes one
# thread, as `shardkit train` honours OMP_NUM_THREADS, so that a training run does not take every core from the timed
# test beside it. tests/test_startup.py checks the default.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "_out"  # screenshots and figures the tests write (git-ignored)


def free_base_port(start=28080, step=10, nodes=4):
    "A base port P such that P+i, P+1000+i and P+2000+i are free for `nodes` nodes."
    from shardkit.stores.ais_cluster import free_base_port
    return free_base_port(start, start + 2000, nodes, step)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests on the session's AIStore are slow, and share one worker under pytest-xdist (`--dist loadgroup`): one
    cluster per session. Tests that change a cluster's targets (`changing_cluster`: tests/test_faults_ais.py) share
    another group: their cluster is their own, and their rebalances (about 40 s each) run beside the session
    cluster's tests, not after them. Tests with a wall-clock bound (`timed`) share a third, so no two of them run at
    once."""
    ais_modules = set()
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if {"ais_cluster", "changing_cluster"} & names:
            item.add_marker(pytest.mark.slow)
            # a test that changes its cluster's targets, on a cluster of its own: beside the session cluster's tests
            item.add_marker(pytest.mark.xdist_group("aistore" if "ais_cluster" in names else "aistore-changes"))
            ais_modules.add(item.nodeid.split("::")[0])
        elif item.get_closest_marker("timed"):
            item.add_marker(pytest.mark.xdist_group("timed"))
    # Serially, the test files that use the cluster run after the others (each file's own order kept, so its module
    # fixtures are set up once): on a fresh machine, aisnode builds in the background meanwhile
    # (pytest_collection_finish). Under xdist the groups go out largest first (xdist's reordering; the cluster's
    # group first, built and started once while the other worker runs the rest), then single tests in this order.
    # Sending the slow single tests first was tried and measured slower (902 s against 845 s): heavy tests then
    # overlap the aisnode build and each other. Under xdist, the last files' slow tests go out before their quick
    # ones, so that the run ends on quick tests that even out the workers' finishing times: it ended on
    # test_train.py's torchrun tests, with one core idle for their last 20-40 s (runs s8b, s8c).
    under_xdist = hasattr(config, "workerinput")
    def order(item):
        last = item.nodeid.split("::")[0] in ais_modules
        return last, under_xdist and last and not item.get_closest_marker("slow")
    items.sort(key=order)


# Groups whose tests mostly wait on AIStore's timers (each rebalance of `changing_cluster` is about 40 s): about 270 s
# of a worker's time at 30 CPU-s. With three or more xdist workers (the README's test command: -n 3) the last worker
# runs only these groups and stops when they are done, beside two workers that run everything else; under -n 2 those
# 270 s of waiting held a worker from the other tests (a core idle for 4 minutes of every full run).
WAITING_GROUPS = {"aistore-changes"}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain `pytest` (no xdist) never calls it
def pytest_xdist_make_scheduler(config, log):
    "`--dist loadgroup` with a waiting worker (`WAITING_GROUPS`); every other `--dist` as xdist has it."
    if config.getvalue("dist") != "loadgroup": return None
    from xdist.scheduler import LoadGroupScheduling

    class WaitingWorkerScheduling(LoadGroupScheduling):
        """xdist's loadgroup, except that with 3 or more workers and a waiting group selected, the last worker takes
        only the waiting groups and the others everything else. A worker with nothing it may take stops (as loadgroup
        stops one when the queue is empty); if the waiting worker is gone (crashed), anyone takes anything."""
        waiter = None

        def schedule(self):
            if self.collection is None and len(self.nodes) >= 3:
                collection = next(iter(self.registered_collections.values()), [])
                if any(self._split_scope(n) in WAITING_GROUPS for n in collection):
                    self.waiter = max(self.nodes, key=lambda n: int(n.gateway.id.removeprefix("gw")))
            super().schedule()

        def _may_take(self, node, scope) -> bool:
            if self.waiter is None or self.waiter not in self.assigned_work: return True
            return (scope in WAITING_GROUPS) == (node is self.waiter)

        def _assign_work_unit(self, node):
            scope = next((s for s in self.workqueue if self._may_take(node, s)), None)
            if scope is None:
                node.shutdown()
                return
            self.workqueue.move_to_end(scope, last=False)  # the base class hands out the queue's first unit
            super()._assign_work_unit(node)

    return WaitingWorkerScheduling(config, log)


class _OneRunPerNotebook:
    "A notebook's light run is a subset of its full run: when both are selected, only the full one runs."
    @pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected
    def pytest_collection_modifyitems(self, config, items):
        full = {item.callspec.params["nb"] for item in items
                if item.originalname in ("test_notebook_full", "test_notebook_full_on_aistore")}
        drop = [i for i in items if i.originalname == "test_notebook_light" and i.callspec.params["nb"] in full]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [i for i in items if i not in drop]


def pytest_configure(config):
    config.pluginmanager.register(_OneRunPerNotebook(), "shardkit-one-run-per-notebook")


_BUILD = {}  # the background aisnode build of this session, if one was started


def pytest_collection_finish(session):
    """When the selected tests run notebooks, start the warm starter they fork from now (tests/notebook_runner.py),
    before a test of shardkit's ETL engine starts this process's one forkserver with fewer imports.

    On a machine without an aisnode build (a fresh clone), start building it now, at the lowest CPU priority, when
    the selected tests need the cluster: the ~2.5 min build then uses the cores the tests before them leave idle,
    instead of holding up the first AIStore test. Serial runs only (under xdist each worker would build)."""
    if any(getattr(getattr(i, "module", None), "run_notebook", None) for i in session.items):
        from notebook_runner import start
        start()
    needs_cluster = any({"ais_cluster", "changing_cluster"} & set(getattr(i, "fixturenames", ())) for i in session.items)
    if hasattr(session.config, "workerinput") or not needs_cluster: return
    from shardkit.stores.ais_cluster import aisnode_path
    if aisnode_path().exists(): return
    code = "from shardkit.stores.ais_cluster import build_aisnode; build_aisnode(quiet=True)"  # a failure shows when ais_up builds
    _BUILD["proc"] = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=lambda: os.nice(19))


def _wait_for_aisnode_build():
    """Wait for the background build, if any, at normal priority now that a test waits for it (where permitted: root);
    ais_up then finds the binary (or, if the build failed, builds it again and says why)."""
    if proc := _BUILD.pop("proc", None):
        try: os.setpriority(os.PRIO_PGRP, proc.pid, 0)
        except (PermissionError, ProcessLookupError): pass  # not root: it goes on at low priority; or it is done
        proc.wait()


def pytest_sessionfinish(session):
    "A background build still running when the session ends (no cluster test ran, -x) is stopped, with its compilers."
    if (proc := _BUILD.pop("proc", None)) and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # KeyboardInterrupt: build_aisnode removes its partial binary
        proc.wait()


def _end_without_teardown():
    "Run every other exit handler, in its order, then end the process without the interpreter's teardown."
    atexit.unregister(_end_without_teardown)
    gc.freeze()  # IPython's exit handler (one per notebook shell) collects; the session's heap is left out of it
    atexit._run_exitfuncs()  # private: atexit has no public way to run its handlers now (PRIVATE_ALLOWED)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(trylast=True)  # after the other plugins' unconfigure: its exit handler is registered after theirs
def pytest_unconfigure(config):
    """A pytest-xdist worker's exit: the interpreter's teardown would walk and free every object the session made
    (more than 10 s after a whole suite), and the controller waits for the worker, then kills it after 10 s. Its
    results are sent by then, so the worker ends once its exit handlers (multiprocessing's, shardkit's) have run."""
    if hasattr(config, "workerinput"): atexit.register(_end_without_teardown)  # registered last, called first


def _keep_logs(root: Path) -> Path:
    "Copy the cluster's node logs to tests/_out/ais-logs-PID-NAME (before its folder is wiped), for a failed session."
    dest = OUT / f"ais-logs-{os.getpid()}-{root.name}"
    for log in [*root.glob("*/log/*"), *root.glob("*/stdout.log")]:
        if log.is_file():
            (dest / log.parent.relative_to(root)).mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest / log.parent.relative_to(root) / log.name)
    return dest


def _start_cluster(tmp_path_factory, name: str) -> dict:
    """A local AIStore of 1 proxy and 2 targets (room for a third) under a new temp folder, at a base port drawn at
    random (two sessions on one machine rarely race for the same ports). Skips with a how-to when it cannot start,
    unless SHARDKIT_REQUIRE_AIS=1 (CI), where that is a failure."""
    import random
    from shardkit.stores.ais_cluster import ais_up, ais_down
    _wait_for_aisnode_build()
    root, port = tmp_path_factory.mktemp(name), free_base_port(start=28080 + 10 * random.randrange(60))
    try:
        try: endpoint = ais_up(targets=2, root=root, port=port, quiet=True)
        except Exception as e:  # a port taken between the check and the bind (another program): once more, elsewhere
            if "address already in use" not in str(e): raise
            ais_down(root, wipe=True, quiet=True)
            root = tmp_path_factory.mktemp(name)
            endpoint = ais_up(targets=2, root=root, port=free_base_port(start=port + 100), quiet=True)
    except Exception as e:
        msg = f"local AIStore could not start: {e}"
        if root.exists(): msg += f"\n(its nodes' logs: {_keep_logs(root)})"  # pytest removes its temp folders later
        if os.environ.get("SHARDKIT_REQUIRE_AIS") == "1": pytest.fail(msg)
        pytest.skip(msg + " (install Go >= 1.26 so `shardkit ais up` can build it; set SHARDKIT_REQUIRE_AIS=1 to make this a failure)")
    return dict(endpoint=endpoint, root=root)


def _stop_cluster(cluster: dict, request, timeout: float = 30):
    """Stop it (nodes still running after `timeout` s are killed); when a test of the session failed, keep the
    nodes' logs in tests/_out/ais-logs-PID-NAME first."""
    from shardkit.stores.ais_cluster import ais_down
    if request.session.testsfailed: print(f"\nthe local AIStore's logs: {_keep_logs(cluster['root'])}")
    ais_down(cluster["root"], timeout=timeout, wipe=True, quiet=True)


@pytest.fixture(scope="session")
def ais_cluster(tmp_path_factory, request):
    """A real local AIStore (1 proxy, 2 targets, dSort built in) for the whole session. Its targets never change: a
    test that restarts, adds or removes one uses `changing_cluster`, so no other test meets the rebalance that
    follows."""
    cluster = _start_cluster(tmp_path_factory, "ais")
    yield cluster
    _stop_cluster(cluster, request)


@pytest.fixture(scope="session")
def changing_cluster(tmp_path_factory, request):
    """A second local AIStore (1 proxy, 2 targets) for the tests that kill, restart, add or remove targets, or start
    rebalances. Each such change starts a rebalance; here no test of the session cluster meets one, and none waits
    for the last one: this cluster is stopped at the end. Started the first time a test asks for it; its tests run in
    the cluster's xdist group, one at a time.

    A rebalance's length is AIStore's timers, not the data: with 8 objects of 1.2 MB, its "fin" stage waited 25 s and
    "fin-streams" 10 s (a target's log: `trav:<1s post-trav:4s fin:25s fin-streams:10s`), 50 s in all. The stages wait
    for 2 x `timeout.max_keepalive` of silence, then `transport.quiescent` of it. This cluster sets both to the least
    AIStore accepts (8 s; 2 x `timeout.cplane_operation`): a rebalance then takes about 40 s, and still runs through
    the epochs and the jobs its tests run meanwhile (tests/test_faults_ais.py checks that it does)."""
    import requests
    cluster = _start_cluster(tmp_path_factory, "ais-changing")
    for kv in ("transport.quiescent=8s", "timeout.max_keepalive=4s"):
        r = requests.put(f"{cluster['endpoint']}/v1/cluster/set-config?{kv}", timeout=30)
        assert r.status_code == 200, f"AIStore refused {kv}: {r.status_code} {r.text[:300]}"
    yield cluster
    # A target being decommissioned finishes its part of the rebalance before it exits on SIGTERM (20-30 s, the
    # teardown of whichever test ran last on this worker): this cluster's data is deleted next, so it is not waited for
    _stop_cluster(cluster, request, timeout=3)


@pytest.fixture
def ais_endpoint(ais_cluster, monkeypatch):
    "The local cluster's endpoint, exported as AIS_ENDPOINT for this test only."
    monkeypatch.setenv("AIS_ENDPOINT", ais_cluster["endpoint"])
    return ais_cluster["endpoint"]


def run_cli(*args, env=None, timeout=300, check=False, cwd=None):
    "Run `shardkit ARGS...` in a subprocess (as a user would) and return the CompletedProcess."
    cmd = [sys.executable, "-m", "shardkit.apps.cli", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       env={**os.environ, **(env or {})}, cwd=cwd)
    if check and r.returncode: raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture
def cli():
    "The `run_cli` helper as a fixture."
    return run_cli


def main_cli(*args):
    """`shardkit ARGS...` through the command's own entry point in this process: the same parsing, messages and exit
    status as `run_cli` without a Python start-up (for --help and bad input; run_cli is for runs as a user makes them)."""
    import io
    from types import SimpleNamespace
    from shardkit.apps.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try: rc = main([str(a) for a in args])
        except SystemExit as e: rc = e.code if isinstance(e.code, int) else 0  # argparse after --help or a usage error
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="session")
def out_dir():
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@contextlib.contextmanager
def headless_chromium(page_load_timeout: float = 60, extra_args=()):
    "Debian's headless Chromium through Debian's chromedriver (selenium never downloads a driver), flags that keep it off the network."
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    os.environ.setdefault("SE_OFFLINE", "true")
    profile = tempfile.mkdtemp(prefix="shardkit-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for a in ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
              "--window-size=1400,1000", *extra_args]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    drv = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    drv.set_page_load_timeout(page_load_timeout)
    try: yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def write_pet_shards(folder: Path, n_shards: int = 6, per_shard: int = 5, *, size=(64, 48), seed: int = 0,
                     trimap: bool = True) -> list[str]:
    "Pet-like shards `pets-00000.tar`, ...: `per_shard` samples of a synthetic image (`size`), a class and (with `trimap`) a trimap."
    import numpy as np
    import webdataset as wds
    from shardkit.ingest.synth import draw_animal, jpeg_bytes, png_bytes
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n_shards):
        paths.append(str(folder / f"pets-{s:05d}.tar"))
        with wds.TarWriter(paths[-1]) as w:
            for i in range(per_shard):
                cls = int(rng.integers(0, 37))
                img, tri = draw_animal(cls, rng, size=size)
                w.write({"__key__": f"s{s}_{i}", "image.jpg": jpeg_bytes(img), "cls": cls, **({"trimap.png": png_bytes(tri)} if trimap else {})})
    return paths


# The fast tier's budget: it runs on every edit, so each of its tests takes seconds. A test over this (on a quiet
# 2-core machine) is named at the end of the run, with what to do; the README's Developing section gives the tiers.
FAST_TEST_SECONDS = 10


def pytest_terminal_summary(terminalreporter, config):
    "In the fast tier (`-m \"not slow\"`), name the tests that took longer than FAST_TEST_SECONDS."
    if "not slow" not in (config.getoption("markexpr") or ""): return
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])]
    over = sorted(((r.duration, r.nodeid) for r in reports if r.when == "call" and r.duration > FAST_TEST_SECONDS),
                  reverse=True)
    if over:
        terminalreporter.write_sep("-", f"{len(over)} fast-tier test(s) over {FAST_TEST_SECONDS} s")
        for d, nodeid in over: terminalreporter.write_line(f"{d:6.1f} s  {nodeid}")
        terminalreporter.write_line("on a quiet machine, make them cheaper or mark them `slow` (pytest.ini): the fast "
                                    "tier is the edit-test loop, the whole suite still runs them")


def _emulator(tmp_path_factory, name: str, start):
    """Start emulator `name` (tests/bucketservers.py) for the session: its endpoint. Skips with a how-to when it cannot
    be built or started, unless SHARDKIT_REQUIRE_EMULATORS=1 (CI), where that is a failure."""
    stack = contextlib.ExitStack()
    try: endpoint = stack.enter_context(start(tmp_path_factory.mktemp(name)))
    except Exception as e:
        msg = f"{name} could not start: {e}"
        if os.environ.get("SHARDKIT_REQUIRE_EMULATORS") == "1": pytest.fail(msg)
        pytest.skip(msg + " (it needs Go or npm and their registries once: python tests/bucketservers.py; set "
                    "SHARDKIT_REQUIRE_EMULATORS=1 to make this a failure)")
    return stack, endpoint


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    "fake-gcs-server on 127.0.0.1 for the session (built once into $SHARDKIT_HOME/bin): its endpoint."
    from bucketservers import fake_gcs_server
    stack, endpoint = _emulator(tmp_path_factory, "fake-gcs-server", fake_gcs_server)
    with stack: yield endpoint


@pytest.fixture(scope="session")
def azurite_emulator(tmp_path_factory):
    "Azurite's blob service on 127.0.0.1 for the session (installed once from npm): its blob endpoint."
    from bucketservers import azurite
    stack, endpoint = _emulator(tmp_path_factory, "azurite", azurite)
    with stack: yield endpoint
