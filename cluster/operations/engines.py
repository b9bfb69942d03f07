"""Engines: the kinds and versions models run on."""

from __future__ import annotations

from django.db import transaction

from cluster.errors import Conflict, OperationError
from cluster.events import kick_reconciler, record
from cluster.models import EngineVersion
from cluster.operations.validation import check_name, created, get_named
from ground.engines import CAPABILITIES, DRIVERS, Command


def add_engine(
    name: str,
    kind: str,
    actor: str,
    version: str = "",
    device: str = EngineVersion.Device.CPU,
    binary: str = "",
    command: str = "",
    serves: list[str] | None = None,
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
            Command.check_template(command)
        except ValueError as exc:
            raise OperationError(str(exc)) from None
    serves = _serves(kind, serves or [])
    with transaction.atomic():
        if EngineVersion.objects.filter(name=name).exists():
            raise Conflict(f"an engine named {name!r} already exists")
        engine = created(f"an engine named {name!r} already exists", lambda: EngineVersion.objects.create(
            name=name, kind=kind, version=version, device=device, binary=binary, command=command, serves=serves
        ))
        record("engine.added", actor, f"engine {name} ({kind} {version}, {device}) added, {_serving(kind, serves)}",
               subject=name)
    return engine


def set_engine(name: str, actor: str, serves: list[str] | None = None) -> EngineVersion:
    """Change what a command engine serves: its models' routes change at once (the gateways reload), their
    replicas run on untouched."""
    with transaction.atomic():
        engine = get_named(EngineVersion.objects.select_for_update(), "engine", name)
        if serves is None:
            return engine
        clean = _serves(engine.kind, serves)
        if clean == engine.serves:
            return engine
        engine.serves = clean
        engine.save(update_fields=["serves", "updated_at"])
        record("engine.edited", actor, f"engine {name} edited: {_serving(engine.kind, clean)}", subject=name)
        kick_reconciler()
    return engine


def _serves(kind: str, serves) -> list[str]:
    """A declaration of what an engine serves, in CAPABILITIES' order; OperationError when it cannot be one."""
    if not isinstance(serves, list) or not all(isinstance(s, str) for s in serves):
        raise OperationError("serves must be a list of capabilities")
    unknown = sorted({s for s in serves if s not in CAPABILITIES})
    if unknown:
        raise OperationError(f"unknown capability {unknown[0]!r} in serves (known: {', '.join(CAPABILITIES)})")
    if serves and kind != "command":
        raise OperationError(f"only a command engine declares what it serves: a {kind} engine's models serve what "
                             "its driver reads from their profile")
    return [c for c in CAPABILITIES if c in serves]


def _serving(kind: str, serves: list[str]) -> str:
    if serves:
        return f"serving {', '.join(serves)}"
    return "serving what it is asked (nothing declared)" if kind == "command" else "serving what its profile says"

