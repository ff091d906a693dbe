#!/usr/bin/env bash
# A warm follow-up call on a lent GPU (issue #36), after device_check.sh: where BERT-base's 32 x 512 train
# step goes. Session 48 measured it at 0.92x HF with attention dropout 0 in both (45.8 vs 42.1 ms; with
# dropout 0.1 0.84x, s41) against a >= 1.3x target, with no trace of jsteer's step. This call times both
# frameworks at dropout 0 and 0.1 and traces jsteer's step (3 steps under jax.profiler) with its optimised
# HLO, summed per model op (gpu_trace_ops.py). Per-step limits sum to 290 s (+ ~15 s set-up):
#   run(command="bash experiments/device_check_bert.sh", carry=[".gpu"], timeout_s=320)
# $OUT gets gpu.txt, log.txt, bert.json, trace_bert/{trace.json.gz,ops.json}, trace_bert.hlo.tgz.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
S="--part bert --sizes 32x512 --reps 6"
step "bert jax, dropout 0, traced, HLO dumped" timeout 90 env XLA_FLAGS="--xla_dump_to=/tmp/hlo_bert \
--xla_dump_hlo_module_re=.*step_fn.*" $B $S --framework jax --attention-dropout 0 --trace /tmp/tr \
  --out /tmp/parts/bert_jax_nodrop.json
step "bert torch, dropout 0" timeout 60 $B $S --framework torch --attention-dropout 0 --out /tmp/parts/bert_torch_nodrop.json
step "bert jax, dropout 0.1" timeout 75 $B $S --framework jax --out /tmp/parts/bert_jax.json
step "bert torch, dropout 0.1" timeout 60 $B $S --framework torch --out /tmp/parts/bert_torch.json
mkdir -p "$OUT/trace_bert" && cp /tmp/tr/bert_32x512/trace.json.gz "$OUT/trace_bert/"
per_op /tmp/hlo_bert "$OUT/trace_bert/trace.json.gz" 3
python3 experiments/device_parts.py bert "$OUT/bert.json" bert_jax_nodrop=jsteer_nodrop bert_torch_nodrop=hf_nodrop \
  bert_jax=jsteer bert_torch=hf
