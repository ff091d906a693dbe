#!/usr/bin/env bash
# One prepared run on a lent GPU machine (see experiments/device_bundle.sh, which builds .gpu/).
# Through the device tool: run(command="bash experiments/device_check.sh", carry=[".gpu"]).
# Writes under $OUT (8 files at most come back): the train-step anatomy (jsteer bf16 / fp32 vs HF
# bf16, experiments/gpu_step_anatomy.py), KALA train throughput + MFU at batch 32 and 256 (jsteer
# fine-tuning vs KALA vs HF PyTorch, bf16), bench_train's BERT-base bf16 MFU, and the random-config
# parity tests run with jax on the GPU (HF torch references on the host).
# Step limits sum to 560 s: run it with timeout_s=580. Session 29's H100 results (before the
# float32 scatter accumulation): experiments/results/gpu_h100_2026-11-26/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.5  # leave the other half to torch in the same process
mkdir -p ../shared && ln -sfn "$PWD/.gpu/data" ../shared/data
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, optax, orbax.checkpoint as oc, torch, transformers as t; \
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, \
'transformers', t.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
step() { echo "=== $1"; shift; "$@" 2>&1 | tee -a "$OUT/log.txt" | grep -vE "Warning|warn\(" | tail -25; }
step "anatomy" timeout 120 python3 experiments/gpu_step_anatomy.py --out "$OUT/step_anatomy.json"
step "kala b32" timeout 120 python3 experiments/bench_kala.py --steps 10 --rounds 3 --out "$OUT/kala_b32.json"
step "kala b256" timeout 100 python3 experiments/bench_kala.py --batch-size 256 --examples 4096 --steps 6 \
  --rounds 3 --graph-rungs 0 --out "$OUT/kala_b256.json"
step "bert-base bf16" timeout 100 python3 experiments/bench_train.py --steps 20 --out "$OUT/bench_train.json"
step "parity on gpu" timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m "not slow" \
  tests/test_bert.py tests/test_llama.py tests/test_gpt2.py tests/test_kala.py tests/test_steer.py
