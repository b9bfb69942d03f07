"""The control-plane processes (web, worker, beat) over Redis: who is running, and telling one to restart.

Each process registers itself in the hash `llmgw:control:procs` (field `ROLE@HOST:PID`, a JSON value with its
start time) and keeps its entry fresh from a daemon thread. To restart one, `request_restart` sets
`llmgw:control:restart:ID`; the process's thread sees it within a second, removes its entry and sends itself
SIGTERM, which each server takes as a graceful stop (daphne and uvicorn finish open requests, a Celery worker
its running tasks, beat its tick). Its supervisor — systemd's `Restart=always` for a fleet, `llmgw up` on one
machine — starts it again, and the new process registers under its new pid.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.conf import settings

from cluster import redis_options

log = logging.getLogger("llmgw.control")
PROCS = "llmgw:control:procs"
RESTART = "llmgw:control:restart:"
SUCCESSOR = "llmgw:control:successor:"  # + ROLE@HOST: a process asked to restart whose successor is to say so
HEARTBEAT = 2.0  # seconds between a process's heartbeats
STALE = 10.0  # an entry not refreshed for this long is a process that died
ROLES = ("web", "worker", "beat")

_started: dict[str, threading.Thread] = {}


@dataclass(frozen=True)
class Process:
    id: str
    role: str
    host: str
    pid: int
    started: float
    seen: float


def _client() -> redis.Redis:
    return redis_options.client()


def process_id(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


def start(role: str, on_successor: Callable[[str, dict], None] | None = None) -> None:
    """Register this process under `role` and obey restart requests (once per process). `on_successor(id, note)`
    runs once it is registered, if it took the place of a process that `expect_successor` named."""
    if role in _started or not settings.LLMGW_CONTROL:
        return
    pid = process_id(role)
    thread = threading.Thread(target=_watch, args=(role, pid, time.time(), on_successor), name=f"llmgw-control-{role}",
                              daemon=True)
    _started[role] = thread
    thread.start()


def _listening(timeout: float = 120.0) -> None:
    """Wait until this process holds a listening TCP socket (a web server that has bound its port), so that
    `wait_replaced` only sees a restarted web process once it can take connections: with two web processes
    behind a proxy, the second is not asked to restart while the first is still starting."""
    import psutil

    me = psutil.Process()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(c.status == psutil.CONN_LISTEN for c in me.net_connections(kind="tcp")):
                return
        except psutil.Error:
            return
        time.sleep(0.1)


def _watch(role: str, pid: str, started: float, on_successor=None) -> None:
    if role == "web":
        _listening()
    r = _client()
    entry = {"role": role, "host": socket.gethostname(), "pid": os.getpid(), "started": started}
    last_beat = 0.0
    while True:
        try:
            now = time.time()
            if now - last_beat >= HEARTBEAT:
                r.hset(PROCS, pid, json.dumps({**entry, "seen": now}))
                if not last_beat and on_successor is not None:
                    _succeed(r, role, pid, on_successor)
                last_beat = now
            if r.delete(RESTART + pid):
                log.info("%s: restart requested over Redis; stopping gracefully for the supervisor to start it again", pid)
                r.hdel(PROCS, pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return
        except redis.RedisError as exc:  # Redis away: keep trying; nothing here may end the process
            log.warning("control: %s", exc)
            time.sleep(HEARTBEAT)
        time.sleep(0.5)


def processes(client: redis.Redis | None = None) -> list[Process]:
    """Every live control-plane process, by role then host then start. Entries of dead processes are dropped."""
    r = client or _client()
    now = time.time()
    found, dead = [], []
    for key, raw in r.hgetall(PROCS).items():
        try:
            value = json.loads(raw)
            name = key.decode() if isinstance(key, bytes) else key
            p = Process(name, value["role"], value["host"], int(value["pid"]), float(value["started"]),
                        float(value["seen"]))
        except (ValueError, KeyError, TypeError):
            dead.append(key)
            continue
        if now - p.seen > STALE:
            dead.append(key)
        else:
            found.append(p)
    if dead:
        r.hdel(PROCS, *dead)
    order = {role: i for i, role in enumerate(ROLES)}
    return sorted(found, key=lambda p: (order.get(p.role, 9), p.host, p.started))


def _succeed(r: redis.Redis, role: str, pid: str, on_successor) -> None:
    raw = r.getdel(SUCCESSOR + f"{role}@{socket.gethostname()}")
    if raw:
        try:
            on_successor(pid, json.loads(raw))
        except Exception:  # saying so must not end the process
            log.exception("%s: reporting it took its predecessor's place failed", pid)


def expect_successor(process: Process, note: dict, client: redis.Redis | None = None) -> None:
    """The next process of `process`'s role on its host to register is its successor: it calls its
    `on_successor` with this note (a process that restarts itself cannot wait for its own return)."""
    value = json.dumps({**note, "id": process.id, "asked": time.time()})
    (client or _client()).set(SUCCESSOR + f"{process.role}@{process.host}", value, ex=3600)


def request_restart(process: Process, client: redis.Redis | None = None) -> None:
    (client or _client()).set(RESTART + process.id, "1", ex=60)


def wait_replaced(process: Process, timeout: float, client: redis.Redis | None = None) -> Process | None:
    """The process that took `process`'s place (same role and host, not registered when the wait began; a web
    process registers once it listens), or None. Call it right after `request_restart`."""
    r = client or _client()
    known = {p.id for p in processes(r)}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = processes(r)
        if not any(p.id == process.id for p in now):
            for p in now:
                if p.role == process.role and p.host == process.host and p.id not in known:
                    return p
        time.sleep(0.25)
    return None
