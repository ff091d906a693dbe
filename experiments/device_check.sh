#!/usr/bin/env bash
# The prepared run on a lent GPU machine (issue #36), first call: what session 48 left owed, jsteer
# against HF PyTorch on the same chip in the same call, bf16 compute. After `bash experiments/device_bundle.sh`:
#   run(command="bash experiments/device_check.sh", carry=[".gpu"], timeout_s=530)
# then, warm, as budget allows: device_check_bert.sh (BERT 32 x 512 both dropouts, jsteer's step traced, ~300 s),
# device_check_decode64.sh (batch 64, the steer overhead and HF, ~140 s) or device_check_kala.sh (380 s). Per-step limits sum to 500 s (+ ~15 s set-up); a decode step took 81-88 s
# on jax 0.11 in s48 (the 1B init, the bandwidth probe, an 11 s compile); HF's batch-1 step ran past 60 s
# there (its static cache compiles with torch.compile).
# Session 48 removed a whole-table fp32 convert from the decode loop (take_rows): batch 1 went 1.82 ->
# 1.31 ms a step, 71% of the measured bound; batch 64 stayed at 1.85 ms. What this call measures:
#   decode.json  batch 1: jsteer, jsteer with --o-barrier renamed "jsteer_obarrier" (the A/B for the output
#                projection that XLA:GPU strength-reduced to a 15.7 us multiply + reduce a layer, s48's
#                trace; bench_gpu.py --help), with XLA's Triton gemms off renamed "jsteer_cublas" (the M = 1
#                gate/up and down products ran as Triton gemms at 3.3-3.4 TB/s, 70% of the spec rate: the A/B
#                for cuBLAS's), and HF (static and dynamic caches) in the same call;
#   trace64/     the batch-64 step under jax.profiler (gpu_decode_trace.py): where its 1.85 ms go, per
#                model op in ops.json (gpu_trace_ops.py: the kernels mapped to the JAX ops through the HLO);
#   hlo64.tgz    that program as XLA:GPU optimised it (the trace's fusion names -> the model's ops).
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
D="--part decode --sizes 1 --reps 3"
step "decode jax, batch 1" timeout 95 $B $D --framework jax --out /tmp/parts/de_jax.json
step "decode jax, batch 1, o barrier" timeout 95 $B $D --framework jax --o-barrier --out /tmp/parts/de_jax_obarrier.json
step "decode jax, batch 1, no Triton gemms" timeout 95 env XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" \
  $B $D --framework jax --out /tmp/parts/de_jax_cublas.json
step "decode torch, batch 1" timeout 105 $B $D --framework torch --out /tmp/parts/de_torch.json
step "decode jax, batch 64, traced, HLO dumped" timeout 110 env XLA_FLAGS="--xla_dump_to=/tmp/hlo \
--xla_dump_hlo_module_re=.*generate.*" python3 experiments/gpu_decode_trace.py --batch 64 --new 32 --out "$OUT/trace64"
(cd /tmp/hlo && tar czf "$OUT/hlo64.tgz" $(ls | grep -E 'after_optimizations\.txt$'))
python3 experiments/gpu_trace_ops.py "$OUT/trace64/trace.json.gz" /tmp/hlo --steps 32 --out "$OUT/trace64/ops.json"
python3 experiments/device_parts.py decode "$OUT/decode.json" de_jax de_jax_obarrier de_jax_cublas de_torch \
  --tagged de_jax_obarrier de_jax_cublas
