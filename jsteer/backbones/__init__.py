"""Backbone families and the registry that maps a family name to its code.

=============  ======================================  ==============================================
family         code                                    models (HF ``model_type``)
=============  ======================================  ==============================================
``bert``       :mod:`jsteer.backbones.bert` +          BERT / RoBERTa / XLM-R / CamemBERT encoders;
               :mod:`jsteer.backbones.bert_heads` +    heads None, mlm, token_classification, qa
               :mod:`jsteer.backbones.bert_hf`
``decoder``    :mod:`jsteer.backbones.decoder` +       one decoder with config switches for llama,
               :mod:`jsteer.backbones.families` +      mistral, qwen2, qwen3, gemma2, gemma3_text,
               :mod:`jsteer.backbones.decoder_hf`      phi3, olmo2, gpt_neox, gpt2
=============  ======================================  ==============================================

:func:`get_family` returns a :class:`Family`, which gives every backbone the same surface:
``config_from_hf(dict)``, ``build(config, head, dtype) -> module``,
``params_from_hf(state_dict, config, head, dtype=, place=, source=)``,
``detect_head(state_dict, hf_config)``, ``input_embeddings(params)`` /
``output_embeddings(params, config)`` (both [V, D]), ``logical_axes(params)`` (for sharding).
Code is imported on first use, so ``import jsteer`` stays cheap. Checkpoints saved before the
decoders were unified name their family "llama" or "gpt2": both resolve to ``decoder``.
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
    heads: tuple = (None,)

    @property
    def code(self):
        """The backbone module itself (imported on first use)."""
        return importlib.import_module(self.module_path)

    def config_from_hf(self, hf_config: Mapping[str, Any], where: str = "config.json"):
        if self.kind == DECODER:
            return self.code.config_from_hf(hf_config, where)
        return self.code.BertConfig.from_hf(hf_config)

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
            warnings.warn(
                f"the weights hold a head jsteer does not build ({archs or 'architecture not given'}: "
                f"{', '.join(unused)}); loading the bare encoder without it (heads: mlm, qa, "
                f"token_classification)",
                stacklevel=3,
            )
        return None

    def check_head(self, head: Optional[str]) -> None:
        if head not in self.heads:
            raise ValueError(f"family {self.name!r} has no head {head!r}; choose one of {self.heads}")

    def build(self, config, head: Optional[str] = None, dtype: Any = None):
        """Flax module for ``config`` (+ ``head``); ``dtype`` is the activation dtype."""
        self.check_head(head)
        import jax.numpy as jnp

        dtype = jnp.dtype(dtype or jnp.float32)
        if self.kind == DECODER:
            from jsteer.backbones.decoder import Decoder

            return Decoder(config, dtype=dtype)
        from jsteer.backbones.bert_heads import model_for_head

        return model_for_head(config, head, dtype=dtype)

    def params_from_hf(
        self,
        state_dict: Mapping[str, np.ndarray],
        config,
        head: Optional[str] = None,
        *,
        dtype: Any = np.float32,
        place=None,
        source: Any = "state dict",
    ):
        """``dtype``: what floating params are cast to, on the host, tensor by tensor; ``place``
        (decoders): where each leaf goes (a device or a shard)."""
        self.check_head(head)
        if self.kind == ENCODER:
            from jsteer.backbones.bert_hf import params_from_hf

            return params_from_hf(state_dict, config, head=head, dtype=dtype)
        from jsteer.backbones.decoder_hf import params_from_hf

        return params_from_hf(state_dict, config, dtype=dtype, place=place, source=source)

    def logical_axes(self, params):
        """Logical axis names of every param (a matching tree of tuples; :mod:`jsteer.sharding`)."""
        from jsteer.backbones import decoder_params

        return (decoder_params if self.kind == DECODER else self.code).logical_axes(params)

    def input_embeddings(self, params):
        from jsteer.backbones import decoder_params

        return (decoder_params if self.kind == DECODER else self.code).input_embeddings(params)

    def output_embeddings(self, params, config):
        from jsteer.backbones import decoder_params

        return (decoder_params if self.kind == DECODER else self.code).output_embeddings(params, config)


FAMILIES: dict[str, Family] = {
    "bert": Family("bert", "jsteer.backbones.bert", ENCODER, heads=(None, "mlm", "token_classification", "qa")),
    "decoder": Family("decoder", "jsteer.backbones.families", DECODER),
}
_ALIASES = {"llama": "decoder", "gpt2": "decoder"}  # family names of checkpoints saved before session 33


def get_family(name: str) -> Family:
    """Family by name ("bert" | "decoder"; "llama" / "gpt2" are read as "decoder")."""
    try:
        return FAMILIES[_ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown backbone family {name!r}; known: {', '.join(FAMILIES)}") from None


__all__ = ["Family", "FAMILIES", "get_family", "ENCODER", "DECODER"]
