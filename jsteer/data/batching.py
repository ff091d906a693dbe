"""Bucketed padding and a deterministic, resumable batch iterator.

Examples are dicts of numpy arrays. Fields named in ``pad_values`` are variable-length
sequences (axis 0); every batch pads them to the smallest *bucket* length that fits its
longest example, so jit compiles at most ``len(buckets)`` shapes. The batch axis is always
``batch_size`` (a short final batch is filled with padding rows whose ``example_mask`` is 0),
so the shape count stays bounded.

Order is a pure function of ``(seed, epoch)``: a permutation per epoch, optionally grouped
by length inside windows of ``sort_window`` batches (less padding), batch order shuffled
again. The position is just ``(epoch, batches consumed)``, so :meth:`Batcher.state` /
:meth:`Batcher.set_state` resume exactly.

    batches = Batcher(examples, batch_size=32, buckets=(32, 64, 128),
                      pad_values={"input_ids": 0, "labels": -100}, seed=0)
    for batch in batches: ...   # {"input_ids": [32, L], "labels": [32, L],
                                #  "attention_mask": [32, L], "example_mask": [32]}
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from jsteer.data.buckets import bucket

Example = Mapping[str, Any]


def pad_to(x: np.ndarray, length: int, value) -> np.ndarray:
    """Pad (never truncate) axis 0 of ``x`` to ``length`` with ``value``."""
    x = np.asarray(x)
    if x.shape[0] > length:
        raise ValueError(f"sequence of length {x.shape[0]} does not fit {length}")
    out = np.full((length,) + x.shape[1:], value, dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


class Batcher:
    """Deterministic, bucketed, resumable batches over a sequence of examples.

    Args:
      examples: indexable sequence of dicts of arrays (e.g. a list built once from a TFDS
        data source by a tokenizing function).
      batch_size: *global* batch size (rows per step over all hosts).
      buckets: allowed padded lengths (sorted); an example longer than the last is an error.
      pad_values: ``{field: pad value}`` for the variable-length fields.
      mask_field: name of the added [B, L] 0/1 mask of real positions (None: not added).
      length_fn: example -> length; default the length of the first ``pad_values`` field.
      seed: shuffling seed. shuffle=False keeps the source order (epoch after epoch).
      sort_window: group examples of similar length within windows of this many batches
        (0/None = plain shuffle).
      drop_remainder: drop the final short batch of an epoch instead of padding it.
      num_epochs: stop after this many epochs (None = forever).
      process_index / process_count: this host's share of each global batch (rows
        ``[i*B/n, (i+1)*B/n)``); defaults from jax.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        buckets: Sequence[int],
        pad_values: Mapping[str, Any],
        mask_field: Optional[str] = "attention_mask",
        length_fn: Optional[Callable[[Example], int]] = None,
        seed: int = 0,
        shuffle: bool = True,
        sort_window: Optional[int] = None,
        drop_remainder: bool = False,
        num_epochs: Optional[int] = None,
        process_index: Optional[int] = None,
        process_count: Optional[int] = None,
    ):
        if len(examples) == 0:
            raise ValueError("no examples")
        if not pad_values:
            raise ValueError("pad_values must name at least one variable-length field")
        if list(buckets) != sorted(set(int(b) for b in buckets)):
            raise ValueError(f"buckets must be strictly increasing ints, got {buckets}")
        if process_index is None or process_count is None:
            import jax

            process_index, process_count = jax.process_index(), jax.process_count()
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} is not divisible by {process_count} processes")
        if drop_remainder and len(examples) < batch_size:
            raise ValueError(f"{len(examples)} examples cannot fill one batch of {batch_size} (drop_remainder=True)")
        self.examples = examples
        self.batch_size = batch_size
        self.buckets = tuple(int(b) for b in buckets)
        self.pad_values = dict(pad_values)
        self.mask_field = mask_field
        self.seed = int(seed)
        self.shuffle = shuffle
        self.sort_window = sort_window or 0
        self.drop_remainder = drop_remainder
        self.num_epochs = num_epochs
        self.process_index = process_index
        self.process_count = process_count
        first = next(iter(self.pad_values))
        length_fn = length_fn or (lambda ex: len(ex[first]))
        self.lengths = np.asarray([length_fn(examples[i]) for i in range(len(examples))], np.int64)
        too_long = np.nonzero(self.lengths > self.buckets[-1])[0]
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"example {i} has length {self.lengths[i]} > largest bucket {self.buckets[-1]} "
                f"({too_long.size} such examples); truncate first or add a bucket"
            )
        self._epoch = 0
        self._index = 0
        self._order_epoch = None
        self._order: list[np.ndarray] = []

    # ----------------------------------------------------------------- order

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """Example indices of every global batch of ``epoch`` (deterministic)."""
        n, bs = len(self.examples), self.batch_size
        rng = np.random.default_rng([self.seed, epoch])
        idx = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.sort_window:
            w = self.sort_window * bs
            chunks = [idx[s : s + w] for s in range(0, n, w)]
            idx = np.concatenate([c[np.argsort(self.lengths[c], kind="stable")] for c in chunks])
        batches = [idx[s : s + bs] for s in range(0, n, bs)]
        if self.drop_remainder and len(batches[-1]) < bs:
            batches.pop()
        if self.sort_window and self.shuffle:
            perm = rng.permutation(len(batches))
            batches = [batches[i] for i in perm]
        return batches

    @property
    def batches_per_epoch(self) -> int:
        n, bs = len(self.examples), self.batch_size
        return n // bs if self.drop_remainder else math.ceil(n / bs)

    def shapes(self) -> set[int]:
        """Padded lengths one epoch will use (for counting compiled shapes)."""
        return {bucket(int(self.lengths[b].max()), self.buckets) for b in self.epoch_batches(self._epoch)}

    # ----------------------------------------------------------------- state

    def state(self) -> dict:
        """JSON-able position: the next batch is batch ``index`` of ``epoch``."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "num_examples": len(self.examples)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if int(state["seed"]) != self.seed or int(state["num_examples"]) != len(self.examples):
            raise ValueError(
                f"iterator state is for seed {state['seed']} / {state['num_examples']} examples, "
                f"this Batcher has seed {self.seed} / {len(self.examples)} examples"
            )
        self._epoch, self._index = int(state["epoch"]), int(state["index"])

    # ----------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        if self._order_epoch != self._epoch:
            self._order = self.epoch_batches(self._epoch)
            self._order_epoch = self._epoch
        if self._index >= len(self._order):
            self._epoch += 1
            self._index = 0
            return next(self)
        ids = self._order[self._index]
        self._index += 1
        return self.collate(ids)

    def collate(self, ids: np.ndarray) -> dict:
        """Global batch ``ids`` -> this host's rows, padded to the batch's bucket."""
        length = bucket(int(self.lengths[ids].max()), self.buckets)
        local = self.batch_size // self.process_count
        rows = list(ids[self.process_index * local : (self.process_index + 1) * local])
        n_real = len(rows)
        exs = [self.examples[int(i)] for i in rows]
        # Filler rows (short final batch): copies of a real example, masked out below.
        filler = self.examples[int(ids[0])]
        exs += [filler] * (local - n_real)
        out: dict[str, np.ndarray] = {}
        for key in exs[0]:
            if key in self.pad_values:
                vals = [pad_to(ex[key], length, self.pad_values[key]) for ex in exs]
                for j in range(n_real, local):
                    vals[j] = np.full_like(vals[j], self.pad_values[key])
                out[key] = np.stack(vals)
            else:
                try:
                    out[key] = np.stack([np.asarray(ex[key]) for ex in exs])
                except ValueError as e:
                    raise ValueError(
                        f"field {key!r} differs in shape across examples; add it to pad_values ({e})"
                    ) from e
        if self.mask_field is not None and self.mask_field not in out:
            lens = np.asarray([len(ex[next(iter(self.pad_values))]) for ex in exs])
            lens[n_real:] = 0
            out[self.mask_field] = (np.arange(length)[None, :] < lens[:, None]).astype(np.int32)
        em = np.zeros((local,), np.int32)
        em[:n_real] = 1
        out["example_mask"] = em
        return out


def materialize(source, fn: Callable[[Example], Example], *, name: str = "source") -> list:
    """``[fn(source[i]) for i in range(len(source))]``, naming the record of any failure.

    ``source``: a list or a TFDS data source (index access).
    """
    out = []
    for i in range(len(source)):
        ex = source[i]
        try:
            out.append(fn(ex))
        except Exception as e:
            line = ex.get("line") if isinstance(ex, Mapping) else None
            where = f"record {i}" + (f" (source line {int(line)})" if line is not None else "")
            raise ValueError(f"{name}: {where}: {e}") from e
    return out
