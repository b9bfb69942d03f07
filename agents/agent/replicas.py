"""A replica as the agent knows it, whether the server's spec for it can run, and the files it leaves behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ground.engines import driver_for
from ground.protocol import DesiredReplica, ReplicaStatus

LOG_TAIL_LINES = 30
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # replica names become file names
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ReplicaFailed(Exception):
    """A replica cannot run; the message is the reason reported to the server."""


@dataclass
class Replica:
    name: str
    spec: DesiredReplica | None
    state: str = "pending"
    port: int | None = None
    pid: int | None = None
    reason: str = ""
    log_tail: str = ""
    popen: subprocess.Popen[bytes] | None = None  # spawned by this agent: reaped with poll()
    process: psutil.Process | None = None  # adopted: watched with psutil
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    on_purpose: bool = False  # stopped on purpose on this node (not asked by the server, not a crash)

    def status(self) -> ReplicaStatus:
        status: ReplicaStatus = {"name": self.name, "state": self.state, "pid": self.pid, "port": self.port}
        if self.reason:
            status["reason"] = self.reason
        if self.on_purpose:
            status["on_purpose"] = True
        if self.state == "failed":
            status["log_tail"] = self.log_tail
        return status


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def write_json(path: Path, data: Mapping[str, object]) -> None:
    """Atomically, readable by the agent's user only (records hold the engine key)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def spec_problem(spec: Mapping[str, Any]) -> str:
    """Why a desired entry cannot be run, or ""."""
    try:
        driver_for(str((spec.get("engine") or {}).get("kind", "")))
    except ValueError as exc:
        return str(exc)
    port = spec.get("port")
    if not isinstance(port, int) or not 1 <= port <= 65535:
        return f"the server gave no usable port ({port!r})"
    if not spec.get("engine_key") or not isinstance(spec["engine_key"], str):
        return "the server gave no engine key"
    file = spec.get("file")
    if file is not None:
        if not isinstance(file, dict) or not SHA256_RE.match(str(file.get("sha256", ""))) or not file.get("url"):
            return "the server gave a file without a sha256 or url"
    return ""
