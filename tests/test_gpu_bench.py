"""jsteer.train.gpu_bench: the GPU benchmarks' decoder, its parameter count and FLOPs, and the HBM
bound of a decode step, checked on the tiny config against the models themselves."""

import jax
import numpy as np
import torch
import transformers

from jsteer.train import gpu_bench as G


def test_param_count_matches_both_models():
    c = G.LLAMA_TINY
    _, params = G.jsteer_llama(c, np.float32)
    n_jsteer = sum(x.size for x in jax.tree.leaves(params))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(G.hf_llama_config(c))
    n_hf = sum(p.numel() for p in hf.parameters())  # tied: the table counted once
    assert G.llama_param_count(c) == n_jsteer == n_hf
    untied = dict(c, tie_word_embeddings=False)
    assert G.llama_param_count(untied) == n_hf + c["vocab_size"] * c["hidden_size"]


def test_flops_and_decode_bound_rederived():
    c = G.LLAMA_TINY
    d, f, L, V = c["hidden_size"], c["intermediate_size"], c["num_layers"], c["vocab_size"]
    q, kv = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
    per_layer = d * q + d * kv + d * kv + q * d + d * f * 3  # q, k, v, o, gate / up / down
    seq = 64
    assert G.llama_flops_per_token(c, seq) == 6 * (L * per_layer + d * V) + 12 * L * q * seq
    b = G.decode_bound(c, batch=4, prompt=16, new=8, bw=1e9)
    kv_bytes = 4 * L * 2 * kv * 2 * (16 + 4)  # bf16 K and V, mean cache length prompt + new / 2
    assert b["mean_kv_bytes"] == kv_bytes and b["param_bytes"] == 2 * G.llama_param_count(c)
    assert np.isclose(b["step_s"], (b["param_bytes"] + kv_bytes) / 1e9) and np.isclose(
        b["tokens_per_s"], 4 / b["step_s"]
    )


def test_chip_tables():
    assert G.spec_hbm_tbps("NVIDIA H200") == 4.8 and G.spec_hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert G.spec_hbm_tbps("cpu") is None
    first, med = G.median_time(lambda: 1, lambda x: x, n=3, warm=1)
    assert first >= 0 and med >= 0
