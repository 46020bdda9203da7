"""Run every fuzz target for a while and print a table: `python tests/fuzz/run.py --seconds N [--targets a,b]`
(or `python -m tests.fuzz ...`). Python targets run under atheris, the C decoder under libFuzzer with AddressSanitizer
and UndefinedBehaviorSanitizer, each in its own process, one after another. A crash's input is kept in the target's
corpus (`crash-*`) as a regression input; an input over 1 s is kept as `slow-*`."""
from __future__ import annotations
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script: tests.fuzz must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "tests.fuzz"

from tests.fuzz.core import CORPUS, HERE, save_input  # noqa: E402

ROOT = HERE.parents[1]
C_TARGET = "jpeg_window"
C_SOURCES = (HERE / "jpeg_fuzz.c", ROOT / "shardkit" / "native" / "jpeg_window.c")
_STATUS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+).*?exec/s: (\d+) rss: (\d+)Mb")


def python_targets() -> list[str]:
    from tests.fuzz import targets  # noqa: F401
    from tests.fuzz.core import TARGETS
    return list(TARGETS)


def all_targets() -> list[str]: return [*python_targets(), C_TARGET]


def why_no_clang() -> str | None:
    "None where clang can build a libFuzzer target with ASan and UBSan; else why not and what to install."
    if not shutil.which("clang"): return "clang is not installed (apt-get install clang)"
    if not Path("/usr/include/jpeglib.h").exists(): return "libjpeg's headers are missing (apt-get install libjpeg-dev)"
    with tempfile.TemporaryDirectory() as tmp:  # clang without its sanitizer runtimes cannot link a libFuzzer target
        (Path(tmp) / "t.c").write_text("#include <stddef.h>\n#include <stdint.h>\n"
                                       "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n")
        r = subprocess.run(["clang", "-fsanitize=fuzzer,address,undefined", "-o", f"{tmp}/t", f"{tmp}/t.c"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            return (f"clang cannot link a libFuzzer target ({(r.stderr.strip().splitlines() or ['?'])[-1]}); "
                    "install its runtimes (Debian: apt-get install libclang-rt-14-dev, or the one of your clang)")
    return None


def build_c(folder: Path) -> Path:
    "The libFuzzer build of the C decoder's source (a separate build: the installed library is not touched)."
    out = folder / "jpeg_fuzz"
    cmd = ["clang", "-g", "-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined",
           "-o", str(out), *map(str, C_SOURCES), "-ljpeg", "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode: raise RuntimeError(f"building the C fuzz target failed:\n{r.stderr[-3000:]}")
    return out


def _libfuzzer_flags(seconds: float, runs: int | None, work: Path) -> list[str]:
    # -timeout is wall-clock: a fuzzing process at the lowest priority of a loaded machine can wait 10 s for a core
    # (an input of 0.3 ms CPU replayed); inputs over 1 s of CPU are caught by the targets' own timing (slow-*)
    flags = [f"-max_total_time={max(int(seconds), 1)}", "-timeout=60", "-rss_limit_mb=3072",
             f"-artifact_prefix={work}/", "-print_final_stats=1", "-max_len=65536"]
    return flags + ([f"-runs={runs}"] if runs else [])


def fuzz_one(name: str, seconds: float, runs: int | None, out: Path, binary: Path | None = None,
             nice: int = 19) -> dict:
    "Run target `name` once; its row of the table."
    work = out / name
    shutil.rmtree(work, ignore_errors=True)
    (work / "corpus").mkdir(parents=True)
    seeds = CORPUS / name
    seeds.mkdir(parents=True, exist_ok=True)
    flags = _libfuzzer_flags(seconds, runs, work) + [str(work / "corpus"), str(seeds)]
    if binary is not None: cmd = [str(binary), *flags]
    else: cmd = [sys.executable, "-m", "tests.fuzz.atheris_main", name, *flags]
    env = dict(os.environ, FUZZ_SLOW_DIR=str(work / "slow"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    t0 = time.monotonic()
    with open(work / "log.txt", "w") as log:
        r = subprocess.run(["nice", "-n", str(nice), *cmd], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                           timeout=seconds + 600)
    took = time.monotonic() - t0
    text = (work / "log.txt").read_text(errors="replace")
    stats = _STATUS.findall(text)
    execs, cov, ft, _, rss = map(int, stats[-1]) if stats else (0, 0, 0, 0, 0)
    if m := re.search(r"Done (\d+) runs in (\d+) second", text): execs = int(m.group(1))
    if m := re.search(r"stat::number_of_executed_units: (\d+)", text): execs = max(execs, int(m.group(1)))
    if m := re.search(r"stat::peak_rss_mb: (\d+)", text): rss = max(rss, int(m.group(1)))
    found = sorted(p for p in work.iterdir() if p.name.startswith(("crash-", "oom-", "timeout-", "leak-")))
    said = any(w in text for w in ("=== Uncaught Python exception", "ERROR: libFuzzer", "ERROR: AddressSanitizer",
                                   "runtime error:"))  # a process that died before writing its input says so
    kept = [save_input(seeds, p.read_bytes(), p.name.split("-")[0]) for p in found]
    slow = sorted((work / "slow").glob("slow-*")) if (work / "slow").is_dir() else []
    kept += [save_input(seeds, p.read_bytes(), "slow") for p in slow]
    fuzz_s = float(m.group(1)) if (m := re.search(r"Done \d+ runs in (\d+) second", text)) else took
    return dict(target=name, executions=execs, per_s=execs / max(fuzz_s, 1e-9), cov=cov, ft=ft,
                crashes=max(len(found), int(said)), slow=len(slow), rss_mb=rss, seconds=took, rc=r.returncode,
                kept=[str(p) for p in kept], log=str(work / "log.txt"))


def table(rows: list[dict]) -> str:
    head = "| target | executions | executions/s | coverage (edges / features) | crashes | slow inputs (>1 s) | " \
           "largest RSS |\n|---|---:|---:|---:|---:|---:|---:|"
    lines = [f"| {r['target']} | {r['executions']:,} | {r['per_s']:,.0f} | {r['cov']} / {r['ft']} | {r['crashes']} | "
             f"{r['slow']} | {r['rss_mb']} MB |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60, help="time per target (seconds)")
    ap.add_argument("--runs", type=int, default=None, help="stop a target after this many executions")
    ap.add_argument("--c-runs", type=int, default=None, help="the C decoder's --runs (default: --runs)")
    ap.add_argument("--targets", default="", help="comma-separated targets (default: all): " + ", ".join(all_targets()))
    ap.add_argument("--out", default=None, help="folder for logs and found inputs (default: a temporary folder)")
    ap.add_argument("--jobs", type=int, default=1, help="targets run at once")
    ap.add_argument("--nice", type=int, default=19, help="niceness of the fuzzing processes")
    a = ap.parse_args(argv)
    names = [t for t in a.targets.split(",") if t] or all_targets()
    if unknown := set(names) - set(all_targets()):
        ap.error(f"unknown targets {sorted(unknown)}; known: {', '.join(all_targets())}")
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="shardkit-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    binary = None
    if C_TARGET in names:
        if why := why_no_clang():
            print(f"skipping {C_TARGET}: {why}", file=sys.stderr); names.remove(C_TARGET)
        else:
            build = Path(tempfile.mkdtemp(prefix="shardkit-fuzz-build-"))  # 0700: nobody else can plant a binary
            binary = build_c(build)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    def one(n: str) -> dict:
        r = fuzz_one(n, a.seconds, a.c_runs or a.runs if n == C_TARGET else a.runs, out,
                     binary if n == C_TARGET else None, a.nice)
        row = table([r]).splitlines()[-1]  # each row as its target ends: a run stopped early keeps what it measured
        print(f"{time.strftime('%H:%M', time.gmtime())} {row}", file=sys.stderr, flush=True)
        with open(out / "rows.md", "a") as f: f.write(row + "\n")
        return r

    with ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(one, names))
    print(f"fuzz run started {started}, at most {a.seconds:g} s per target"
          + (f", {a.runs:,} runs" if a.runs else "") + (f" ({a.c_runs:,} for {C_TARGET})" if a.c_runs else "")
          + f"; logs in {out}")
    print(table(rows))
    for r in rows:
        for p in r["kept"]: print(f"{r['target']}: kept {p} (a regression input: add a test, fix the cause)")
        if r["crashes"]: print(f"{r['target']}: see {r['log']}")
    (out / "table.md").write_text(table(rows) + "\n")
    return 1 if any(r["crashes"] or r["slow"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
