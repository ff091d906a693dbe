"""How well each offline lexicon strategy finds a NER dataset's gold entity mentions.

    python experiments/kala_lexicon_quality.py --dataset ncbi   # -> results/kala/lexicon_quality_ncbi.json

The graph builder (:mod:`jsteer.kala.builder`) never reads labels; this script does, only to score
what the builder found: each strategy mines its lexicon from the train + dev + test token columns
(as ``kala_ner.py``'s graphs are built by :func:`jsteer.kala.protocol.ensure_graph`, with the
builder's defaults and the dataset's min_count for its default strategy), matches every sentence,
and counts against the gold entity spans (any type; :func:`jsteer.kala.metrics.lexicon_quality`):

- ``mentions_per_sentence``;
- ``precision_overlap`` / ``precision_exact``: found mentions that overlap / equal a gold span;
- ``recall_overlap``: gold spans that some found mention overlaps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from jsteer.kala import protocol


def main(argv=None) -> int:
    from jsteer.data.readers import read_conll
    from jsteer.kala import mining
    from jsteer.kala.metrics import entities, lexicon_quality

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=sorted(protocol.DATASETS), required=True)
    ap.add_argument(
        "--strategies", nargs="+", default=["frequent", "abbreviation", "capitalised"], choices=mining.STRATEGIES
    )
    ap.add_argument("--out", default=None, help="default: results/kala/lexicon_quality_<dataset>.json")
    args = ap.parse_args(argv)
    spec = protocol.DATASETS[args.dataset]
    splits = {k: read_conll(protocol.DATA / spec[k], scheme=spec["scheme"]) for k in ("train", "dev", "test")}
    tokens = [list(s.tokens) for k in ("train", "dev", "test") for s in splits[k]]
    out = {"dataset": args.dataset, "strategies": {}}
    for strategy in args.strategies:
        min_count = protocol.graph_min_count(args.dataset, strategy)
        lexicon = mining.mine_lexicon(tokens, strategy, min_count)
        out["strategies"][strategy] = {
            "min_count": min_count,
            **{
                k: lexicon_quality(
                    lexicon, [(list(s.tokens), [(a, b) for _, a, b in entities(s.tags)]) for s in splits[k]]
                )
                for k in ("train", "test")
            },
        }
        t = out["strategies"][strategy]["test"]
        print(
            f"{strategy:13s} test: {t['mentions_per_sentence']:.2f} mentions/sentence, precision "
            f"{t['precision_overlap']:.3f} (exact {t['precision_exact']:.3f}), recall {t['recall_overlap']:.3f}"
        )
    path = pathlib.Path(args.out or protocol.OUT / f"lexicon_quality_{args.dataset}.json")
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
