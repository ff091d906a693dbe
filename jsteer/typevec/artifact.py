"""Type-embedding artifacts: one portable ``.safetensors`` file each (via :func:`jsteer.checkpoints.save_artifact`;
older Orbax folders still load) holding
one or more type vectors and what they were made from.

Tree: ``{"te": [K, D] float32}``. Meta keys: ``format`` ("jsteer.typevec/1"), ``base_model``
(``LM.identity`` of the model whose input embeddings were used), ``hidden_size``,
``vocab_size``, ``names`` (one per row, e.g. "City"), ``method`` ("svd" | "mean" | "derived"),
``tokens`` (per row: the example token ids), ``token_strings`` (per row: those tokens
decoded, i.e. what the vector was really built from), ``labels`` (per row: the example words
or KG labels they came from), ``types`` (per row: the KG type the vector stands for, e.g.
"City" for the projected vector "City^optim(Year)"; "" when none), ``sampling`` (per row:
strategy / seed / skipped counts, when sampled from a KG list), and free-form ``extra`` (e.g.
how a derived vector was combined). ``token_strings`` and ``types`` are absent from older
artifacts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

FORMAT = "jsteer.typevec/1"


class WrongModelError(ValueError):
    """A type vector was loaded for a model other than the one it was built from."""


def save(
    path,
    tes,
    *,
    names: Sequence[str],
    base_model: str,
    vocab_size: int,
    method: str,
    tokens: Sequence[Sequence[int]],
    labels: Optional[Sequence[Sequence[str]]] = None,
    sampling: Optional[Sequence[dict]] = None,
    extra: Optional[dict] = None,
    token_strings: Optional[Sequence[Sequence[str]]] = None,
    types: Optional[Sequence[str]] = None,
):
    """Write type vectors ``tes`` [K, D] (or one [D]) with their provenance. Returns the folder."""
    from jsteer import checkpoints

    tes = np.asarray(tes, np.float32)
    if tes.ndim == 1:
        tes = tes[None]
    if tes.ndim != 2:
        raise ValueError(f"type vectors must be [K, D] or [D], got shape {tes.shape}")
    k = tes.shape[0]
    names = list(names)
    tokens = [[int(t) for t in row] for row in tokens]
    labels = [list(map(str, row)) for row in labels] if labels is not None else [[] for _ in range(k)]
    sampling = list(sampling) if sampling is not None else [{} for _ in range(k)]
    token_strings = (
        [list(map(str, row)) for row in token_strings] if token_strings is not None else [[] for _ in range(k)]
    )
    types = [str(t or "") for t in types] if types is not None else ["" for _ in range(k)]
    for field, v in (
        ("names", names),
        ("tokens", tokens),
        ("labels", labels),
        ("sampling", sampling),
        ("token_strings", token_strings),
        ("types", types),
    ):
        if len(v) != k:
            raise ValueError(f"{field} has {len(v)} entries for {k} type vectors")
    for name, row in zip(names, tokens):
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"type {name!r}: token ids {bad} are outside the vocabulary (size {vocab_size})")
    if not np.all(np.isfinite(tes)):
        raise ValueError("type vectors contain NaN or inf")
    meta = {
        "format": FORMAT,
        "base_model": str(base_model),
        "hidden_size": int(tes.shape[1]),
        "vocab_size": int(vocab_size),
        "names": names,
        "method": str(method),
        "tokens": tokens,
        "labels": labels,
        "token_strings": token_strings,
        "types": types,
        "sampling": sampling,
        "extra": extra or {},
    }
    return checkpoints.save_artifact(path, {"te": tes}, meta)


def load(path, model_identity: Optional[str] = None) -> tuple[np.ndarray, dict]:
    """-> (tes [K, D], meta). With ``model_identity`` the artifact must come from that model."""
    from jsteer import checkpoints

    tree, meta = checkpoints.load_artifact(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a type-embedding artifact (format {meta.get('format')!r}, expected {FORMAT!r})")
    tes = np.asarray(tree["te"], np.float32)
    if tes.ndim != 2 or tes.shape[1] != meta["hidden_size"] or tes.shape[0] != len(meta["names"]):
        raise ValueError(
            f"{path}: tree 'te' has shape {tes.shape}, meta says {len(meta['names'])} x {meta['hidden_size']}"
        )
    if model_identity is not None and meta["base_model"] != model_identity:
        raise WrongModelError(
            f"{path}: these type vectors were built from model {meta['base_model']}, "
            f"not {model_identity}; rebuild them from this model's embeddings"
        )
    return tes, meta


def get(tes: np.ndarray, meta: dict, name: str) -> np.ndarray:
    """The row named ``name``."""
    try:
        return tes[meta["names"].index(name)]
    except ValueError:
        raise KeyError(f"no type vector named {name!r}; have {meta['names']}") from None


def rows_for_types(
    meta: dict, types: Sequence[str], type_map: Optional[dict[str, str]] = None
) -> tuple[dict[str, int], dict[str, str]]:
    """Which artifact row stands for each wanted type -> ({type: row index}, {type: why none}).

    A row serves type T when ``type_map`` maps its name to T; rows not in ``type_map`` serve
    their recorded base type (meta ``types``) or, if none is recorded, the type equal to their
    name. Once ``type_map`` names a row for T, only mapped rows serve T. Two rows for one type is
    an error (choose one with ``type_map``)."""
    names = list(meta["names"])
    type_map = dict(type_map or {})
    unknown = [n for n in type_map if n not in names]
    if unknown:
        raise KeyError(f"artifact has no vector named {unknown}; have {names}")
    recorded = list(meta.get("types") or [""] * len(names))
    mapped_types = set(type_map.values())
    serves: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        t = type_map.get(name) or recorded[i] or name
        if name not in type_map and t in mapped_types:
            continue
        serves.setdefault(t, []).append(i)
    found, missing = {}, {}
    for t in types:
        rows = serves.get(t, [])
        if len(rows) > 1:
            raise ValueError(
                f"type {t}: several artifact vectors stand for it {[names[i] for i in rows]}; "
                f"pick one with --artifact-type NAME={t}"
            )
        if rows:
            found[t] = rows[0]
        else:
            missing[t] = (
                f"type {t}: no vector for it in the artifact (vectors {names}, standing for types "
                f"{[r or n for r, n in zip(recorded, names)]}); map one with --artifact-type NAME={t}"
            )
    return found, missing
