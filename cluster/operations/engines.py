"""Engines: the kinds and versions models run on."""

from __future__ import annotations

from django.db import transaction

from agents.engines import DRIVERS
from cluster.errors import Conflict, OperationError
from cluster.events import record
from cluster.models import EngineVersion
from cluster.operations.validation import check_name, created


def add_engine(
    name: str,
    kind: str,
    actor: str,
    version: str = "",
    device: str = EngineVersion.Device.CPU,
    binary: str = "",
    command: str = "",
) -> EngineVersion:
    check_name("engine", name)
    if kind not in DRIVERS:
        raise OperationError(f"unknown engine kind {kind!r} (known: {', '.join(sorted(DRIVERS))})")
    if device not in EngineVersion.Device.values:
        raise OperationError(f"device must be cpu or gpu, not {device!r}")
    if kind == "command" and not command.strip():
        raise OperationError("a command engine needs --command, e.g. '{python} server.py --port {port}'")
    if command:
        try:
            DRIVERS["command"].check_template(command)
        except ValueError as exc:
            raise OperationError(str(exc)) from None
    with transaction.atomic():
        if EngineVersion.objects.filter(name=name).exists():
            raise Conflict(f"an engine named {name!r} already exists")
        engine = created(f"an engine named {name!r} already exists", lambda: EngineVersion.objects.create(
            name=name, kind=kind, version=version, device=device, binary=binary, command=command
        ))
        record("engine.added", actor, f"engine {name} ({kind} {version}, {device}) added", subject=name)
    return engine

