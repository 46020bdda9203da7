"""The stores' own emulators for the tests, started on 127.0.0.1: fake-gcs-server (Google Cloud Storage's JSON API; a
Go module, built once into `$SHARDKIT_HOME/bin` as aisnode is) and Azurite (Microsoft's Azure Storage emulator;
installed once from npm into `$SHARDKIT_HOME`). Each is built or installed under a lock, so that two test workers
wait for one build; each yields its endpoint and is stopped after.

`python tests/bucketservers.py` builds and installs both ahead of a run (about 1.5 minutes on 2 cores, most of it the
Go build; it needs Go, npm and their registries)."""
import base64, contextlib, fcntl, os, shutil, socket, subprocess, sys, tempfile, time
from pathlib import Path

FAKE_GCS_MODULE, FAKE_GCS_VERSION = "github.com/fsouza/fake-gcs-server", "v1.56.1"
AZURITE_VERSION = "3.37.0"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # public
# a second account whose key is a planted secret, for the tests that look for it in every output
PLANTED_ACCOUNT = "shardkitplanted"
PLANTED_KEY = base64.b64encode(b"planted-AZURE-SECRET-7d1e9c2b-do-not-print").decode()


def _home() -> Path:
    from shardkit.config import private_dir, shardkit_home, why_untrusted
    bindir = private_dir(shardkit_home() / "bin")
    if why := why_untrusted(bindir, shardkit_home()): raise RuntimeError(f"not building emulators: {why}")
    return bindir


@contextlib.contextmanager
def _lock(path: Path):
    "An exclusive lock on a file beside `path` while it is built (another test worker waits for it)."
    with open(path.with_name(f".{path.name}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try: yield
        finally: fcntl.flock(f, fcntl.LOCK_UN)


def fake_gcs_path() -> Path: return _home() / f"fake-gcs-server-{FAKE_GCS_VERSION}"


def build_fake_gcs() -> Path:
    "Build fake-gcs-server (`go install`, static, stripped, unoptimised) unless a build of this version exists; its path."
    out = fake_gcs_path()
    if out.exists(): return out
    if shutil.which("go") is None: raise RuntimeError("Go is needed to build fake-gcs-server (go >= 1.24)")
    with _lock(out):
        if out.exists(): return out
        with tempfile.TemporaryDirectory(dir=out.parent) as gobin:
            t0 = time.time()
            # -N -l (no optimisation, no inlining), no DWARF: a test emulator's speed is not what is measured, and
            # its build (grpc and the GCS client libraries) takes a quarter less CPU: 102 -> 76 CPU-s on 2 cores
            subprocess.run(["go", "install", "-trimpath", "-ldflags", "-s -w", "-gcflags=all=-N -l -dwarf=false",
                            f"{FAKE_GCS_MODULE}@{FAKE_GCS_VERSION}"],
                           check=True, capture_output=True, cwd=gobin, stdin=subprocess.DEVNULL,
                           env={**os.environ, "GOBIN": gobin, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"})
            os.replace(Path(gobin) / "fake-gcs-server", out)
        print(f"built {out} in {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def azurite_path() -> Path: return _home() / f"azurite-{AZURITE_VERSION}" / "node_modules" / ".bin" / "azurite-blob"


def install_azurite() -> Path:
    "Install Azurite from npm into `$SHARDKIT_HOME/bin/azurite-<version>` unless it is there; its blob server's path."
    out = azurite_path()
    if out.exists(): return out
    if shutil.which("npm") is None: raise RuntimeError("npm (Node.js) is needed to install Azurite")
    top = out.parents[2]
    with _lock(top):
        if out.exists(): return out
        tmp = Path(tempfile.mkdtemp(dir=top.parent, prefix=f".{top.name}."))
        try:
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(tmp),
                            f"azurite@{AZURITE_VERSION}"], check=True, capture_output=True, stdin=subprocess.DEVNULL)
            os.replace(tmp, top)
        finally: shutil.rmtree(tmp, ignore_errors=True)
    return out


def _free_port() -> int:
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _wait(proc, log: Path, ready, what: str, seconds: float = 60):
    import requests
    for _ in range(int(seconds * 10)):
        if proc.poll() is not None: raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        try:
            if ready(requests): return
        except requests.RequestException: pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer in {seconds:.0f} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def _running(cmd: list[str], root: Path, name: str, ready, env=None):
    log = open(root / f"{name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root,
                            start_new_session=True)
    try:
        _wait(proc, root / f"{name}.log", ready, name)
        yield proc
    finally:
        proc.terminate()  # Azurite waits out its clients' keep-alive connections: its data is in memory, so not long
        try: proc.wait(0.5)
        except subprocess.TimeoutExpired: proc.kill(); proc.wait()
        log.close()


@contextlib.contextmanager
def fake_gcs_server(root: Path):
    "fake-gcs-server on 127.0.0.1 (objects in memory): yields its endpoint, for STORAGE_EMULATOR_HOST."
    exe, port = build_fake_gcs(), _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [str(exe), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
           "-public-host", f"127.0.0.1:{port}", "-log-level", "error"]
    with _running(cmd, root, "fake-gcs-server",
                  lambda rq: rq.get(f"{endpoint}/storage/v1/b", timeout=1).status_code == 200):
        yield endpoint


@contextlib.contextmanager
def azurite(root: Path):
    "Azurite's blob service on 127.0.0.1 (its well-known account): yields its blob endpoint."
    exe, port = install_azurite(), _free_port()
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    cmd = [str(exe), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--silent", "--loose", "--skipApiVersionCheck",
           "--inMemoryPersistence"]
    answers = lambda rq: rq.get(f"{endpoint}?comp=list", timeout=1).status_code in (200, 403)  # noqa: E731
    accounts = f"{AZURITE_ACCOUNT}:{AZURITE_KEY};{PLANTED_ACCOUNT}:{PLANTED_KEY}"
    with _running(cmd, root, "azurite", answers, env={**os.environ, "AZURITE_ACCOUNTS": accounts}):
        yield endpoint


def connection_string(endpoint: str, key: str = AZURITE_KEY, account: str = AZURITE_ACCOUNT) -> str:
    "A connection string for Azurite's `account` (its blob endpoint `endpoint` names the well-known one)."
    endpoint = endpoint.replace(f"/{AZURITE_ACCOUNT}", f"/{account}")
    return f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={key};BlobEndpoint={endpoint};"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(build_fake_gcs(), install_azurite())
