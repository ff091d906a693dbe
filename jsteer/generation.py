"""Text generation as HF users expect it, on top of :mod:`jsteer.decode` (the jitted loop).

:func:`generate` and :func:`stream` back ``LM.generate`` / ``LM.stream``: prompts are strings or
chat conversations (lists of ``{"role", "content"}`` messages, rendered with the tokenizer's
chat template), ``num_return_sequences`` repeats each prompt (rows prompt-major, as HF),
``do_sample`` is an alias of a positive temperature, ``repetition_penalty`` / ``min_new_tokens``
act in the loop, and ``stop`` strings end a row once its text contains one (the text is cut
right after it, as HF's stop strings keep it). Without stop strings the whole generation is one
compiled call; with them (or streaming) it runs in chunks of decode steps, the text checked on
the host between chunks, one compiled program for every chunk.

Prompts are encoded left-padded (ids / mask int32 [B, T0]) and padded further to their length
bucket T (:func:`bucket_length`, :func:`pad_to`; prompt-shaped hooks [B, T0, ...] with
:func:`pad_hooks`), so texts of similar length share one compiled loop; the loop returns tokens
[R, max_new_tokens] and lengths [R] for R = B * ``num_return_sequences`` rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer import decode, sharding
from jsteer.hooks import Hooks


def _is_conversation(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, Mapping) for m in p)


def prompt_texts(tokenizer, prompts) -> tuple[list[str], bool]:
    """prompts -> (texts, add_special_tokens): chat conversations rendered with the template (their
    specials written by it, so encoded without adding more); plain strings as given."""
    if isinstance(prompts, str) or _is_conversation(prompts):
        prompts = [prompts]
    chats = [_is_conversation(p) for p in prompts]
    if any(chats) and not all(chats):
        raise ValueError("generate: mix of plain prompts and chat conversations in one call; pass one kind")
    if not all(chats):
        bad = [type(p).__name__ for p in prompts if not isinstance(p, str)]
        if bad:
            raise ValueError(
                f"generate: prompts must be strings or chat conversations (lists of "
                f"{{'role', 'content'}} dicts), got {bad[0]}"
            )
        return list(prompts), True
    return [tokenizer.apply_chat_template(list(p), add_generation_prompt=True) for p in prompts], False


def sampling_temperature(temperature: float, do_sample: Optional[bool]) -> float:
    """HF's ``do_sample``: True samples (temperature 1 unless one is given), False is greedy."""
    if do_sample is None:
        return temperature
    return (temperature or 1.0) if do_sample else 0.0


