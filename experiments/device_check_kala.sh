#!/usr/bin/env bash
# KALA on a lent GPU (issue #36's "relational <= 1.3x fine-tuning at batch 256"), a second call after
# experiments/device_check.sh: fine-tuning, pointwise KALA (entity memory + FiLM, no graph) and relational
# KALA against HF fine-tuning at batch 32 and 256, on CoNLL data read here by device_bundle.sh
# (bench_kala.py --data). Pointwise splits relational's extra cost between the graph and the rest.
# Session 37: batch 32 ran out 110 s (three graph buckets compiled), hence --graph-rungs 0 there too.
# Batch 256 again with jsteer's attention dropout in the Pallas kernel (--fused-dropout: MiniLM's
# 32-token attention in three kernels instead of the hand-written path's many small ones), before
# batch 32. jax 0.11 (s40-41) compiles 2-3x slower than s37's jax, so batch 256 (the target's shape) gets
# the call: per-step limits sum to 410 s, and batch 32 runs only with KALA_B32=1 (110 s more):
#   run(command="bash experiments/device_check_kala.sh", carry=[".gpu"], timeout_s=440)
# First, 50 s: contended f32 scatters as is and with LLVM's -nvptx-allow-ftz-atomics
# (gpu_scatter_probe.py, jsteer.gpu_atomics; jax 0.10.2-0.11.0's CUDA plugins lower them to CAS loops).
# Session 50 (Zen 5 CPU, batch 256, 12 interleaved steps each): pointwise 1.06x fine-tuning's step,
# relational 1.15x; the GPU's 2.16x (s37) has no per-op account, so the first step also traces each jsteer
# step (3 steps, jax.profiler) with its optimised HLO, summed per model op:
# $OUT/trace_kala/<method>/{trace.json.gz,ops.json}, trace_kala.hlo.tgz.
source experiments/device_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45  # jax and torch share the process
step "scatter probe" timeout 25 python3 experiments/gpu_scatter_probe.py --out "$OUT/scatter.json"
step "scatter probe, ftz atomics" timeout 25 env XLA_FLAGS=--xla_backend_extra_options=-nvptx-allow-ftz-atomics \
  python3 experiments/gpu_scatter_probe.py --out "$OUT/scatter_ftz_atomics.json"
K="python3 experiments/bench_kala.py --methods finetune,pointwise,relational --graph-rungs 0"
step "kala b256, traced, HLO dumped" timeout 230 env XLA_FLAGS="--xla_dump_to=/tmp/hlo_kala \
--xla_dump_hlo_module_re=.*step_fn.*" $K --data .gpu/kala_conll_4096.pkl.gz --examples 4096 --batch-size 256 \
  --steps 6 --rounds 3 --trace /tmp/trk --out "$OUT/kala_b256.json"
for m in finetune pointwise relational; do
  mkdir -p "$OUT/trace_kala/$m" && cp /tmp/trk/$m/trace.json.gz "$OUT/trace_kala/$m/" &&
    per_op /tmp/hlo_kala "$OUT/trace_kala/$m/trace.json.gz" 3 "$OUT/trace_kala.hlo.tgz" | head -25
done
step "kala b256, fused dropout" timeout 130 $K --data .gpu/kala_conll_4096.pkl.gz --examples 4096 \
  --batch-size 256 --steps 6 --rounds 3 --methods finetune,relational --no-torch --fused-dropout \
  --out "$OUT/kala_b256_fused.json"
if [ "${KALA_B32:-0}" = 1 ]; then
  step "kala b32" timeout 110 $K --data .gpu/kala_conll_512.pkl.gz --examples 512 --steps 8 --rounds 2 \
    --out "$OUT/kala_b32.json"
fi
