"""One target under atheris (coverage-guided, libFuzzer's engine): `python -m tests.fuzz.atheris_main NAME [libFuzzer
flags] [corpus folders]`. An error outside the target's allowed ones, or a broken invariant, is a crash: libFuzzer
writes the input as `crash-*` under -artifact_prefix. An input slower than 1 s is kept under $FUZZ_SLOW_DIR."""
import os
import sys
import atheris

with atheris.instrument_imports(include=["tests.fuzz"]):
    from tests.fuzz import targets  # noqa: F401  (registers the targets)
from tests.fuzz.core import SLOW_S, TARGETS, save_input


def main():
    name, flags = sys.argv[1], sys.argv[2:]
    t = TARGETS[name]
    with atheris.instrument_imports(include=list(t.instrument)):
        t.ready()  # the target's modules are imported here, instrumented
        try: t.check(b"")  # the first call imports what parsers import lazily: not timed as an input
        except Exception: pass
    slow_dir = os.environ.get("FUZZ_SLOW_DIR")

    def test_one(data: bytes):
        took = t.check(data)
        if took > SLOW_S and slow_dir: save_input(__import__("pathlib").Path(slow_dir), data, "slow")

    atheris.Setup([sys.argv[0], *flags], test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
