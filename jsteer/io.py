"""``jsteer.io``: the names of the former loading / saving module, re-exported from their homes.

The code lives in

- :mod:`jsteer.lm`: the :class:`LM` facade (forward, generate, embeddings, identity hashes);
- :mod:`jsteer.loading`: :func:`load` / :func:`from_state_dict`, assembling an LM from an
  embedded name, HF folder, hub id, GGUF file or jsteer checkpoint;
- :mod:`jsteer.checkpoints`: :func:`save`, artifacts, Orbax trees, JSON sidecars, atomic writes;
- :mod:`jsteer.sharding` (splitting a batch over a mesh) and :mod:`jsteer.generation` (padding
  prompts to a length bucket).

``from jsteer.io import X`` and ``jsteer.io.X`` keep working for every public name and for the
private names other code used. These are the same objects, so mutating one (e.g. appending to
:data:`ORPHANED_READS`) is seen everywhere; *rebinding* one here (``monkeypatch.setattr(io, ...)``)
changes nothing: patch the module the code lives in.
"""

from jsteer.checkpoints import (  # noqa: F401
    _ORPHANED_READ,
    ARTIFACT_FORMAT,
    CHECKPOINT_FORMAT,
    CLI_PROCESS,
    ORPHANED_READS,
    PARAMS_DIR,
    REAL_STDERR,
    SIDECAR,
    TREE_DIR,
    PathLike,
    _atomic_write_dir,
    _quiet_orphaned_reads,
    _write_json,
    _write_tree,
    load_artifact,
    load_orbax_artifact,
    read_tree_metadata,
    save,
    save_artifact,
)
from jsteer.checkpoints import clean_stale as _clean_stale  # noqa: F401
from jsteer.checkpoints import read_sidecar as _read_sidecar  # noqa: F401
from jsteer.checkpoints import restore_tree as _restore_tree  # noqa: F401
from jsteer.generation import bucket_length as _bucket_length  # noqa: F401
from jsteer.generation import pad_hooks as _pad_hooks  # noqa: F401
from jsteer.generation import pad_to as _pad_to  # noqa: F401
from jsteer.lm import LM, _forward, forward_trace_count, params_sha256, state_dict_sha256  # noqa: F401
from jsteer.loading import _AUTO, EMBEDDED, Embedded, LazyProvenance, embedded_path, from_state_dict, load  # noqa: F401
from jsteer.sharding import HOOK_ROW_RANK as _HOOK_ROW_RANK  # noqa: F401
from jsteer.sharding import BatchSplit as _BatchSplit  # noqa: F401

__all__ = ["LM", "load", "save", "from_state_dict", "save_artifact", "load_artifact", "embedded_path", "EMBEDDED"]
