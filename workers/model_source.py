"""Which checkpoint a worker loads (MODEL, or the demo model built offline), and which
version of it: what a cached result is tied to."""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.settings import Settings
from workers import demo_model

SMALL_FILE_BYTES = 16 * 1024 * 1024  # configs, tokenizers, templates: hashed whole


def resolve_model_path(settings: Settings) -> str:
    """A local path or hub id; with MODEL unset, the demo model (built if not cached)."""
    if settings.model:
        return settings.model
    return str(demo_model.build())


def model_version(settings: Settings, engine: str, path: str) -> str:
    """MODEL_VERSION, or the engine and a digest of the checkpoint's files: the contents of
    its small files (config, tokenizer, chat template) and the names and sizes of its
    weights. A new checkpoint, tokenizer or template, or another engine, is a new version,
    so cached answers of the old one are never served for it."""
    if settings.model_version:
        return settings.model_version
    return f"{engine}:{_checkpoint_digest(path)}"


def _checkpoint_digest(path: str) -> str:
    root = Path(path)
    if not root.is_dir():
        root = _hub_snapshot(path) or root
    if not root.is_dir():
        return hashlib.sha256(path.encode()).hexdigest()[:16]
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root)}\0{size}\0".encode())
        if size <= SMALL_FILE_BYTES and file.suffix != ".safetensors":
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a hub checkpoint (its directory name is the commit)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded: the id alone names it
        return None
