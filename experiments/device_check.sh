#!/usr/bin/env bash
# The prepared run on a lent GPU machine (issue #36), first call: what sessions 33-41 left owed, jsteer
# against HF PyTorch on the same chip in the same call, bf16 compute. After `bash experiments/device_bundle.sh`:
#   run(command="bash experiments/device_check.sh", carry=[".gpu"], timeout_s=500)
# then, warm, as budget allows: device_check_decode64.sh (batch 64 and the steer overhead, ~140 s) or
# device_check_kala.sh (380 s). Per-step limits sum to 465 s (+ ~15 s set-up); on jax 0.11 a decode step
# takes 62-72 s (the 1B init, the bandwidth probe, an 11 s compile), a BERT 32 x 512 one ~55 s.
# $OUT gets gpu.txt, log.txt, decode.json (batch 1: jsteer, then the A/B renamed beside it: "jsteer_cbwhile",
# XLA's command buffers (CUDA graphs) also capturing the while loop and its conditionals: a step costs
# 1.79 ms at batch 1 and 64 alike against a 0.84 ms bound (s41), a fixed cost per step that the host read
# of the loop condition does not explain (k = 8 changed nothing)), trace/decode_trace.json (the same
# call under the profiler: events per step on each stream, busy time; experiments/gpu_decode_trace.py),
# bert.json (32 x 512 with attention dropout 0, both frameworks: jsteer on cuDNN's flash attention, HF on
# SDPA's; rows "jsteer_nodrop", "hf_nodrop": how much of the 0.84x at dropout 0.1 (s41) is dropout's).
# The whole suite of earlier sessions is experiments/device_check_full.sh.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
D="--part decode --framework jax --sizes 1 --reps 3"
step "decode jax" timeout 110 $B $D --out /tmp/parts/de_jax.json
step "decode jax, command buffers + while" timeout 110 env \
  XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
  $B $D --out /tmp/parts/de_jax_cbwhile.json
# the step under jax.profiler: kernels launched per step and the device's busy time (decode_trace.json)
step "decode jax, traced" timeout 100 python3 experiments/gpu_decode_trace.py --new 32 --out "$OUT/trace"
step "bert jax, attention dropout 0" timeout 110 $B --part bert --framework jax --reps 6 --sizes 32x512 \
  --attention-dropout 0 --out /tmp/parts/bert_jax_nodrop.json
step "bert torch, attention dropout 0" timeout 35 $B --part bert --framework torch --reps 6 --sizes 32x512 \
  --attention-dropout 0 --out /tmp/parts/bert_torch_nodrop.json
P="python3 experiments/device_parts.py"
$P bert "$OUT/bert.json" bert_jax_nodrop=jsteer_nodrop bert_torch_nodrop=hf_nodrop
$P decode "$OUT/decode.json" de_jax de_jax_cbwhile --tagged de_jax_cbwhile
