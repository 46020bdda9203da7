"""What every fuzz target shares: the registry, the invariants checked around each input, a small mutator."""
from __future__ import annotations
import hashlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
SLOW_S = 1.0  # an input that takes more CPU seconds than this is a finding


class Broken(AssertionError):
    "An invariant that does not hold for an input (a differential mismatch, a wrong answer): always a finding."


@dataclass
class Target:
    "A target: `setup()` gives `one(data)`, which parses `data` and checks invariants; `allowed`: errors it may raise."
    name: str
    setup: Callable[[], Callable[[bytes], None]]
    allowed: tuple = ()
    doc: str = ""
    instrument: tuple = ("shardkit",)
    one: Callable | None = field(default=None, repr=False)

    def ready(self) -> Callable[[bytes], None]:
        if self.one is None: self.one = self.setup()
        return self.one

    def check(self, data: bytes) -> float:
        "Run one input; re-raise anything not in `allowed` (a finding). CPU seconds it took (all threads)."
        # CPU time, not wall time: on a loaded machine a process may wait for a core for seconds; a hang is caught
        # by libFuzzer's wall-clock -timeout instead
        one, t0 = self.ready(), time.process_time()
        try: one(data)
        except Broken: raise
        except self.allowed: pass
        return time.process_time() - t0

    @property
    def corpus(self) -> Path: return CORPUS / self.name


TARGETS: dict[str, Target] = {}


def target(name: str, *, allowed: tuple | None = None, instrument: tuple = ("shardkit",)):
    "Register `setup` as target `name`; `allowed` defaults to shardkit's own errors (ShardkitError)."
    def deco(setup):
        from shardkit.errors import ShardkitError
        TARGETS[name] = Target(name, setup, allowed if allowed is not None else (ShardkitError,),
                               (setup.__doc__ or "").strip(), instrument)
        return setup
    return deco


def corpus_files(name: str) -> list[Path]:
    d = CORPUS / name
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith(".")) if d.is_dir() else []


def mutate(data: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    "One random edit of `data`: flip, set, insert, delete, duplicate, cut, splice with another seed (the smoke run's)."
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        op, n = rng.randrange(8), len(b)
        i = rng.randrange(n) if n else 0
        if op == 0 and n: b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n: b[i] = rng.choice((0, 0xFF, 0x7F, 0x80, 0x30, 0x20, rng.randrange(256)))
        elif op == 2: b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3 and n: del b[i:i + rng.randrange(1, 65)]
        elif op == 4 and n: j = rng.randrange(i, n + 1); b[i:i] = b[i:j][:512]
        elif op == 5 and n: del b[rng.randrange(n):]
        elif op == 6 and pool:
            o = rng.choice(pool); j = rng.randrange(len(o) + 1); b = b[:i] + bytearray(o[j:j + rng.randrange(1, 600)])
        elif op == 7 and n >= 4:  # a number a parser reads: big, negative, zero
            b[i:i + 4] = rng.choice((b"\xff\xff\xff\xff", b"\0\0\0\0", b"9999", b"-1\0\0", b"7777"))
    return bytes(b)


def save_input(folder: Path, data: bytes, prefix: str) -> Path:
    "Keep `data` in `folder` under its hash (a crash or slow input found by a run)."
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"{prefix}-{hashlib.sha1(data).hexdigest()[:16]}"
    p.write_bytes(data)
    return p


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
