"""The mirror: model files imported by path (the CLI anywhere, the API from the import directories) or uploaded,
and a model's file named by sha256, name or path."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import transaction

from cluster.errors import NotFound, OperationError
from cluster.events import record
from cluster.mirror import store, sync
from cluster.models import ModelFile


def _check_import_path(source: Path, actor: str) -> None:
    """The CLI runs on the server with its owner's rights; over the API and the dashboard (actor `user:…`),
    a path must lie in one of LLMGW_IMPORT_DIRS, or any file the server can read would be up for grabs."""
    if not actor.startswith("user:"):
        return
    roots = [Path(d).resolve() for d in settings.LLMGW_IMPORT_DIRS]
    resolved = source.resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots) or "none (set LLMGW_IMPORT_DIRS)"
        raise OperationError(f"imports by path must come from the import directories: {allowed}")


def import_model_file(path: str, actor: str, name: str | None = None) -> tuple[ModelFile, bool]:
    try:
        source = Path(path).expanduser()
    except RuntimeError:  # `~name` of a user this machine does not have
        raise NotFound(f"no such file: {path}") from None
    _check_import_path(source, actor)
    if not source.exists():
        raise NotFound(f"no such file: {path}")
    if not source.is_file():
        raise OperationError(f"not a regular file: {path}")
    return _import(source, actor, name or source.name, shown=path)


def import_uploaded_file(uploaded, actor: str, name: str | None = None) -> tuple[ModelFile, bool]:
    """A model file sent in a request (a Django UploadedFile: the dashboard's upload, the API's multipart POST)."""
    name = name or Path(uploaded.name or "").name
    if not uploaded.size:
        raise OperationError(f"the uploaded file {name!r} is empty")
    if hasattr(uploaded, "temporary_file_path"):  # large uploads: already spooled to disk by Django
        return _import(Path(uploaded.temporary_file_path()), actor, name, shown=name)
    with tempfile.NamedTemporaryFile(prefix="llmgw-upload-") as tmp:
        for chunk in uploaded.chunks():
            tmp.write(chunk)
        tmp.flush()
        return _import(Path(tmp.name), actor, name, shown=name)


def _import(source: Path, actor: str, name: str, shown: str) -> tuple[ModelFile, bool]:
    if not (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name):
        raise OperationError("a file name must be 1 to 255 characters without '/'")
    gguf = {}
    fmt = "other"
    try:
        if store.is_gguf(source):
            try:
                gguf = store.gguf_facts(source)
            except store.NotGGUF as exc:
                raise OperationError(str(exc)) from None
            fmt = "gguf"
        sha, size, _ = store.store(source)
    except OSError as exc:
        raise OperationError(f"cannot import {shown}: {exc.strerror or exc}") from None
    with transaction.atomic():
        existing = ModelFile.objects.filter(sha256=sha).first()
        if existing:
            sync.held_here(existing)  # perhaps imported through another control plane: now here too
            return existing, False
        model_file = ModelFile.objects.create(sha256=sha, name=name, size=size, format=fmt, gguf=gguf)
        sync.held_here(model_file)  # the other control planes pull it from here (cluster/mirror/sync.py)
        record(
            "file.imported", actor, f"file {model_file.name} ({sha[:12]}, {size} bytes) imported", subject=sha[:12]
        )
    return model_file, True


def resolve_file(ref: str, actor: str) -> ModelFile:
    """A sha256 (or a unique prefix of 8+ hex digits), a file name in the mirror, or a path to import."""
    ref = (ref or "").strip()
    if not ref:
        raise OperationError("name a model file: a sha256, a file name in the mirror, or a path")
    if re.fullmatch(r"[0-9a-f]{8,64}", ref):
        matches = list(ModelFile.objects.filter(sha256__startswith=ref)[:2])
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise OperationError(f"sha256 prefix {ref} matches several files; give more digits")
    by_name = list(ModelFile.objects.filter(name=ref)[:2])
    if len(by_name) == 1:
        return by_name[0]
    if len(by_name) > 1:
        raise OperationError(f"several files are named {ref!r}; give the sha256")
    if "/" in ref or Path(ref).exists():
        return import_model_file(ref, actor)[0]
    raise NotFound(f"no model file {ref!r} in the mirror (give a sha256, a file name, or a path to import)")

