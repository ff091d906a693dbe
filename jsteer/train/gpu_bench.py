"""Helpers of the GPU benchmarks (experiments/bench_gpu.py, bench_gpu_products.py): timing, the
chips' HBM bandwidth, the Llama-3.2-1B-shaped random decoder built by jsteer and by transformers,
its FLOPs and parameter count, and the HBM bound of a decode step. Peaks: :mod:`jsteer.train.bench`.

Shapes: the decoders take ids [B, T]; ``decode_bound`` counts bf16 params plus the mean KV cache
[B, L, 2, K, H, prompt + new / 2] read per step.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

SPEC_HBM_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.04}  # spec sheets, SXM


def spec_hbm_tbps(kind: str) -> Optional[float]:
    """The spec-sheet HBM bandwidth (TB/s) of the first :data:`SPEC_HBM_TBS` chip named in ``kind``."""
    return next((v for k, v in SPEC_HBM_TBS.items() if k in kind), None)


LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
LLAMA_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=500000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def median_time(fn, sync, n: int, warm: int) -> tuple[float, float]:
    """(first call's seconds, median of n timed calls after warm untimed ones)."""
    t = time.perf_counter()
    sync(fn())
    first = time.perf_counter() - t
    for _ in range(warm):
        sync(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        sync(fn())
        ts.append(time.perf_counter() - t)
    return first, statistics.median(ts)


def jax_sync(x):
    import jax

    return jax.block_until_ready(x)


def torch_sync(x):
    import torch

    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return x


def torch_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def llama_flops_per_token(c: dict, seq: int) -> float:
    """Training FLOPs per token: 6 N (matrix params incl. the output projection) + 12 L d_q T."""
    d, f, L = c["hidden_size"], c["intermediate_size"], c["num_layers"]
    q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
    n = L * (d * q + 2 * d * kv + q * d + 3 * d * f) + d * c["vocab_size"]
    return 6 * n + 12 * L * q * seq


def llama_param_count(c: dict) -> int:
    d, f, L = c["hidden_size"], c["intermediate_size"], c["num_layers"]
    q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
    untied = 0 if c["tie_word_embeddings"] else c["vocab_size"] * d
    return L * (d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d) + c["vocab_size"] * d + d + untied


def hf_llama_config(c: dict):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"],
        head_dim=c["head_dim"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"],
        rms_norm_eps=c["rms_norm_eps"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def jsteer_llama(c: dict, dtype):
    import jax
    import jax.numpy as jnp

    from jsteer.backbones.decoder import Decoder
    from jsteer.backbones.decoder_config import DecoderConfig

    kw = {("norm_eps" if k == "rms_norm_eps" else k): v for k, v in c.items()}
    module = Decoder(DecoderConfig.llama(**kw), dtype=dtype)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return module, params


def measured_bandwidth_jax() -> float:
    """Device-to-device copy rate, bytes read + written per second."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((256, 1024, 1024), jnp.float32)  # 1 GiB
    f = jax.jit(lambda x: x * 1.0001)
    _, dt = median_time(lambda: f(x), jax_sync, 10, 2)
    return 2 * x.nbytes / dt


def decode_bound(c: dict, batch: int, prompt: int, new: int, bw: float) -> dict:
    """Seconds per decode step if HBM were the only limit: params (bf16) + mean KV cache read."""
    param_bytes = 2 * llama_param_count(c)
    kv_bytes = batch * c["num_layers"] * 2 * c["num_kv_heads"] * c["head_dim"] * 2 * (prompt + new / 2)
    s = (param_bytes + kv_bytes) / bw
    return {"param_bytes": param_bytes, "mean_kv_bytes": kv_bytes, "step_s": s, "tokens_per_s": batch / s}
