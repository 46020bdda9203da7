#!/usr/bin/env bash
# The GPU loader's device check, for a session with a GPU machine (H100/H200, 16 cores, Python 3.12 with torch, no
# network). From the checkout's root, with webdataset, braceexpand, fastcore and wids as wheels in .whl/:
#     bash tests/gpu_check.sh                      # on the GPU machine: under 8 minutes
#     GPU_CHECK_DEVICE=cpu bash tests/gpu_check.sh # a dry run of the same steps with tiny sizes on a CPU
# It writes 4,000 photo-like 500 x 375 JPEGs into shards (shardkit.ingest.synth), runs every CUDA test, then
# `shardkit bench gpu --step resnet50` with 4 and with 15 workers, and prints a summary. $OUT (if set) receives
# pytest.txt, bench-w4.json, bench-w15.json and summary.txt. A shorter run: GPU_CHECK_N (images), GPU_CHECK_SAMPLES
# (per timed row), GPU_CHECK_WORKERS ("4 15"), GPU_CHECK_TESTS (pytest's arguments).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DEV=${GPU_CHECK_DEVICE:-cuda}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 SHARDKIT_HOME=$WORK/home PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
if ! $PY -c "import webdataset, braceexpand, fastcore" 2>/dev/null; then  # the GPU machine: carried wheels
    ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: webdataset etc. missing, no .whl/ (facts.md)"; exit 1; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        || exit 1
    export PYTHONPATH=$ROOT:$WORK/site${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$DEV" = cpu ]; then  # the dry run: the same steps, tiny
    N=64; W=160; H=120; BENCH="--device cpu --step small --size 32 --batch-size 16 --samples 32 --thread both"
    WORKERS="1 2"
else
    N=${GPU_CHECK_N:-4000}; W=500; H=375; WORKERS=${GPU_CHECK_WORKERS:-"4 15"}
    BENCH="--device cuda --step resnet50 --size 224 --batch-size 128 --samples ${GPU_CHECK_SAMPLES:-3000}"
    BENCH="$BENCH --thread ${GPU_CHECK_THREAD:-both}"
fi
DATA=$WORK/shards-$N-${W}x$H
T0=$(date +%s)
echo "== gpu_check on $DEV: $($PY -c 'import torch, torchvision as tv; print("torch", torch.__version__, "torchvision",
    tv.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")')"

echo "== data: $N photo-like ${W}x$H JPEGs (q90) in shards of 100 -> $DATA"
timeout 90 $PY - "$DATA" "$N" "$W" "$H" <<'PY' || { echo "gpu_check: making the data failed"; exit 1; }
import os, sys, time
from multiprocessing import Pool
from pathlib import Path
import numpy as np
from shardkit.shards.write import write_shards
from shardkit.ingest.synth import draw_animal, jpeg_bytes
dest, n, w, h = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def sample(i):
    cls = i % 37
    img, _ = draw_animal(cls, np.random.default_rng(i), size=(w, h))
    return {"__key__": f"img{i:06d}", "jpg": jpeg_bytes(img, 90), "cls": str(cls).encode()}
if len(list(dest.glob("*.tar"))) * 100 < n:
    t = time.time()
    with Pool(os.cpu_count()) as pool:
        write_shards(pool.imap(sample, range(n), chunksize=16), str(dest), prefix="gpu-", maxcount=100, progress=False)
    print(f"wrote {n} samples in {time.time() - t:.1f} s")
else: print("already there")
PY

echo "== tests/test_gpu.py"
timeout 180 $PY -m pytest ${GPU_CHECK_TESTS:-tests/test_gpu.py tests/test_loader.py tests/test_train.py tests/test_profile.py -k cuda} -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" \
    | grep -v "Warning\|warnings.warn\|^  "
for w in $WORKERS; do
    echo "== shardkit bench gpu $BENCH --workers $w"
    PYTHONWARNINGS=ignore timeout 100 $PY -m shardkit.apps.cli bench gpu "$DATA" --image-field jpg $BENCH --workers "$w" \
        --json "$OUT/bench-w$w.json" 2>&1 \
        | grep -v "Warning\|warnings.warn"
done

if [ -n "${GPU_CHECK_PROFILE:-}" ]; then  # where the main thread's time goes (tests/gpu_profile.py)
    echo "== profile: GPU loader alone, + step, CPU loader + step"
    PYTHONWARNINGS=ignore timeout 150 $PY tests/gpu_profile.py "$DATA" "$OUT/profile.txt" --image jpg \
        $( [ "$DEV" = cpu ] && echo "--device cpu --step small --size 32 --batch-size 16 --batches 3 --cpu-workers 2" )
fi
TRAIN_N=${GPU_CHECK_TRAIN_SAMPLES:-}  # shardkit train with epochs long enough to be steady (the N JPEGs copied)
if [ -n "$TRAIN_N" ]; then
    LONG=$WORK/long-$TRAIN_N
    timeout 90 $PY - "$DATA" "$LONG" "$TRAIN_N" <<'PY' || { echo "gpu_check: copying the data failed"; exit 1; }
import io, os, sys, tarfile
from multiprocessing import Pool
from pathlib import Path
src, dest, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
shards = sorted(src.glob("*.tar"))
def copy(job):
    j, shard = job
    out = dest / f"long-{j:03d}-{shard.name}"
    if out.exists(): return
    with tarfile.open(shard) as t, tarfile.open(str(out) + ".tmp", "w") as w:
        for m in t:
            data = t.extractfile(m).read()
            m.name = f"c{j:03d}-{m.name}"
            w.addfile(m, io.BytesIO(data))
    os.replace(str(out) + ".tmp", out)
per = sum(1 for m in tarfile.open(shards[0]) if m.name.endswith(".jpg")) * len(shards)
dest.mkdir(parents=True, exist_ok=True)
with Pool(os.cpu_count()) as pool: pool.map(copy, [(j, s) for j in range(-(-n // per)) for s in shards])
print(f"{len(list(dest.glob('*.tar')))} shards in {dest}")
PY
    for dec in ${GPU_CHECK_TRAIN_DECODE:-cpu}; do
        echo "== shardkit train --arch resnet50, 2 epochs of $TRAIN_N samples, decode $dec"
        PYTHONWARNINGS=ignore timeout 150 $PY -m shardkit.apps.cli train --shards "$LONG/{$(ls $LONG | sed 's/\.tar$//' \
            | paste -sd, -)}.tar" --arch "$([ "$DEV" = cpu ] && echo small || echo resnet50)" --epochs 2 \
            --size "$([ "$DEV" = cpu ] && echo 32 || echo 224)" --batch-size "$([ "$DEV" = cpu ] && echo 16 || echo 128)" \
            --workers "${GPU_CHECK_TRAIN_WORKERS:-12}" --classes 37 --decode-on "$dec" --device "$DEV" \
            --json-out "$OUT/train-$dec.json" 2>&1 | grep -v "Warning\|warnings.warn\|it/s\]"
    done
fi

echo "== summary ($(( $(date +%s) - T0 )) s)"
$PY - "$OUT" $WORKERS <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
log = out / "pytest.txt"
tail = log.read_text().strip().splitlines() if log.exists() and log.read_text().strip() else ["(no pytest output)"]
print("tests:", next((l for l in reversed(tail) if re.search(r"passed|failed|error", l)), tail[-1]))
for f in sorted(out.glob("train-*.json")):
    for r in json.loads(f.read_text()):
        print(f"{f.stem}: epoch {r['epoch']}: {r['samples']} samples, {r['samples_per_s']:.0f} samples/s, "
              f"waiting {r['wait_share']:.0%}")
for w in sys.argv[2:]:
    f = out / f"bench-w{w}.json"
    if not f.exists(): print(f"bench with {w} workers: no result"); continue
    d = json.loads(f.read_text())
    s = d["setup"]
    print(f"bench, {w} workers ({s['step']}, batch {s['batch_size']}, {s['gpu'] or s['device']}):")
    for r in d["rows"]:
        print(f"  {r['name']:<58} {r['rate']:>8.0f} samples/s  {r.get('vs_step', r.get('vs_cpu', 0)):.2f}x  "
              f"main CPU {r['cpu_ms']:.3f} ms/sample")
PY
