"""A new user's first hour, as a script: a fresh virtual environment with this checkout installed, a fresh folder
holding an ImageFolder tree of 200 JPEGs in 4 class folders (`mydata/`), then the README's "Your own data" lines
exactly as the README writes them: convert the tree, profile it, train on it, write shards of samples made in Python,
and load both without naming a field. Every step must end well, with no warning and no traceback."""
import os
import re
import subprocess
import sys
from pathlib import Path
import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def readme_steps() -> list[tuple[str, str]]:
    "(language, code) of the README's 'Your own data' blocks, in order: each bash line a step, each python block one."
    text = (ROOT / "README.md").read_text()
    section = text[text.index("<!-- your-own-data"):]
    section = section[:section.index("\n## ")]
    steps = []
    for lang, code in re.findall(r"```(bash|python)\n(.*?)```", section, re.S):
        if lang == "python": steps.append((lang, code))
        else: steps += [(lang, line) for line in code.splitlines() if line.strip()]
    return steps


def image_tree(root: Path, n: int = 200, classes=("bird", "cat", "dog", "fish")):
    "`n` JPEGs of 60-160 pixels a side, in one folder per class, the way people's photo folders look."
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / classes[i % len(classes)]
        folder.mkdir(parents=True, exist_ok=True)
        h, w = rng.integers(60, 160, 2)
        base = rng.integers(0, 256, 3)
        pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"IMG_{i:04d}.jpg", quality=85)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    "A new virtual environment with this checkout installed into it (its dependencies from this Python's packages)."
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", env], check=True)
    r = subprocess.run([env / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "-e", ROOT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return env


@pytest.mark.slow
def test_first_hour_with_your_own_data(fresh_venv, tmp_path):
    steps = readme_steps()
    assert [lang for lang, _ in steps] == ["bash"] * 3 + ["python"], steps
    image_tree(tmp_path / "mydata")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AIS_ENDPOINT", "PYTHONWARNINGS")}
    env.update(PATH=f"{fresh_venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(fresh_venv))
    out = {}
    for lang, code in steps:
        cmd = ["bash", "-c", code] if lang == "bash" else [fresh_venv / "bin" / "python", "-c", code]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        said = r.stdout + r.stderr
        assert r.returncode == 0, f"{code}\nfailed:\n{said[-3000:]}"
        assert "Traceback" not in said and not re.search(r"\w*Warning\b", said), f"{code}\nwarned:\n{said[-3000:]}"
        out[code.split("#")[0].strip()] = r.stdout
    convert, profile, train, python = out.values()
    assert "200 samples in 16 shards" in convert and "mydata-000015.tar" in convert, convert
    assert (tmp_path / "myshards" / "mydata-manifest.json").is_file()
    assert "verdict:" in profile and "200 samples" in profile, profile
    assert "4 classes" in train and "epoch 1/1: 200 samples" in train, train
    assert "fields=('cls', 'jpg')" in python and "fields=('caption.txt', 'cls', 'features.npy', 'image.jpg')" in python
    assert "myshards 200 samples" in python and "ownshards 200 samples" in python, python
    # the venv's own shardkit ran, not this checkout's by another path
    where = subprocess.run([fresh_venv / "bin" / "python", "-c", "import sys, shardkit; print(sys.prefix)"], env=env,
                           capture_output=True, text=True, cwd=tmp_path)
    assert where.stdout.strip() == str(fresh_venv), where
