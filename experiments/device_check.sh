#!/usr/bin/env bash
# The prepared run on a lent GPU machine (issue #36), first call: what sessions 33-37 left owed, jsteer
# against HF PyTorch on the same chip in the same call, bf16 compute. After `bash experiments/device_bundle.sh`:
#   run(command="bash experiments/device_check.sh", carry=[".gpu"], timeout_s=570)
# then, warm: run(command="bash experiments/device_check_kala.sh", carry=[".gpu"], timeout_s=380).
# Per-step limits sum to 555 s (+ ~15 s set-up). $OUT gets gpu.txt, log.txt, bert.json (jsteer, HF,
# jsteer with attention dropout in the Pallas kernel (rows "jsteer_fused": its first GPU run) and, at
# 32 x 128, jsteer with the attention products before 062e1a5: the A/B for 20.96 -> 26.2 ms
# between sessions 36 and 37), decode.json (batch 1 and 64, both halves; batch 1 also with
# generate(steps_per_check=8): rows "jsteer_k8", "jsteer_fraction_of_bound_k8"; and with the one-row cache
# unbatched: rows "jsteer_unbatched", ...). The whole suite of earlier
# sessions (the 1B train step's anatomy, attention, products, jvp) is experiments/device_check_full.sh.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "bert jax" timeout 100 $B --part bert --framework jax --reps 6 --out /tmp/parts/bert_jax.json
# attention dropout fused into one Pallas (Triton) kernel, same mask (jsteer/backbones/flash.py); BERT 32 x 512
# ran at 0.69x HF (s36) on the hand-written path, which keeps the fp32 [B, N, T, S] tensors in HBM
step "bert jax, fused dropout" timeout 90 $B --part bert --framework jax --reps 6 --fused-dropout \
  --out /tmp/parts/bert_jax_fused.json
step "bert jax, products before 062e1a5" timeout 50 $B --part bert --framework jax --reps 6 --sizes 32x128 \
  --attention-products preferred --out /tmp/parts/bert_jax_preferred.json
step "bert torch" timeout 60 $B --part bert --framework torch --reps 6 --out /tmp/parts/bert_torch.json
step "decode jax" timeout 100 $B --part decode --framework jax --reps 3 --out /tmp/parts/de_jax.json
# A/B: 8 decode steps per host read of the while loop's condition (XLA:GPU copies it to the host each
# iteration, draining the queue); batch 1 sat at 1.79 ms/step against a 1.03 ms bandwidth bound (s37)
step "decode jax, 8 steps per check" timeout 50 $B --part decode --framework jax --sizes 1 --reps 3 \
  --steps-per-check 8 --out /tmp/parts/de_jax_k8.json
# A/B: the one-row cache carried and written without its batch axis (CPU's default since s39: XLA:CPU
# copied every layer's cache each step with it kept; the GPU programs keep it, unmeasured)
step "decode jax, one-row cache unbatched" timeout 40 $B --part decode --framework jax --sizes 1 --reps 3 \
  --one-row-cache unbatched --out /tmp/parts/de_jax_unbatched.json
# batch 1 only: at 64 the static cache ran out every limit so far and the dynamic one is ~7x behind (s33-s37)
step "decode torch" timeout 65 $B --part decode --framework torch --sizes 1 --reps 3 --out /tmp/parts/de_torch.json
python3 - "$OUT" <<'PYEOF'
import json, pathlib, sys
out, parts = pathlib.Path(sys.argv[1]), pathlib.Path("/tmp/parts")
def load(name):
    f = parts / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None
# BERT: one row per shape with jsteer, jsteer_fused, jsteer_preferred and hf
bert = {"runs": {}, "missing": []}
for name, key in (
    ("bert_jax", "jsteer"),
    ("bert_jax_fused", "jsteer_fused"),
    ("bert_jax_preferred", "jsteer_preferred"),
    ("bert_torch", "hf"),
):
    d = load(name)
    if d is None:
        bert["missing"].append(name)
        continue
    bert.setdefault("env", {})[name] = {k: d.get(k) for k in ("jax", "flax", "torch", "transformers", "wall_s")}
    bert.setdefault("config", d.get("config"))
    for r in d.get("runs", []):
        row = bert["runs"].setdefault(f"{r['batch']}x{r['seq']}", {"flops_per_step": r["flops_per_step"]})
        src = r.get("hf" if key == "hf" else "jsteer")
        if src:
            row[key] = src
for row in bert["runs"].values():
    for k in ("jsteer", "jsteer_fused", "jsteer_preferred"):
        if k in row and "hf" in row:
            row[f"{k}_over_hf"] = row[k]["examples_per_s"] / row["hf"]["examples_per_s"]
(out / "bert.json").write_text(json.dumps(bert, indent=1) + "\n")
print("bert", json.dumps(bert["runs"])[:1500])
# decode: runs merged per batch
dec = {"runs": {}, "missing": []}
for name in ("de_jax", "de_jax_k8", "de_jax_unbatched", "de_torch"):
    d = load(name)
    if d is None:
        dec["missing"].append(name)
        continue
    for b, r in d.pop("runs", {}).items():
        if name in ("de_jax_k8", "de_jax_unbatched"):  # the A/Bs' rows, renamed beside the default ones
            tag = name.rsplit("_", 1)[1]
            r = {f"{k}_{tag}": v for k, v in r.items() if k.startswith("jsteer")}
        dec["runs"].setdefault(b, {}).update(r)
    for k, v in d.items():
        dec.setdefault(k, v)
for b, r in dec["runs"].items():
    hf = [r[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if "tokens_per_s" in r.get(k, {})]
    if "jsteer" in r and hf:
        r["jsteer_over_best_hf"] = r["jsteer"]["tokens_per_s"] / max(hf)
(out / "decode.json").write_text(json.dumps(dec, indent=1) + "\n")
print("decode", json.dumps(dec["runs"])[:1500])
PYEOF
