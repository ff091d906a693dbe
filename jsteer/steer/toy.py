"""A toy world for tests and quick demos: a word-level vocabulary with sentiment words, a
tiny random LLaMA built on it, and a labeled corpus whose classes differ only in which
sentiment words they use. Everything is deterministic given the seed and runs in seconds."""

from __future__ import annotations

import hashlib
from typing import List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

POSITIVE = ("good", "great", "happy", "love", "nice", "wonderful")
NEGATIVE = ("bad", "awful", "sad", "hate", "ugly", "terrible")
NEUTRAL = (
    "the",
    "a",
    "movie",
    "film",
    "story",
    "was",
    "is",
    "and",
    "it",
    "this",
    "very",
    "really",
    "plot",
    "actor",
    "scene",
    "music",
    "of",
    "with",
    "to",
    "in",
    "we",
    "saw",
    "end",
    "some",
    "people",
    "time",
    "day",
    "one",
)
SPECIALS = ("[PAD]", "[UNK]", "<s>", "</s>")


def tokenizer():
    """jsteer Tokenizer over SPECIALS + words (whitespace split, <s> prepended)."""
    from tokenizers import Tokenizer as _Tk
    from tokenizers import models, pre_tokenizers, processors

    from jsteer.tokenizer import Tokenizer

    words = SPECIALS + POSITIVE + NEGATIVE + NEUTRAL
    tk = _Tk(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tk.add_special_tokens(list(SPECIALS))
    return Tokenizer(tk, {"pad": 0, "unk": 1, "bos": 2, "eos": 3})


def lm(seed: int = 0, hidden: int = 32, layers: int = 2, tie: bool = True, norm_scale_noise: float = 0.0):
    """A tiny random LLaMA ``jsteer.lm.LM`` over the toy vocabulary.

    ``norm_scale_noise`` > 0 perturbs the per-layer RMSNorm scales (not the final norm) so the
    model is not at its init symmetry."""
    from jsteer.backbones.decoder import Decoder
    from jsteer.backbones.decoder_config import DecoderConfig
    from jsteer.lm import LM

    tok = tokenizer()
    cfg = DecoderConfig.llama(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=tie,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        max_position_embeddings=256,
    )
    module = Decoder(cfg)
    # shapes by abstract tracing, values from NumPy: no XLA compile (a real init compiles for seconds)
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(seed), jnp.ones((1, 4), jnp.int32))["params"]
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: (
            np.ones(s.shape, np.float32)
            if path[-1].key == "scale"
            else (0.02 * rng.normal(size=s.shape)).astype(np.float32)
        ),
        shapes,
    )
    # a wider embedding init than the 0.02 default, so base logits are not all ~equal, plus a
    # direction shared by every token (real LMs' embeddings are anisotropic like this): it gives
    # the hidden states a common component, and shifts all logits equally (softmax ignores it)
    emb = params["embed"]["embedding"] * 5.0
    common = (0.3 * rng.normal(size=(hidden,))).astype(np.float32)
    params["embed"]["embedding"] = emb + common[None, :]
    if norm_scale_noise:
        for name, layer in params.items():
            if name.startswith("layers_"):
                for nm in ("attn_norm", "ffn_norm"):
                    s = layer[nm]["scale"]
                    layer[nm]["scale"] = s * (1.0 + norm_scale_noise * rng.normal(size=s.shape)).astype(np.float32)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    sha = hashlib.sha256(f"toy-llama-{seed}-{hidden}-{layers}-{tie}-{norm_scale_noise}".encode()).hexdigest()
    return LM(
        family="decoder",
        config=cfg,
        params=params,
        module=module,
        tokenizer=tok,
        hf_config=cfg.to_dict(),
        provenance={"source": f"toy:{seed}", "sha256": sha},
    )


def corpus(n: int = 200, length: int = 8, n_sentiment: int = 2, seed: int = 0) -> Tuple[List[str], np.ndarray]:
    """n texts, half positive (+1) and half negative (-1): neutral filler words with
    ``n_sentiment`` words of the text's class at random places."""
    rng = np.random.default_rng(seed)
    texts, values = [], []
    for i in range(n):
        v = 1.0 if i % 2 == 0 else -1.0
        words = list(rng.choice(NEUTRAL, size=length))
        pool = POSITIVE if v > 0 else NEGATIVE
        for pos in rng.choice(length, size=n_sentiment, replace=False):
            words[pos] = str(rng.choice(pool))
        texts.append(" ".join(words))
        values.append(v)
    return texts, np.asarray(values, np.float32)
