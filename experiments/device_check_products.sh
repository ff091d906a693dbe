#!/usr/bin/env bash
# A short device run (issue #36, session 36): the bf16 product forms alone, then jsteer's halves of
# decoder-train (with the anatomy), attention, BERT 32 x 512 and decode at batch 1, to compare with
# the HF halves of the full run (experiments/device_check_full.sh) on the same kind. Per-step limits sum
# to 320 s (+ ~15 s set-up):
#   run(command="bash experiments/device_check_products.sh", carry=[".gpu"], timeout_s=360)
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
step "products" timeout 45 python3 experiments/bench_gpu_products.py --reps 10 --out "$OUT/products.json"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "decoder-train jax" timeout 110 $B --part decoder-train --framework jax --anatomy --reps 4 --out "$OUT/decoder_train_jax.json"
step "attention jax" timeout 35 $B --part attention --framework jax --reps 10 --out "$OUT/attention_jax.json"
step "bert jax" timeout 70 $B --part bert --framework jax --sizes 32x512 --reps 6 --out "$OUT/bert_jax.json"
step "decode jax" timeout 60 $B --part decode --framework jax --sizes 1 --reps 3 --out "$OUT/decode_jax.json"
