#!/usr/bin/env bash
# A short device run for a session with under 5 minutes of device time left (experiments/device_check_full.sh
# needs ~9): jsteer's side only of the 1B decoder train step and batch-1 decoding on the GPU, to compare
# with the HF numbers a full run measured on the same kind of chip. Limits sum to 150 s.
#   run(command="bash experiments/device_quick.sh", carry=[".gpu"], timeout_s=170, kind=<the full run's kind>)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
B="python3 experiments/bench_gpu.py --framework jax"
timeout 80 $B --part decoder-train --reps 3 --out "$OUT/decoder_train_jax.json" 2>&1 | grep -v Warn | tail -3
timeout 70 $B --part decode --sizes 1 --reps 3 --out "$OUT/decode_jax_b1.json" 2>&1 | grep -v Warn | tail -3
