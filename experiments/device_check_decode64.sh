#!/usr/bin/env bash
# Second, warm call on a lent GPU (issue #36), after device_check.sh: ~1B decoder, greedy 128 tokens at
# batch 64, jsteer plain and steered (the steer overhead: 5.4% in s37, 2.3% in s48, against <= 5%) and HF's
# dynamic cache; then the batch-64 step under jax.profiler with its optimised HLO, summed per model op
# (1.85 ms a step in s48 against a 0.93 ms bound, unexplained; batch 1 takes 1.31 ms).
#   run(command="bash experiments/device_check_decode64.sh", carry=[".gpu"], timeout_s=350)
# Per-step limits sum to 320 s. $OUT gets gpu.txt, log.txt, decode64.json, trace64/{trace.json.gz,
# decode_trace.json,ops.json}, trace64.hlo.tgz.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "decode jax, batch 64" timeout 150 $B --part decode --framework jax --sizes 64 --reps 3 \
  --out /tmp/parts/de64_jax.json
step "decode torch, batch 64" timeout 60 $B --part decode --framework torch --sizes 64 --reps 2 \
  --out /tmp/parts/de64_torch.json
python3 experiments/device_parts.py decode "$OUT/decode64.json" de64_jax de64_torch
step "decode jax, batch 64, traced, HLO dumped" timeout 110 env XLA_FLAGS="--xla_dump_to=/tmp/hlo \
--xla_dump_hlo_module_re=.*generate.*" python3 experiments/gpu_decode_trace.py --batch 64 --new 32 --out "$OUT/trace64"
per_op /tmp/hlo "$OUT/trace64/trace.json.gz" 32
