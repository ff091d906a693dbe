"""The jsteer demo (``make demo`` / ``python -m jsteer.demo``).

1. Load the two embedded models (MiniLM: BERT encoder from safetensors; SmolLM2-135M-Instruct:
   LLaMA decoder from a 4-bit GGUF, dequantised), save each as a jsteer (Orbax) checkpoint
   under ``out/demo/``, reload it and check the round trip is bit-exact.
2. Greedy completions with the reloaded SmolLM2 (one compiled decode loop for the batch).
3. Nearest neighbours of a few words in MiniLM's input-embedding space (cosine).

Runs in about a minute or two on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTION = "Name three colours of the rainbow."
PROMPTS = ["The capital of France is", "def fibonacci(n):", CHAT.format(QUESTION)]
LABELS = PROMPTS[:2] + [f"[chat] {QUESTION}"]
WORDS = ["king", "paris", "happy", "computer", "river", "doctor"]


@contextlib.contextmanager
def step(what: str):
    print(f"  {what} ...", end="", flush=True)
    t0 = time.perf_counter()
    yield
    print(f" {time.perf_counter() - t0:.1f}s", flush=True)


def _same(a, b) -> bool:
    import jax
    import numpy as np

    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def load_save_reload(name: str, out: pathlib.Path):
    import jsteer

    print(f"[{name}]")
    with step(f"load {name}"):
        lm = jsteer.load(name)
    n = sum(x.size for x in __import__("jax").tree.leaves(lm.params))
    print(f"    {lm.family}: {n / 1e6:.1f}M params, vocab {lm.tokenizer.vocab_size}, identity {lm.identity[:19]}...")
    dst = out / name
    with step(f"save -> {dst}"):
        jsteer.save(lm, dst)
    with step("reload"):
        back = jsteer.load(dst)
    if not (_same(lm.params, back.params) and back.identity == lm.identity):
        raise SystemExit(f"round trip of {name} through {dst} was not bit-exact")
    print("    round trip: bit-exact params, same identity")
    return back


def nearest_neighbours(lm, words, k: int = 6) -> dict:
    """word -> [(token, cosine)] over the input-embedding matrix, skipping special/unused/## tokens."""
    import jax.numpy as jnp
    import numpy as np

    emb = np.asarray(lm.input_embeddings(), np.float32)
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    vocab = [lm.tokenizer.id_to_token(i) or "" for i in range(unit.shape[0])]
    skip = np.array([t.startswith(("[", "##")) or not t.isalpha() for t in vocab])
    out = {}
    for w in words:
        i = lm.tokenizer.token_to_id(w)
        if i is None:
            continue
        sims = np.array(jnp.asarray(unit) @ jnp.asarray(unit[i]))  # writable copy
        sims[skip] = -np.inf
        sims[i] = -np.inf
        top = np.argsort(-sims)[:k]
        out[w] = [(vocab[j], float(sims[j])) for j in top]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jsteer.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="out/demo", help="where the checkpoints go (default out/demo)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    t_start = time.perf_counter()

    print("jsteer demo: embedded models -> Orbax checkpoints -> generation and embeddings\n")
    minilm = load_save_reload("minilm", out)
    smol = load_save_reload("smollm2-135m", out)

    print(f"\n[greedy completions, SmolLM2 from {out / 'smollm2-135m'}, {args.max_new_tokens} new tokens]")
    with step("compile + generate (batch of 3)"):
        texts = smol.generate(PROMPTS, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    _, _, lengths = smol.generate(
        ["The largest planet is", "import numpy as np", CHAT.format("Say hi.")],
        max_new_tokens=args.max_new_tokens,
        return_ids=True,
    )
    dt = time.perf_counter() - t0
    print(
        f"  other prompts, same length bucket (no recompile): {int(lengths.sum())} tokens in {dt:.1f}s "
        f"({lengths.sum() / dt:.0f} tokens/s)"
    )
    for label, t in zip(LABELS, texts):
        print(f"  > {label!r}\n    {t.strip()!r}")

    print("\n[nearest neighbours in MiniLM's input-embedding space (cosine)]")
    for w, nbrs in nearest_neighbours(minilm, WORDS).items():
        print(f"  {w:>9}: " + ", ".join(f"{t} {s:.2f}" for t, s in nbrs))

    print(
        f"\ndone in {time.perf_counter() - t_start:.0f}s; checkpoints in {out}/ "
        f"(inspect with: jsteer info {out / 'minilm'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
