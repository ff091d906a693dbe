#!/usr/bin/env bash
# Second, warm call on a lent GPU (issue #36), after device_check.sh: ~1B decoder, greedy 128 tokens at
# batch 64, jsteer plain and steered (the steer overhead, 5.4% in s37 against a <= 5% target) and HF's
# dynamic cache. run(command="bash experiments/device_check_decode64.sh", carry=[".gpu"], timeout_s=230)
# $OUT gets gpu.txt, log.txt, decode64.json.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "decode jax, batch 64" timeout 150 $B --part decode --framework jax --sizes 64 --reps 3 \
  --out /tmp/parts/de64_jax.json
step "decode torch, batch 64" timeout 60 $B --part decode --framework torch --sizes 64 --reps 2 \
  --out /tmp/parts/de64_torch.json
python3 experiments/device_parts.py decode "$OUT/decode64.json" de64_jax de64_torch
