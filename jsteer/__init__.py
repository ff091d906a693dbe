"""jsteer: knowledge-aware and steerable language models in JAX/Flax.

Quick start::

    import jsteer
    lm = jsteer.load("smollm2-135m")          # embedded name, HF dir, GGUF file or Orbax dir
    print(lm.generate(["The capital of France is"], max_new_tokens=16))
    jsteer.save(lm, "/tmp/smollm2")
"""

__version__ = "0.1.0"

from jsteer.hooks import FiLM, Hooks, Steer, compose  # noqa: E402,F401


def __getattr__(name):  # lazy: importing jsteer stays cheap
    if name in ("load", "save", "LM"):
        from jsteer import io

        return getattr(io, name)
    raise AttributeError(f"module 'jsteer' has no attribute {name!r}")
