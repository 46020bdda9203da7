"""`shardkit demo` end to end on a tiny data set, on the embedded default: files, summary, reuse on re-run, bad input.
The demo's run on AIStore is nbs/39_demo's (the test suite runs that notebook against its cluster): one run per backend."""
import json, time
import pytest

FILES = ("samples.png", "loss.png", "bench-loader.txt", "bench-loader.png", "summary.txt", "demo-state.json")


@pytest.mark.timed
@pytest.mark.slow
def test_demo_end_to_end_and_rerun_reuses_steps(cli, tmp_path):
    out = tmp_path / "demo"
    t0 = time.time()
    r = cli("demo", "--out", out, "--n", "74", "--epochs", "1", "--bench-samples", "100", timeout=300)
    first = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    for f in FILES:
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    summary = (out / "summary.txt").read_text()
    for line in ("shardkit demo: done", "74 synthetic Oxford-IIIT Pet images", "37 train samples", "37 test samples",
                 "by local", "sidecar running shardkit.demo:shrink_pets", "test accuracy", "learning check >= 3x",
                 "AIStore post's pipeline", "webdataset, done well", "goal: default >= 1.10x the fastest exactly-once peer"):
        assert line in summary, (line, summary)
    assert summary.strip() in r.stdout
    state = json.loads((out / "demo-state.json").read_text())
    assert set(state) == {"data", "shuffle", "train", "bench"}

    t0 = time.time()
    r2 = cli("demo", "--out", out, "--n", "74", "--epochs", "1", "--bench-samples", "100", timeout=300)
    assert r2.returncode == 0, r2.stderr[-3000:]
    for step in ("data: reusing", "shuffle: reusing", "train: reusing", "bench: reusing"):
        assert step in r2.stdout, (step, r2.stdout)
    assert time.time() - t0 < first / 2
    assert json.loads((out / "demo-state.json").read_text())["train"] == state["train"]


def test_demo_bad_input_says_what_to_do(tmp_path, capsys):
    from shardkit.cli import main
    assert main(["demo", "--out", str(tmp_path), "--pets", str(tmp_path / "no-such-pets")]) == 2
    err = capsys.readouterr().err
    assert "no annotations/list.txt" in err and "no-such-pets" in err
    assert main(["demo", "--out", str(tmp_path), "--n", "5"]) == 2
    assert "--n must be >= 37, got 5" in capsys.readouterr().err
    assert not (tmp_path / "demo-state.json").exists(), "nothing ran"
    with pytest.raises(SystemExit) as e: main(["demo", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--pets" in out and "--out" in out

