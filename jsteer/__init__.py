"""jsteer: knowledge-aware and steerable language models in JAX/Flax.

Quick start::

    import jsteer
    lm = jsteer.load("smollm2-135m")          # embedded name, HF dir, GGUF file or Orbax dir
    print(lm.generate(["The capital of France is"], max_new_tokens=16))
    jsteer.save(lm, "/tmp/smollm2")
"""

__version__ = "0.1.0"

# first: XLA reads its flags when a backend starts, and its threads take their malloc arenas then
from jsteer import cpu_malloc, cpu_precision, gpu_atomics  # noqa: E402,F401
from jsteer.hooks import FiLM, Hooks, Steer, compose  # noqa: E402,F401

_LAZY = {
    "load": "jsteer.loading",
    "save": "jsteer.checkpoints",
    "LM": "jsteer.lm",
    "save_artifact": "jsteer.checkpoints",
    "load_artifact": "jsteer.checkpoints",
    "Tokenizer": "jsteer.tokenizer",
    "forward_mode": "jsteer.backbones.attention",
}


_SUBMODULES = (
    "io",
    "lm",
    "loading",
    "checkpoints",
    "tokenizer",
    "decode",
    "backbones",
    "convert",
    "hooks",
    "interventions",
    "sharding",
    "cli",
    "data",
    "train",
    "steer",
    "actsteer",
    "typevec",
    "kala",
    "kalm",
)


def __getattr__(name):  # lazy: importing jsteer stays cheap (no orbax / tokenizers until used)
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"jsteer.{name}")
    raise AttributeError(f"module 'jsteer' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_SUBMODULES))


__all__ = [
    "load",
    "save",
    "LM",
    "save_artifact",
    "load_artifact",
    "Tokenizer",
    "Hooks",
    "FiLM",
    "Steer",
    "compose",
    "forward_mode",
    "__version__",
]
