"""The mirror's files on disk: model files stored by sha256 under MIRROR_DIR, with their GGUF facts."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from django.conf import settings

from cluster.models import ModelFile

GGUF_MAGIC = b"GGUF"
CHUNK = 4 * 1024 * 1024


class NotGGUF(ValueError):
    pass


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_facts(path: Path) -> dict[str, object]:
    """Architecture, layers, context length, heads: what the memory estimate needs."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, struct errors, IndexError on damaged files
        raise NotGGUF(f"{path.name} looks like GGUF but cannot be read: {exc}") from exc

    def value(key: str) -> object:
        field = reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception:
            return None

    arch = value("general.architecture") or ""
    facts: dict[str, object] = {"architecture": arch, "name": value("general.name") or ""}
    for short in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        facts[short] = value(f"{arch}.{short}")
    for short in ("head_count", "head_count_kv", "key_length", "value_length"):
        facts[short] = value(f"{arch}.attention.{short}")
    facts["file_type"] = value("general.file_type")
    facts["tensor_count"] = len(reader.tensors)
    return {k: v for k, v in facts.items() if v is not None}


def store(source: Path) -> tuple[str, int, Path]:
    """Copy `source` into the mirror while hashing it. Returns (sha256, size, stored path)."""
    settings.MIRROR_DIR.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(dir=settings.MIRROR_DIR, prefix=".import-")
    try:
        with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        sha = digest.hexdigest()
        final = settings.MIRROR_DIR / sha
        if final.exists() and final.stat().st_size == size:
            os.unlink(tmp)
        else:
            os.replace(tmp, final)
        return sha, size, final
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def whole(model_file: ModelFile) -> bool:
    """Whether this control plane's mirror directory holds the file at its full size (its sha256 is checked when it
    is stored, adopted or pulled, not here)."""
    try:
        return model_file.path.stat().st_size == model_file.size
    except OSError:
        return False


def remove(sha: str) -> None:
    path = settings.MIRROR_DIR / sha
    if path.exists():
        path.unlink()


def free_bytes() -> int:
    settings.MIRROR_DIR.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(settings.MIRROR_DIR).free
