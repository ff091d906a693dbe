#!/usr/bin/env bash
# The prepared run on a lent GPU machine (issue #36), first call: what session 48 left owed, jsteer
# against HF PyTorch on the same chip in the same call, bf16 compute. After `bash experiments/device_bundle.sh`:
#   run(command="bash experiments/device_check.sh", carry=[".gpu"], timeout_s=530)
# then, warm, as budget allows: device_check_bert.sh (BERT 32 x 512 at both dropouts, jsteer's step traced,
# ~300 s), device_check_decode64.sh (batch 64 traced, steered and HF, ~330 s) or device_check_kala.sh (380 s).
# Per-step limits sum to 475 s (+ ~15 s set-up); a decode step took 81-88 s on jax 0.11 in s48 (the 1B
# init, the bandwidth probe, an 11 s compile); HF's batch-1 step ran past 60 s there (its static cache
# compiles with torch.compile), hence its 105 s.
# Session 48 removed a whole-table fp32 convert from the decode loop (take_rows): batch 1 went 1.82 ->
# 1.31 ms a step, 71% of the measured bound; batch 64 stayed at 1.85 ms. What this call measures:
#   decode.json  batch 1: jsteer, and three A/Bs of jsteer's half, each renamed after its tag:
#                "jsteer_obarrier" (--o-barrier: the output projection, which XLA:GPU strength-reduced to a
#                15.7 us multiply + reduce a layer with the attention's normalisation fused in, s48's trace,
#                where q's multiply + reduce of the same size takes 3.8 us; bench_gpu.py --help),
#                "jsteer_cublas" (XLA's Triton gemms off: the M = 1 gate/up and down products ran as Triton
#                gemms at 3.3-3.4 TB/s, 70% of the spec rate), "jsteer_nosr"
#                (--xla_gpu_enable_dot_strength_reduction=false: q, k, v and o stay products, not
#                multiply + reduce; a per-jit compiler option could scope it to the decode step if it wins),
#                and HF (static and dynamic caches) in the same call.
# Batch 64's trace moved to device_check_decode64.sh (no target rides on it).
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
D="--part decode --sizes 1 --reps 3"
step "decode jax, batch 1" timeout 95 $B $D --framework jax --out /tmp/parts/de_jax.json
step "decode jax, batch 1, o barrier" timeout 95 $B $D --framework jax --o-barrier --out /tmp/parts/de_jax_obarrier.json
step "decode jax, batch 1, no Triton gemms" timeout 95 env XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" \
  $B $D --framework jax --out /tmp/parts/de_jax_cublas.json
step "decode jax, batch 1, no dot strength reduction" timeout 95 env \
  XLA_FLAGS="--xla_gpu_enable_dot_strength_reduction=false" $B $D --framework jax --out /tmp/parts/de_jax_nosr.json
step "decode torch, batch 1" timeout 105 $B $D --framework torch --out /tmp/parts/de_torch.json
python3 experiments/device_parts.py decode "$OUT/decode.json" de_jax de_jax_obarrier de_jax_cublas de_jax_nosr \
  de_torch --tagged de_jax_obarrier de_jax_cublas de_jax_nosr
