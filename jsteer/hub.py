"""Hub ids (``"Qwen/Qwen2.5-0.5B"``) resolved to folders of the local HuggingFace cache; nothing
is ever downloaded.

The cache is huggingface_hub's layout::

    <cache>/models--Qwen--Qwen2.5-0.5B/refs/main            (a commit hash, one line)
                                      /snapshots/<commit>/  (config.json, *.safetensors, ...)

``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub`` (the order huggingface_hub reads them in). A revision is a ref
name (``refs/<name>``, e.g. ``main`` or ``pr/1``), a full commit hash, or an unambiguous prefix
of one (7+ hex digits) among the cached snapshots.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Optional

DEFAULT_REVISION = "main"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
_HEX = re.compile(r"^[0-9a-f]{7,40}$")


class NotCached(FileNotFoundError):
    """A hub id or revision that is not in the local cache; the message names where it looked."""


def cache_dir() -> tuple[pathlib.Path, str]:
    """(the hub cache folder, the setting that chose it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser(), "$HF_HUB_CACHE"
    if os.environ.get("HF_HOME"):
        return pathlib.Path(os.environ["HF_HOME"]).expanduser() / "hub", "$HF_HOME/hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(
            os.environ["XDG_CACHE_HOME"]
        ).expanduser() / "huggingface" / "hub", "$XDG_CACHE_HOME/huggingface/hub"
    return pathlib.Path("~/.cache/huggingface/hub").expanduser(), "the default cache"


def is_repo_id(s: str) -> bool:
    """Could ``s`` name a hub model (``name`` or ``org/name``; no ``--`` or ``..``)?"""
    return bool(_REPO_ID.match(s)) and "--" not in s and ".." not in s


def repo_folder(repo_id: str, cache: Optional[pathlib.Path] = None) -> pathlib.Path:
    """``<cache>/models--org--name``."""
    return (cache or cache_dir()[0]) / ("models--" + repo_id.replace("/", "--"))


def is_repo_folder(path: pathlib.Path) -> bool:
    """A cache folder of one model (``models--org--name`` holding ``snapshots/``)."""
    return path.name.startswith("models--") and (path / "snapshots").is_dir()


def _check_revision(revision: str) -> str:
    if not isinstance(revision, str) or not revision or revision.startswith("/") or ".." in revision.split("/"):
        raise ValueError(f"revision must be a ref name or a commit hash, got {revision!r}")
    return revision


def snapshot(folder: pathlib.Path, revision: Optional[str] = None) -> tuple[pathlib.Path, str]:
    """A repo cache folder + revision -> (snapshot folder, commit hash). NotCached names the
    folder, the revision and the refs / snapshots that are there."""
    revision = _check_revision(revision or DEFAULT_REVISION)
    snaps = folder / "snapshots"
    ref = folder / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if (snaps / commit).is_dir():
            return snaps / commit, commit
        raise NotCached(f"{ref} points at commit {commit}, but {snaps / commit} is missing (an interrupted download?)")
    commits = sorted(p.name for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    if revision in commits:
        return snaps / revision, revision
    matches = [c for c in commits if _HEX.match(revision) and c.startswith(revision)]
    if len(matches) == 1:
        return snaps / matches[0], matches[0]
    refs_dir = folder / "refs"
    refs = sorted(str(p.relative_to(refs_dir)) for p in refs_dir.rglob("*") if p.is_file()) if refs_dir.is_dir() else []
    why = f"prefix of {len(matches)} cached commits" if len(matches) > 1 else "no such ref or cached commit"
    raise NotCached(
        f"{folder}: revision {revision!r} is not cached ({why}; refs: {refs or 'none'}; snapshots: {commits or 'none'})"
    )


def resolve(repo_id: str, revision: Optional[str] = None) -> tuple[pathlib.Path, str]:
    """Hub id -> (snapshot folder, commit hash) from the local cache. NotCached names the id,
    the cache folder looked in and the setting that chose it."""
    cache, why = cache_dir()
    folder = repo_folder(repo_id, cache)
    if not folder.is_dir():
        raise NotCached(
            f"{repo_id!r} is not in the HF cache: no {folder} ({why}; jsteer never downloads: "
            f"fetch it first, e.g. `hf download {repo_id}`)"
        )
    return snapshot(folder, revision)


__all__ = ["NotCached", "cache_dir", "is_repo_id", "repo_folder", "is_repo_folder", "snapshot", "resolve"]
