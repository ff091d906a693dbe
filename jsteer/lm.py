"""The ``LM`` facade: a backbone bundled with its params, tokenizer and provenance.

:class:`LM` is what :func:`jsteer.load` returns (:mod:`jsteer.loading`) and :func:`jsteer.save`
writes (:mod:`jsteer.checkpoints`). It holds no loading or file code: ``forward`` (one jitted
``module.apply``: input_ids [B, T] -> logits [B, T, V] and hidden [B, T, D]), ``generate`` /
``stream`` (through :mod:`jsteer.generation`), ``encode_batch`` (texts -> ids / mask int32
[B, T]), the embeddings ([V, D]), :meth:`LM.with_head` / :meth:`LM.replace` / :meth:`LM.shard`
and the model's identity: ``sha256:`` of its source weight files, or of its params
(:func:`params_sha256`) once they were replaced. Data-parallel calls (``mesh=``) split the batch
with :class:`jsteer.sharding.BatchSplit`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer import decode, sharding
from jsteer.backbones import DECODER, Family, get_family
from jsteer.backbones.base import check_position_ids
from jsteer.tokenizer import Tokenizer


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
        loaded from files hashes them here, on first use, not in :func:`jsteer.load`
        (:class:`jsteer.loading.LazyProvenance`)."""
        sha = self.provenance.get("sha256")
        if not sha and self.provenance.get("sha256_of") == "params":
            sha = self.provenance["sha256"] = params_sha256(self.params)  # computed once, then kept
        if not sha:
            raise ValueError("this LM has no source sha256 in its provenance (built by hand?)")
        return f"sha256:{sha}"

    @property
    def dtype(self):
        return stored_dtype(self.params)

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
            return sharding.resolve_data_mesh(mesh, where)
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
        placed = sharding.shard(self.params, self.fam.logical_axes(self.params), mesh, rules)
        return dataclasses.replace(self, params=placed, mesh=mesh, rules=rules)

    def with_head(self, head: Optional[str], num_labels: Optional[int] = None, seed: int = 0) -> "LM":
        """A BERT-family copy with a freshly initialised ``head`` ("token_classification", "qa",
        "mlm"; None: the bare encoder) on the same encoder weights. ``num_labels``
        (token_classification) defaults to the config's; config, ``hf_config`` and module follow.
        Params are drawn with :func:`jsteer.backbones.bert_heads.init_head` from ``PRNGKey(seed)``.

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
        from jsteer.backbones.bert_heads import init_head

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
            params["head"] = cast_params(init_head(jax.random.PRNGKey(seed), config, head), self.dtype)
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

    def forward(self, input_ids, attention_mask=None, hooks=None, *, mesh=None, cpu_kernels=None, **kw):
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

        ``cpu_kernels``: a decoder's or a BERT-family encoder's products go through
        :mod:`jsteer.backbones.cpu`'s kernel from the packed copy of the weights that
        :func:`jsteer.decode.generate` makes and keeps (it doubles the weights' memory), and its
        attention through ``cpu.block_attention`` (head size a multiple of 16). None (default):
        when it is available, fp32, one device and no ``mesh``, as for generate. The values are
        the same to fp32 rounding, and differentiable like the plain ones (XLA's derivatives).
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
            packed = None
            if decode._use_cpu_kernels(cpu_kernels, self.module, input_ids, self.params, "forward", any_rows=True):
                packed = decode._packed_params(self.module, self.params)
            return _forward(self.module, self.params, packed, input_ids, attention_mask, hooks, arrays, static_kw)
        if cpu_kernels:
            raise ValueError("forward: cpu_kernels=True runs on one device, not with mesh=")
        split = sharding.BatchSplit(mesh, input_ids.shape[0])
        out = _forward(
            self.module,
            self.params_on(mesh),
            None,
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
        mesh = sharding.resolve_data_mesh(mesh, "params_on")
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
            from jsteer.generation import bucket_length, pad_to

            ids, mask = pad_to(ids, mask, bucket_length(ids.shape[1]), left_pad, self._pad_value())
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
def _forward(module, params, packed, input_ids, attention_mask, hooks, arrays, static_kw):
    _TRACES[0] += 1
    return module.apply(
        decode._variables(params, packed),
        input_ids,
        attention_mask=attention_mask,
        hooks=hooks,
        **arrays,
        **dict(static_kw),
    )


def _is_static(v) -> bool:
    """Python scalars and tuples of them (e.g. ``capture=("resid_post.3",)``) are compile-time constants."""
    if isinstance(v, tuple):
        return all(_is_static(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def stored_dtype(params) -> np.dtype:
    """Dtype of the first floating leaf (what a checkpoint's weights were saved as)."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.dtype(leaves[0].dtype) if leaves else jnp.dtype(jnp.float32)


def cast_params(params, dtype):
    def f(x):
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(f, params)


def state_dict_sha256(state_dict: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        a = np.ascontiguousarray(state_dict[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def params_sha256(params) -> str:
    """:func:`state_dict_sha256` of a params pytree, each leaf named by its key path."""
    return state_dict_sha256(
        {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    )


__all__ = ["LM", "forward_trace_count", "params_sha256", "state_dict_sha256"]
