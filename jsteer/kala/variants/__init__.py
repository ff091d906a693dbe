"""Other knowledge-integration systems as KALA-harness variants: ERNIE fusion, K-BERT sentence
trees, Entities as Experts and a knowledge adapter (see :mod:`jsteer.kala.variants.registry`)."""

from jsteer.kala.variants.common import VARIANT_METHODS, VariantConfig, VariantOutput
from jsteer.kala.variants.registry import METHODS, build_model, encode_ner, extra_keys, init_params

__all__ = [
    "METHODS",
    "VARIANT_METHODS",
    "VariantConfig",
    "VariantOutput",
    "build_model",
    "encode_ner",
    "extra_keys",
    "init_params",
]
