#!/usr/bin/env bash
# Session 48's call on a lent GPU (issue #36), after take_rows stopped viewing the whole table as
# float32 in the forward pass: s48's trace (device_check.sh) showed a 1B decoder's tied 128k x 2048
# table converted to float32 inside the decode loop every step (0.38 ms, "wrapped_convert") and the
# head's product reading that float32 copy (0.24 ms), of a 1.79 ms step.
#   run(command="bash experiments/device_check_decode1.sh", carry=[".gpu"], timeout_s=450)
# $OUT gets gpu.txt, log.txt, decode.json (batch 1 jsteer and HF, batch 64 jsteer and steered),
# trace/decode_trace.json (+ trace.json.gz) and hlo.tgz (the decode program as XLA:GPU optimised it,
# to map the trace's fusion names to the model's ops on a machine without a GPU).
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "decode jax, batch 1" timeout 110 $B --part decode --framework jax --sizes 1 --reps 3 --out /tmp/parts/de_jax.json
step "decode torch, batch 1" timeout 60 $B --part decode --framework torch --sizes 1 --reps 3 \
  --out /tmp/parts/de_torch.json
step "decode jax, traced, HLO dumped" timeout 110 env XLA_FLAGS="--xla_dump_to=/tmp/hlo \
--xla_dump_hlo_module_re=.*generate.*" python3 experiments/gpu_decode_trace.py --new 32 --out "$OUT/trace"
(cd /tmp/hlo && tar czf "$OUT/hlo.tgz" $(ls | grep -E 'after_optimizations\.txt$'))
step "decode jax, batch 64" timeout 120 $B --part decode --framework jax --sizes 64 --reps 2 \
  --out /tmp/parts/de64_jax.json
python3 experiments/device_parts.py decode "$OUT/decode.json" de_jax de_torch de64_jax
