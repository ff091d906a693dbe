#!/usr/bin/env bash
# Second, warm call on a lent GPU (issue #36), after device_check.sh: ~1B decoder, greedy 128 tokens at
# batch 64, jsteer plain and steered (the steer overhead, 5.4% in s37 against a <= 5% target) and HF's
# dynamic cache. run(command="bash experiments/device_check_decode64.sh", carry=[".gpu"], timeout_s=230)
# $OUT gets gpu.txt, log.txt, decode64.json.
source experiments/device_env.sh
B="python3 experiments/bench_gpu.py"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
step "decode jax, batch 64" timeout 150 $B --part decode --framework jax --sizes 64 --reps 3 \
  --out /tmp/parts/de64_jax.json
step "decode torch, batch 64" timeout 60 $B --part decode --framework torch --sizes 64 --reps 2 \
  --out /tmp/parts/de64_torch.json
python3 - "$OUT" <<'PYEOF'
import json, pathlib, sys
out, parts = pathlib.Path(sys.argv[1]), pathlib.Path("/tmp/parts")
dec = {"runs": {}, "missing": []}
for name in ("de64_jax", "de64_torch"):
    f = parts / f"{name}.json"
    if not f.exists():
        dec["missing"].append(name)
        continue
    d = json.loads(f.read_text())
    for b, r in d.pop("runs", {}).items():
        dec["runs"].setdefault(b, {}).update(r)
    for k, v in d.items():
        dec.setdefault(k, v)
for r in dec["runs"].values():
    hf = [r[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if "tokens_per_s" in r.get(k, {})]
    if "jsteer" in r and hf:
        r["jsteer_over_best_hf"] = r["jsteer"]["tokens_per_s"] / max(hf)
(out / "decode64.json").write_text(json.dumps(dec, indent=1) + "\n")
print("decode64", json.dumps(dec["runs"])[:1500])
PYEOF
