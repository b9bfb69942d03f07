"""The engines an agent started, as it records them: `STATE_DIR/engines/<replica>.json` (pid, the process's start
time, port, spec). The next agent adopts the ones still running; `llmgw up` on Ctrl-C, `llmgw service stop
--engines` and the tests stop them on purpose with `stop_recorded_engines`.

A record's engine is running only while its pid runs with the recorded start time: a pid the kernel has given to
another process since is not ours. An engine stopped on purpose leaves its record in `STATE_DIR/stopped/`, so the
next agent reports that replica `stopped` (on purpose), not `failed` with a crash back-off.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import NotRequired, TypedDict, cast

import psutil

from ground.protocol import DesiredReplica

START_TIME_SLACK = 0.5  # seconds: psutil's start time of the same process, read twice, differs by less


class EngineRecord(TypedDict):
    """An engine as the agent that started it records it (agents.agent.processes.start); one stopped on purpose
    has `stopped_at` and `reason` too. read() checks only `name` and `pid`: the rest is read with care."""

    name: str
    pid: int
    create_time: float  # psutil's, to tell the engine from a later process given its pid
    port: int
    sha256: str  # of its model file ("" when it has none)
    argv: list[str]
    started_at: float
    spec: DesiredReplica
    stopped_at: NotRequired[float]
    reason: NotRequired[str]


def engines_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "engines"


def stopped_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "stopped"


def read(path: Path) -> EngineRecord:
    """A record; ValueError (or OSError) when it cannot be read or lacks what every record has."""
    record = json.loads(Path(path).read_text())
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        raise ValueError(f"{path.name}: not an engine record")
    int(record["pid"])
    return cast(EngineRecord, record)  # JSON an agent wrote: its name and pid checked, the rest read with care


def running(record: EngineRecord) -> psutil.Process | None:
    """The recorded engine's process, if it still runs (same pid, same start time, not a zombie)."""
    try:
        process = psutil.Process(int(record["pid"]))
        if abs(process.create_time() - float(record["create_time"])) >= START_TIME_SLACK:
            return None
        return process if process.status() != psutil.STATUS_ZOMBIE else None
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None


def stop_recorded_engines(state_dir: Path, timeout: float = 10.0, why: str = "stopped on purpose") -> list[str]:
    """Stop every recorded engine that still runs (SIGTERM to its process group, SIGKILL after `timeout`), and
    keep its record in `stopped/` with `why`, for the next agent to report. Returns the replicas it stopped."""
    stopped: list[str] = []
    for path in sorted(engines_dir(state_dir).glob("*.json")):
        try:
            record = read(path)
        except (OSError, ValueError, KeyError):
            continue
        process = running(record)
        if process is not None:
            _stop_group(process, timeout)
            stopped.append(record["name"])
        where = stopped_dir(state_dir)
        where.mkdir(mode=0o700, exist_ok=True)
        (where / path.name).write_text(json.dumps({**record, "stopped_at": time.time(), "reason": why}))
        path.unlink(missing_ok=True)
    return stopped


def _stop_group(process: psutil.Process, timeout: float) -> None:
    # each engine leads its own session and process group: the group is it and whatever it started
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            break
        except psutil.TimeoutExpired:
            continue
        except psutil.NoSuchProcess:
            break
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers of a leader that has exited
