"""Backbone families and the registry that maps a family name to its code.

Each family lives in its own module (imported lazily, so ``import jsteer`` stays cheap):

=========  ==========================  =====================================================
family     module                      models
=========  ==========================  =====================================================
``bert``   :mod:`jsteer.backbones.bert`   BERT / RoBERTa encoders; heads None, mlm,
                                          token_classification, qa
``llama``  :mod:`jsteer.backbones.llama`  LLaMA-family decoders (RMSNorm, RoPE, GQA)
``gpt2``   :mod:`jsteer.backbones.gpt2`   GPT-2 decoders
=========  ==========================  =====================================================

:func:`get_family` returns a :class:`Family`, a small adapter giving every backbone the same
surface: ``config_from_hf(dict)``, ``build(config, head, dtype) -> module``,
``params_from_hf(state_dict, config, head, dtype)``, ``detect_head(state_dict, hf_config)``,
``input_embeddings(params)`` / ``output_embeddings(params, config)`` (both [V, D]).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Any, Mapping, Optional

import numpy as np

ENCODER, DECODER = "encoder", "decoder"


@dataclasses.dataclass(frozen=True)
class Family:
    """Adapter over one backbone module. ``kind`` is "encoder" (BERT) or "decoder"."""

    name: str
    module_path: str
    kind: str
    config_class: str
    heads: tuple = (None,)

    @property
    def code(self):
        """The backbone module itself (imported on first use)."""
        return importlib.import_module(self.module_path)

    def config_from_hf(self, hf_config: Mapping[str, Any]):
        return getattr(self.code, self.config_class).from_hf(hf_config)

    def detect_head(self, state_dict: Mapping[str, Any], hf_config: Optional[Mapping[str, Any]] = None):
        """Head to build when none is asked for: encoders get MLM when its weights are present,
        span QA / token classification when those weights are and the config's
        ``architectures`` says so, else the bare encoder. Decoders: always their LM head."""
        if self.kind == DECODER:
            return None
        names = list(state_dict)
        archs = " ".join((hf_config or {}).get("architectures") or [])
        if any(n.startswith(("cls.predictions.", "lm_head.")) for n in names):
            return "mlm"
        if "qa_outputs.weight" in state_dict:
            return "qa"
        if "classifier.weight" in state_dict and "ForTokenClassification" in archs:
            return "token_classification"
        unused = sorted(n for n in names if n.startswith("classifier."))
        if unused:  # e.g. a sequence-classification or multiple-choice head: not one jsteer builds
            warnings.warn(f"the weights hold a head jsteer does not build ({archs or 'architecture not given'}: "
                          f"{', '.join(unused)}); loading the bare encoder without it (heads: mlm, qa, "
                          f"token_classification)", stacklevel=3)
        return None

    def check_head(self, head: Optional[str]) -> None:
        if head not in self.heads:
            raise ValueError(f"family {self.name!r} has no head {head!r}; choose one of {self.heads}")

    def build(self, config, head: Optional[str] = None, dtype: Any = None):
        """Flax module for ``config`` (+ ``head``); ``dtype`` is the activation dtype."""
        self.check_head(head)
        import jax.numpy as jnp

        dtype = jnp.dtype(dtype or jnp.float32)
        code = self.code
        if self.name == "bert":
            return code.model_for_head(config, head, dtype=dtype)
        if self.name == "gpt2":
            return code.GPT2LMHeadModel(dataclasses.replace(config, dtype=dtype.name))
        if self.name == "llama":
            return code.LlamaForCausalLM(config, dtype=dtype)
        raise ValueError(f"no builder for family {self.name!r}")

    def params_from_hf(self, state_dict: Mapping[str, np.ndarray], config, head: Optional[str] = None,
                       dtype: Any = np.float32):
        """``dtype``: what floating params are cast to (on the host, tensor by tensor, where the
        family's conversion streams)."""
        self.check_head(head)
        if self.kind == ENCODER:
            return self.code.params_from_hf(state_dict, config, head=head, dtype=dtype)
        return self.code.params_from_hf(state_dict, config, dtype=dtype)

    def input_embeddings(self, params):
        return self.code.input_embeddings(params)

    def output_embeddings(self, params, config):
        return self.code.output_embeddings(params, config)


FAMILIES: dict[str, Family] = {
    "bert": Family("bert", "jsteer.backbones.bert", ENCODER, "BertConfig",
                   heads=(None, "mlm", "token_classification", "qa")),
    "llama": Family("llama", "jsteer.backbones.llama", DECODER, "LlamaConfig"),
    "gpt2": Family("gpt2", "jsteer.backbones.gpt2", DECODER, "GPT2Config"),
}


def get_family(name: str) -> Family:
    """Family by name ("bert" | "llama" | "gpt2")."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown backbone family {name!r}; known: {', '.join(FAMILIES)}") from None


__all__ = ["Family", "FAMILIES", "get_family", "ENCODER", "DECODER"]
