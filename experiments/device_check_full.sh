#!/usr/bin/env bash
# The prepared run on a lent GPU machine (issue #36): jsteer against HF PyTorch on the same chip,
# bf16 compute. Through the device tool, after `bash experiments/device_bundle.sh` here:
#   run(command="bash experiments/device_check_full.sh", carry=[".gpu"], timeout_s=570)
# Per-step limits sum to 535 s (+ ~15 s set-up; sessions 35 / 36: 435 / 442 s on an H200), under the 9 minutes that leave a rerun inside
# the session's 15. $OUT gets (8 files at most come back): gpu.txt (chip, clocks, versions),
# log.txt, attention.json, bert.json, decoder_train.json, decode.json, products.json, jvp.json (each part's jax and torch
# halves merged; experiments/bench_gpu.py; decoder_train with the forward / backward anatomy).
# Earlier runs: experiments/results/gpu_*/.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
# one framework per process for the big parts, so each may take 90% of the GPU's memory
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
# KALA (experiments/bench_kala.py) is left out: it reads CoNLL through tensorflow_datasets, absent there,
# and its cp312 wheels (9 MB) do not fit the 64 MiB beside the MiniLM weights (session 35).
# jsteer's halves first: if a later step hits its limit, HF's numbers from the last run on the same kind stand
step "decoder-train jax" timeout 110 $B --part decoder-train --framework jax --anatomy --reps 4 --out /tmp/parts/dt_jax.json
step "decode jax" timeout 100 $B --part decode --framework jax --reps 3 --out /tmp/parts/de_jax.json
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45  # jax and torch share the process
step "bert" timeout 105 $B --part bert --framework both --reps 6 --out "$OUT/bert.json"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "decoder-train torch" timeout 35 $B --part decoder-train --framework torch --anatomy --reps 4 --out /tmp/parts/dt_torch.json
step "decode torch" timeout 85 $B --part decode --framework torch --reps 3 --out /tmp/parts/de_torch.json
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
step "attention" timeout 35 $B --part attention --framework both --reps 10 --out "$OUT/attention.json"
step "products" timeout 40 python3 experiments/bench_gpu_products.py --reps 10 --out "$OUT/products.json"
step "jvp" timeout 25 python3 experiments/gpu_jvp_check.py --out "$OUT/jvp.json"
python3 - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name, parts in (("decoder_train", ("dt_jax", "dt_torch")), ("decode", ("de_jax", "de_torch"))):
    merged = {}
    for p in parts:
        f = pathlib.Path("/tmp/parts") / f"{p}.json"
        if not f.exists():
            merged.setdefault("missing", []).append(p)
            continue
        d = json.loads(f.read_text())
        runs = d.pop("runs", None)
        merged.setdefault("env", {})[p] = {k: d.pop(k) for k in list(d) if k in (
            "framework", "jax", "flax", "jax_device", "torch", "transformers", "torch_device", "wall_s")}
        for k, v in d.items():
            merged.setdefault(k, v)
        if runs is not None:
            for b, r in runs.items():
                merged.setdefault("runs", {}).setdefault(b, {}).update(r)
        for k in ("jsteer", "hf"):
            if k in d:
                merged[k] = d[k]
    if "jsteer" in merged and "hf" in merged:
        merged["jsteer_over_hf_examples_per_s"] = merged["jsteer"]["examples_per_s"] / merged["hf"]["examples_per_s"]
    for b, r in merged.get("runs", {}).items():
        hf = [r[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if "tokens_per_s" in r.get(k, {})]
        if "jsteer" in r and hf:
            r["jsteer_over_best_hf"] = r["jsteer"]["tokens_per_s"] / max(hf)
    (out / f"{name}.json").write_text(json.dumps(merged, indent=1) + "\n")
    print(name, json.dumps(merged)[:1500])
PYEOF
