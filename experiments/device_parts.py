"""Merges the JSON parts that a prepared device run's steps leave in /tmp/parts (one
``bench_gpu.py --out`` file per step) into one file for $OUT, rows side by side.

    python3 experiments/device_parts.py decode OUT.json NAME ... [--tagged NAME ...]
    python3 experiments/device_parts.py bert OUT.json NAME=KEY ...

decode: each part's ``runs`` merged per batch; a ``--tagged`` part (an A/B of jsteer's half) keeps
only its jsteer rows, renamed with the part name's last word (``de_jax_k8``: ``jsteer_k8``, ...);
``jsteer_over_best_hf`` where HF's rows are there. bert: each part's rows per shape under KEY
(a KEY starting "hf" takes the part's HF row, any other its jsteer row), and ``<k>_over_<hf>`` for
each jsteer KEY against the HF KEY with its suffix (``jsteer_nodrop`` / ``hf_nodrop``), else ``hf``.
Parts not found are listed under ``missing``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

PARTS = pathlib.Path("/tmp/parts")


def _load(name: str):
    f = PARTS / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def merge_decode(names: list, tagged: list) -> dict:
    dec = {"runs": {}, "missing": []}
    for name in names:
        d = _load(name)
        if d is None:
            dec["missing"].append(name)
            continue
        for b, r in d.pop("runs", {}).items():
            if name in tagged:
                tag = name.rsplit("_", 1)[1]
                r = {f"{k}_{tag}": v for k, v in r.items() if k.startswith("jsteer")}
            dec["runs"].setdefault(b, {}).update(r)
        for k, v in d.items():
            dec.setdefault(k, v)
    for r in dec["runs"].values():
        hf = [r[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if "tokens_per_s" in r.get(k, {})]
        if "jsteer" in r and hf:
            r["jsteer_over_best_hf"] = r["jsteer"]["tokens_per_s"] / max(hf)
    return dec


def merge_bert(pairs: list) -> dict:
    bert = {"runs": {}, "missing": []}
    for name, key in pairs:
        d = _load(name)
        if d is None:
            bert["missing"].append(name)
            continue
        bert.setdefault("env", {})[name] = {k: d.get(k) for k in ("jax", "flax", "torch", "transformers", "wall_s")}
        bert.setdefault("config", d.get("config"))
        for r in d.get("runs", []):
            row = bert["runs"].setdefault(f"{r['batch']}x{r['seq']}", {"flops_per_step": r["flops_per_step"]})
            src = r.get("hf" if key.startswith("hf") else "jsteer")
            if src:
                row[key] = src
    for row in bert["runs"].values():
        for k in [k for k in row if k.startswith("jsteer")]:
            hf = "hf" + k[len("jsteer") :]
            hf = hf if hf in row else "hf"
            if hf in row:
                row[f"{k}_over_{hf}"] = row[k]["examples_per_s"] / row[hf]["examples_per_s"]
    return bert


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("decode", "bert"))
    ap.add_argument("out")
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--tagged", nargs="*", default=[])
    a = ap.parse_args(argv)
    if a.kind == "decode":
        merged = merge_decode(a.parts, a.tagged)
    else:
        merged = merge_bert([tuple(p.split("=", 1)) for p in a.parts])
    pathlib.Path(a.out).write_text(json.dumps(merged, indent=1) + "\n")
    print(a.kind, json.dumps(merged["runs"])[:1500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
