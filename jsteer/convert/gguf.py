"""GGUF (llama.cpp) checkpoints -> HF-style config, state dict and tokenizer.

:func:`read_gguf` returns everything :mod:`jsteer.backbones.llama` needs::

    config_dict, state_dict, tokenizer_json, metadata = read_gguf("model.gguf")
    config = LlamaConfig.from_hf(config_dict)
    params = params_from_hf(state_dict, config)

The state dict is lazy (:class:`GGUFState`): names and shapes come from the file's tensor
table, and ``state[name]`` dequantizes that one tensor to float32 with gguf's own
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants Q2_K..Q6_K and
whatever else the installed gguf handles), so a conversion that reads tensor by tensor holds
one float32 tensor at a time, never a float32 copy of the model. llama.cpp stores the q/k
projections of ``llama`` models with rows permuted for its interleaved RoPE; we undo that
permutation so the weights match HF's rotate-half layout (``qwen2`` files are not permuted by
llama.cpp). ``metadata["tokenizer.chat_template"]`` holds the chat template when the file has one.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Iterator, Mapping, Tuple

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# metadata arrays that are large and already represented elsewhere (the tokenizer JSON)
_BULKY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _field_value(field) -> Any:
    value = field.contents()
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else value


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation ([out, in] or [out] bias) for ``n_heads`` heads."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFState(Mapping):
    """Lazy {HF name: float32 array [out, in] / [n]} over a GGUF file's tensors: each access
    dequantizes that tensor (and undoes llama.cpp's q/k row permutation); nothing is cached.
    Errors name the file and the tensor."""

    def __init__(self, path: str, tensors: Mapping[str, Any], arch: str, heads: int, kv_heads: int):
        self.path, self._tensors, self._arch, self._heads = path, dict(tensors), arch, (heads, kv_heads)

    def gguf_tensor(self, name: str):
        """The gguf ``ReaderTensor`` behind ``name`` (its ``tensor_type``, raw ``data``)."""
        return self._tensors[name]

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[name]
        expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise ValueError(
                f"{self.path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): {type(e).__name__}: {e}"
            ) from e
        if w.shape != expected:
            raise ValueError(
                f"{self.path}: tensor {t.name!r} dequantized to shape {w.shape}, expected "
                f"{expected} (truncated or corrupt file?)"
            )
        if self._arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = unpermute_rope_rows(w, self._heads[0] if ".attn_q." in t.name else self._heads[1])
        return w

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _config(fields: Dict[str, Any], arch: str, tensor_names, path: str) -> dict:
    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full in fields:
            return fields[full]
        if required:
            raise ValueError(f"{path}: GGUF metadata lacks {full!r}")
        return default

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    vocab = get("vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in fields:
            raise ValueError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(fields["tokenizer.ggml.tokens"])
    cfg = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported (only linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) "
            "are not supported; convert from the HF safetensors checkpoint instead"
        )
    return cfg


def _tokenizer_json(path: str) -> str:
    """The file's tokenizer as a ``tokenizers`` JSON string, built by transformers."""
    try:  # the converter behind AutoTokenizer.from_pretrained(gguf_file=...), without its overhead
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        arch, tok_dict, _ = get_gguf_tokenizer(path)
        backend, _ = convert_gguf_tokenizer(arch, tok_dict)
        return backend.to_str()
    except ImportError:
        from transformers import AutoTokenizer

        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name).backend_tokenizer.to_str()


def read_gguf(path, with_tokenizer: bool = True) -> Tuple[dict, GGUFState, str | None, dict]:
    """Read a llama/qwen2 GGUF file.

    Returns (hf_config_dict, state_dict: a lazy :class:`GGUFState` {HF name: float32 array
    [out, in]}, tokenizer_json, metadata {GGUF key: value} without the bulky tokenizer arrays).
    ``with_tokenizer=False`` skips the tokenizer (returns None for it). Raises
    FileNotFoundError, or ValueError naming the file for an unreadable/truncated file, a tensor
    this architecture does not have, or an unsupported architecture.
    """
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
        fields = {k: _field_value(f) for k, f in reader.fields.items()}
        tensors = list(reader.tensors)
    except Exception as e:  # gguf raises assorted errors (struct, memmap, assert) on bad files
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e

    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    names = {t.name for t in tensors}
    config = _config(fields, arch, names, path)

    by_name: Dict[str, Any] = {}
    for t in tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for a {arch} model")
        by_name[hf] = t
    state = GGUFState(path, by_name, arch, config["num_attention_heads"], config["num_key_value_heads"])

    metadata = {k: v for k, v in fields.items() if k not in _BULKY and not k.startswith("GGUF.")}
    metadata["path"] = os.path.abspath(path)
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = _tokenizer_json(path)
        except Exception as e:
            raise ValueError(
                f"{path}: cannot build the tokenizer from the GGUF metadata: {type(e).__name__}: {e}"
            ) from e
    return config, state, tokenizer, metadata