def repeat_rows(hooks: Optional[Hooks], batch: int, n: int) -> Optional[Hooks]:
    """Hooks for each prompt's n copies: every array leaf whose leading dim is the batch (and that
    has one: ndim >= 2 — a per-row steer eps, offsets, FiLM, interventions' per-row vectors)
    repeated n times along it; per-steer / shared leaves kept."""
    if hooks is None or n == 1:
        return hooks
    return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0) if np.ndim(x) >= 2 and np.shape(x)[0] == batch else x, hooks)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to and including the first stop string it contains; whether one was found."""
    hits = [(text.find(s) + len(s)) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def bucket_length(n: int) -> int:
    """A prompt length rounded up to its :data:`jsteer.data.buckets.DECODE` bucket."""
    from jsteer.data import buckets

    if n < 1:
        raise ValueError(f"prompt length must be >= 1, got {n}")
    return buckets.DECODE(n)


def pad_to(ids: np.ndarray, mask: np.ndarray, t: int, left: bool, pad: int) -> tuple[np.ndarray, np.ndarray]:
    extra = t - ids.shape[1]
    if extra <= 0:
        return ids, mask
    width = ((0, 0), (extra, 0) if left else (0, extra))
    return np.pad(ids, width, constant_values=pad), np.pad(mask, width, constant_values=0)


def pad_hooks(hooks, t0: int, t: int):
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


@dataclasses.dataclass
class _Batch:
    """A prepared call: left-padded ids / mask, hooks, params, row keys; ``rows`` real rows."""

    ids: Any
    mask: Any
    hooks: Any
    params: Any
    rng: Any
    rows: int
    prompt_ids: list

    def args(self, lm) -> tuple:
        """The positional arguments of :func:`jsteer.decode.generate` / ``stream``."""
        return lm.module, self.params, self.ids, self.mask

    def keywords(self, lm) -> dict:
        """Their per-call keywords: row keys, hooks, the pad id."""
        return dict(rng=self.rng, hooks=self.hooks, pad_id=lm._pad_value())


def prepare(lm, prompts, hooks, seed: int, num_return_sequences: int, mesh) -> _Batch:
    if num_return_sequences < 1:
        raise ValueError(f"generate: num_return_sequences must be >= 1, got {num_return_sequences}")
    tokenizer = lm._text_tokenizer("generate")
    texts, specials = prompt_texts(tokenizer, prompts)
    ids, mask = lm._start_empty_prompts(*tokenizer.batch_encode(texts, left_pad=True, add_special_tokens=specials))
    n = num_return_sequences
    hooks = repeat_rows(hooks, ids.shape[0], n)
    ids, mask = np.repeat(ids, n, axis=0), np.repeat(mask, n, axis=0)
    prompt_ids = [row[m > 0] for row, m in zip(ids, mask, strict=True)]
    t0 = ids.shape[1]
    t = bucket_length(t0)
    ids, mask = pad_to(ids, mask, t, True, lm._pad_value())
    if hooks is not None and t != t0:
        hooks = pad_hooks(hooks, t0, t)
    rows = ids.shape[0]
    rng = jax.random.PRNGKey(seed)
    if mesh is None:
        return _Batch(jnp.asarray(ids), jnp.asarray(mask), hooks, lm.params, rng, rows, prompt_ids)
    split = sharding.BatchSplit(mesh, rows)  # rng: the row keys generate derives from it unsharded, padded with row 0's
    return _Batch(
        split.rows(ids),
        split.rows(mask),
        split.hooks(hooks),
        lm.params_on(mesh),
        split.rows(jax.random.split(rng, rows)),
        rows,
        prompt_ids,
    )


def _call(
    lm,
    prompts,
    *,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    hooks=None,
    seed: int = 0,
    num_return_sequences: int = 1,
    mesh=None,
    **loop,
) -> tuple[_Batch, int, Sequence[str], dict]:
    """The arguments of :func:`generate` / :func:`stream` (but ``chunk``) -> (the prepared batch,
    max_new_tokens, stop strings, the decode loop's settings)."""
    return prepare(lm, prompts, hooks, seed, num_return_sequences, mesh), max_new_tokens, stop, loop


def generate(lm, prompts, *, chunk: int = 8, **kw) -> tuple[list, np.ndarray, np.ndarray]:
    """-> (texts, tokens [R, max_new_tokens], lengths [R]) with R = prompts x num_return_sequences.
    ``kw``: max_new_tokens, stop, hooks, seed, num_return_sequences, mesh and the decode loop's
    settings (:func:`jsteer.decode.generate`'s)."""
    batch, max_new_tokens, stop, loop = _call(lm, prompts, **kw)
    if not stop:
        out = decode.generate(*batch.args(lm), max_new_tokens=int(max_new_tokens), **batch.keywords(lm), **loop)
        tokens, lengths = np.asarray(out.tokens)[: batch.rows], np.asarray(out.lengths)[: batch.rows]
        texts = [
            lm.tokenizer.decode_continuation(batch.prompt_ids[b], tokens[b, : lengths[b]]) for b in range(batch.rows)
        ]
        return texts, tokens, lengths
    *_, last = _chunks(lm, batch, max_new_tokens, stop, chunk, loop)
    return last


def _chunks(
    lm, batch: _Batch, max_new_tokens: int, stop: Sequence[str], chunk: int, loop: dict
) -> Iterator[tuple[list, np.ndarray, np.ndarray]]:
    """(texts so far, tokens, lengths) after the prefill and each chunk; a row whose text reached a
    stop string is stopped in the loop, its text cut after it and its tokens after the one that
    completed it (where HF's stop-string check, run every token, would have stopped) dropped."""
    gen = decode.stream(*batch.args(lm), max_new_tokens=int(max_new_tokens), chunk=chunk, **batch.keywords(lm), **loop)
    total = len(np.asarray(batch.ids))
    cut: dict = {}  # row -> (text, tokens kept)
    seen = np.zeros(batch.rows, np.int64)  # tokens already checked per row
    progress = next(gen)
    while True:
        tokens, lengths = progress.tokens[: batch.rows].copy(), progress.lengths[: batch.rows].copy()
        texts = []
        for b in range(batch.rows):
            if b not in cut:
                text = lm.tokenizer.decode_continuation(batch.prompt_ids[b], tokens[b, : lengths[b]])
                if cut_at_stop(text, stop)[1]:
                    k = next(
                        k
                        for k in range(max(int(seen[b]), 1), int(lengths[b]) + 1)
                        if cut_at_stop(lm.tokenizer.decode_continuation(batch.prompt_ids[b], tokens[b, :k]), stop)[1]
                    )
                    cut[b] = (cut_at_stop(text, stop)[0], k)
                seen[b] = lengths[b]
            if b in cut:
                text, k = cut[b]
                tokens[b, k:], lengths[b] = lm._pad_value(), k
            texts.append(text)
        yield texts, tokens, lengths
        stopped = np.zeros(total, bool)
        stopped[list(cut)] = True
        try:
            progress = gen.send(stopped)
        except StopIteration:
            return


def stream(lm, prompts, *, chunk: int = 8, **kw) -> Iterator[list[str]]:
    """Yields, after each chunk of decode steps, the text each row added since the last yield
    (``kw`` as :func:`generate`'s)."""
    batch, max_new_tokens, stop, loop = _call(lm, prompts, **kw)
    shown = [""] * batch.rows
    for texts, _, _ in _chunks(lm, batch, max_new_tokens, stop, chunk, loop):
        delta = [t[len(s) :] if t.startswith(s) else t for t, s in zip(texts, shown, strict=True)]
        shown = texts
        if any(delta):
            yield delta


__all__ = [
    "generate",
    "stream",
    "prompt_texts",
    "sampling_temperature",
    "repeat_rows",
    "cut_at_stop",
    "bucket_length",
    "pad_to",
    "pad_hooks",
]
