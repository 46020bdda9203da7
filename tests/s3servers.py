"""Real S3 servers for the tests, started on 127.0.0.1: MinIO's server (built from its Go module, once, like aisnode)
and the local AIStore's S3 API (`/s3` on the proxy). The fault server that speaks S3 is tests/faults.py's.

MinIO is not built by the suite (about 4 minutes on 2 cores): `python tests/s3servers.py` builds it into
`$SHARDKIT_HOME/bin` (it needs Go and the module proxy); the tests that need it skip, saying so, where it is missing,
unless SHARDKIT_REQUIRE_MINIO=1 makes that a failure."""
import contextlib, json, os, shutil, socket, subprocess, sys, tempfile, time
from pathlib import Path

MINIO_MODULE = "github.com/minio/minio"
MINIO_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"  # the module proxy's @latest on 2026-11-28; built and tested here
MINIO_USER, MINIO_SECRET = "shardkit-minio", "minio-secret-not-for-production"


def minio_path() -> Path:
    "Where the built MinIO server lives: `$SHARDKIT_MINIO`, else `$SHARDKIT_HOME/bin/minio-<version>`."
    from shardkit.config import shardkit_home
    return Path(os.environ.get("SHARDKIT_MINIO") or shardkit_home() / "bin" / f"minio-{MINIO_VERSION}")


def why_no_minio() -> str | None:
    "None if the MinIO server can be run here; else why not and how to build it."
    from shardkit.config import shardkit_home, why_untrusted
    p = minio_path()
    if not p.exists():
        return f"no MinIO server at {p}: build it with `python tests/s3servers.py` (Go, about 4 minutes)"
    if not os.environ.get("SHARDKIT_MINIO") and (why := why_untrusted(p, shardkit_home())): return why
    return None


def build_minio() -> Path:
    "Build MinIO's server from its Go module (`go mod download`, then `go build` in the module's folder)."
    from shardkit.config import private_dir, shardkit_home, why_untrusted
    out = minio_path()
    if why := why_untrusted(private_dir(out.parent), shardkit_home()): raise RuntimeError(f"not building MinIO: {why}")
    got = subprocess.run(["go", "mod", "download", "-json", f"{MINIO_MODULE}@{MINIO_VERSION}"], capture_output=True,
                         text=True, check=True, cwd=tempfile.gettempdir())
    src, tmp = json.loads(got.stdout)["Dir"], out.with_name(out.name + f".{os.getpid()}.tmp")
    t0 = time.time()
    subprocess.run(["go", "build", "-trimpath", "-o", str(tmp), "."], cwd=src, check=True,
                   env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false"})
    os.replace(tmp, out)
    print(f"built {out} in {time.time() - t0:.0f} s")
    return out


def _free_port() -> int:
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@contextlib.contextmanager
def minio_server(root: Path):
    "A MinIO server over folder `root` on 127.0.0.1 (its console too): yields (endpoint, access key, secret)."
    import requests
    port, console = _free_port(), _free_port()
    env = {**os.environ, "MINIO_ROOT_USER": MINIO_USER, "MINIO_ROOT_PASSWORD": MINIO_SECRET,
           "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "HOME": str(root)}
    log = open(root / "minio.log", "wb")
    proc = subprocess.Popen([str(minio_path()), "server", str(root / "data"), "--address", f"127.0.0.1:{port}",
                             "--console-address", f"127.0.0.1:{console}", "--quiet"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None: raise RuntimeError(f"MinIO exited: {(root / 'minio.log').read_text()[-2000:]}")
            try:
                if requests.get(f"{endpoint}/minio/health/ready", timeout=1).status_code == 200: break
            except requests.RequestException: pass
            time.sleep(0.1)
        else: raise RuntimeError("MinIO did not get ready in 30 s")
        yield endpoint, MINIO_USER, MINIO_SECRET
    finally:
        proc.terminate()
        try: proc.wait(10)
        except subprocess.TimeoutExpired: proc.kill(); proc.wait()
        log.close()


def ais_md5_bucket(endpoint: str, bucket: str):
    "Create AIStore bucket `bucket` with MD5 checksums, so that its S3 API answers S3-style ETags (docs/s3compat.md)."
    import requests
    requests.put(f"{endpoint}/s3/{bucket}", timeout=30).raise_for_status()
    r = requests.patch(f"{endpoint}/v1/buckets/{bucket}", params={"provider": "ais"}, timeout=30,
                       json={"action": "set-bprops", "value": {"checksum": {"type": "md5"}}})
    r.raise_for_status()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if shutil.which("go") is None: sys.exit("Go is needed to build MinIO's server (go >= 1.24)")
    build_minio()
