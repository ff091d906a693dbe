"""Fine-tuned MiniLM evaluators for the LM-Steer experiments (sentiment on SST-5, toxicity on
the Jigsaw subset), trained with jsteer's own engine (jsteer.train.Trainer).

Model: all-MiniLM-L6-v2 encoder (every weight trained) -> masked mean pool -> a linear logit
(binary: sentiment positive / text toxic). Loss: sigmoid cross-entropy; AdamW, linear decay,
10% warmup, encoder lr 5e-5, head lr 1e-3, dropout 0.1, texts cut to 64 MiniLM tokens.

    .venv/bin/python experiments/steer_evaluators.py [--epochs 2]

The trained evaluators are cached as Orbax artifacts under out/steer_evaluators/ (the accuracies
travel in their metadata); reruns load them instead of retraining. The cache is keyed by the
training recipe (``cache_path``: ``sentiment`` / ``toxicity`` for the default 2 epochs on whole
splits, ``toxicity_e0.8_n1600_t1000`` for ``--epochs 0.8 --max-train 1600 --max-test 1000``), so
recipes that differ never load each other's evaluator. The evaluators, their data and their
cache are :mod:`jsteer.steer.evaluate`; this script trains them and records their accuracies in
experiments/results/steer/evaluators.json.
"""

from __future__ import annotations

import argparse
import json

import jsteer
from jsteer.steer import evaluate
from jsteer.steer.protocol import RESULTS
from jsteer.workspace import write_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--only", default="sentiment,toxicity")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--max-train", type=int, default=0, help="0: every text of the split")
    ap.add_argument("--max-test", type=int, default=0)
    a = ap.parse_args()
    enc = jsteer.load("minilm")
    old = json.loads((RESULTS / "evaluators.json").read_text()) if (RESULTS / "evaluators.json").exists() else {}
    out = {k: v for k, v in old.items() if isinstance(v, dict) and "steps" in v}  # keep fine-tuned entries only
    for name in a.only.split(","):
        ev = evaluate.get(name, enc, epochs=a.epochs, retrain=a.retrain, max_train=a.max_train, max_test=a.max_test)
        out[name] = {k: v for k, v in ev.meta.items() if k not in ("loss", "loss_steps")}
        write_json(RESULTS / "evaluators.json", out)
    print(out)


if __name__ == "__main__":
    main()
