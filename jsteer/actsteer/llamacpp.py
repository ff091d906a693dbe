"""llama.cpp / repeng control-vector GGUF files.

The format (written by repeng's ``ControlVector.export_gguf`` and llama.cpp's cvector-generator,
read by ``llama-cli --control-vector[-scaled]``): a GGUF with ``general.architecture`` =
"controlvector", ``controlvector.model_hint`` (the HF ``model_type``, e.g. "llama") and
``controlvector.layer_count`` (number of directions), and one 1-D float32 tensor
``direction.<k>`` [D] per layer.

Layer numbering. llama.cpp's loader (``common_control_vector_load_one``) stores ``direction.k``
for the model's block k and ``llama_adapter_cvec::apply_to`` adds it to the output of block k
(0-based ``il``), after the block's final residual add, at every position. repeng's
``direction.k`` is likewise the output of ``model.layers[k]`` (HF ``hidden_states[k + 1]``). So
GGUF ``direction.k`` == jsteer ``resid_post.k``, the same k, no shift. llama.cpp refuses a whole
file that holds ``direction.0`` ("invalid (zero) direction tensor layer index": block 0's output
is never steered there), so :func:`write` refuses layer 0 rather than write a file llama.cpp
would reject; :func:`read` accepts it (repeng can write it) as ``resid_post.0``. llama.cpp adds
every direction at strength 1 (``--control-vector``) or a given scale (``--control-vector-scaled
FILE S``), which matches :meth:`ControlVector.hooks(S) <jsteer.actsteer.ControlVector.hooks>`.

jsteer also writes its metadata (``jsteer.format``, ``jsteer.base_model``, ``jsteer.method``,
``jsteer.recipe``, ``jsteer.hidden_size``) as extra keys, which llama.cpp ignores, so a jsteer
round trip keeps the vector's identity; a GGUF from elsewhere reads with ``base_model`` None
(only its hidden size and layers can be checked against a model) and method "gguf".
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

ARCH = "controlvector"


def write(cv, path) -> pathlib.Path:
    """Write ``cv`` (a :class:`jsteer.actsteer.ControlVector`) as a llama.cpp control-vector GGUF."""
    import gguf

    from jsteer.actsteer.vector import _atomic

    path = pathlib.Path(path)
    if 0 in cv.layers:
        raise ValueError(
            f"{path}: layer 0 cannot be exported: llama.cpp refuses a control vector with "
            f"direction.0 (it never steers block 0's output); train on layers >= 1"
        )

    def emit(tmp):
        w = gguf.GGUFWriter(str(tmp), ARCH)
        w.add_string(f"{ARCH}.model_hint", cv.model_type or "")
        w.add_uint32(f"{ARCH}.layer_count", len(cv.layers))
        for key, value in cv.metadata().items():
            if key not in ("layers", "model_type"):  # those are the tensors / model_hint
                w.add_string(f"jsteer.{key}", value)
        for layer, vec in cv.numpy().items():
            w.add_tensor(f"direction.{layer}", np.ascontiguousarray(vec, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return _atomic(path, emit)


def _string(reader, key: str):
    f = reader.get_field(key)
    return None if f is None or not f.parts else f.contents()


def read(path, cls):
    """Read a control-vector GGUF into ``cls`` (:class:`~jsteer.actsteer.ControlVector`)."""
    import gguf

    from jsteer.actsteer.vector import FORMAT, directions_from_tensors

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a GGUF file ({e})") from None
    arch = _string(reader, "general.architecture")
    if arch != ARCH:
        raise ValueError(
            f"{path}: not a control vector: general.architecture is {arch!r} (a control vector has "
            f"{ARCH!r}); found {len(reader.tensors)} tensors, e.g. "
            f"{', '.join(t.name for t in reader.tensors[:3]) or 'none'}"
        )
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(
                f"{path}: tensor {t.name!r} is {t.tensor_type.name}; control-vector directions are "
                f"F32 (llama.cpp refuses other types)"
            )
        tensors[t.name] = np.array(t.data, np.float32).reshape(-1) if len(t.shape) == 1 else np.array(t.data)
    directions = directions_from_tensors(tensors, str(path))
    hidden = {v.shape[0] for v in directions.values()}
    if len(hidden) != 1:
        raise ValueError(f"{path}: directions of different lengths {sorted(hidden)}")
    if _string(reader, "jsteer.format") == FORMAT:
        meta = {k: _string(reader, f"jsteer.{k}") for k in ("format", "base_model", "method", "hidden_size", "recipe")}
        meta.update(model_type=_string(reader, f"{ARCH}.model_hint") or "", layers=json.dumps(sorted(directions)))
        return cls.from_metadata(directions, meta, str(path))
    return cls(
        directions,
        None,
        hidden.pop(),
        "gguf",
        _string(reader, f"{ARCH}.model_hint") or None,
        {"source": "gguf", "file": path.name},
    )
