"""The agent: one per node. Keeps the node's engine processes as the server's desired list says.

    python -m agents.agent --server URL --token TOKEN [--state-dir D] [--memory 2GiB] [--gpus 24GiB,24GiB|none]
                           [--port-range 20000-20999] [--stop-timeout S] [--start-timeout S] [--report-interval S]

It dials `ws(s)://SERVER/ws/agent/`, says hello, converges to every `desired` it receives and reports replica
states. Engines run in their own process session and outlive the agent; their pid, port and spec are recorded in
`STATE_DIR/engines/`, and a new agent adopts the ones still running. No Django here: nodes have only this package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import pwd
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from agents import facts as node_facts
from agents.engines import driver_for, engine_host
from agents.protocol import DesiredReplica, Facts, ReplicaStatus

log = logging.getLogger("llmgw.agent")

ENGINE_USER = "llmgw-engine"  # when the agent runs as root, engines run as this user if it exists
LOG_TAIL_LINES = 30
CHUNK = 1024 * 1024
STARTING_POLL = 0.5  # seconds between health checks while an engine loads
WATCH_TICK = 0.25  # seconds between checks that an engine process still runs
HEALTH_FAILURES = 3  # consecutive failed health checks that fail a ready replica
PROGRESS_INTERVAL = 0.5  # at most two progress messages a second per download
DOWNLOAD_ATTEMPTS = 5
LOG_RETENTION = 7 * 24 * 3600  # engine logs of replicas long gone are deleted after a week
SECRET_ENV = ("LLMGW_TOKEN", "LLMGW_AGENT_TOKEN")  # the agent's own secrets never reach an engine
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # replica names become file names
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
REFUSED_CODES = {4001: "the token was not accepted", 4003: "the server refused this agent"}


class ReplicaFailed(Exception):
    """A replica cannot run; the message is the reason reported to the server."""


class DownloadRetry(Exception):
    """A download broke in a way worth another try (network, server error); the partial file is kept."""


@dataclass
class Replica:
    name: str
    spec: DesiredReplica | None
    state: str = "pending"
    port: int | None = None
    pid: int | None = None
    reason: str = ""
    log_tail: str = ""
    popen: subprocess.Popen | None = None  # spawned by this agent: reaped with poll()
    process: psutil.Process | None = None  # adopted: watched with psutil
    task: asyncio.Task | None = None
    stopping: bool = False

    def status(self) -> ReplicaStatus:
        status: ReplicaStatus = {"name": self.name, "state": self.state, "pid": self.pid, "port": self.port}
        if self.reason:
            status["reason"] = self.reason
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


def port_free(port: int, host: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As servers bind: a port held only by TIME_WAIT connections is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def write_json(path: Path, data: dict) -> None:
    """Atomically, readable by the agent's user only (records hold the engine key)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _hash_file(path: Path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest


def _spec_problem(spec: dict) -> str:
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


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "engine exited (its exit code is unknown: it was started by an earlier agent)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine was killed by {name}"
    return f"engine exited with code {code}"


class EngineSupervisor:
    """Starts, watches, adopts and stops this node's engine processes; usable without a server connection.

    `converge(desired)` is the whole interface the stream needs; `statuses()` is what it reports.
    `on_change()` is called on every state change, `on_progress(replica, done, total)` while downloading.
    """

    def __init__(
        self,
        state_dir: Path,
        token: str = "",
        *,
        stop_timeout: float = 10.0,
        start_timeout: float = 600.0,
        health_interval: float = 5.0,
        health_timeout: float = 5.0,
        on_change: Callable[[], None] | None = None,
        on_progress: Callable[[str, int, int], None] | None = None,
    ):
        self.state_dir = Path(state_dir)
        self.token = token
        self.stop_timeout = stop_timeout
        self.start_timeout = start_timeout
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.on_change = on_change or (lambda: None)
        self.on_progress = on_progress or (lambda replica, done, total: None)
        self.replicas: dict[str, Replica] = {}
        self.records = self.state_dir / "engines"
        self.failed_dir = self.state_dir / "failed"
        self.logs = self.state_dir / "logs"
        self.cache = self.state_dir / "cache"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for path, mode in ((self.records, 0o700), (self.failed_dir, 0o700), (self.logs, 0o750), (self.cache, 0o755)):
            path.mkdir(exist_ok=True)
            os.chmod(path, mode)
        self._downloads: dict[str, asyncio.Task] = {}
        self._download_waiters: dict[str, set[str]] = {}
        self._last_progress: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._health_client: httpx.AsyncClient | None = None
        self._download_client: httpx.AsyncClient | None = None

    # The interface

    async def adopt(self) -> None:
        """Take over the engines an earlier agent started and that still run; remember the ones that failed."""
        adopted = []
        for path in sorted(self.records.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                name, pid, spec = record["name"], int(record["pid"]), record["spec"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("deleting unreadable engine record %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            try:
                process = psutil.Process(pid)
                alive = abs(process.create_time() - float(record["create_time"])) < 0.5
                alive = alive and process.status() != psutil.STATUS_ZOMBIE
            except (psutil.Error, KeyError, TypeError, ValueError):
                alive = False
            if not alive:
                path.unlink(missing_ok=True)
                replica = Replica(name=name, spec=spec, state="failed", port=record.get("port"))
                replica.reason = "engine exited while the agent was not running"
                self._mark_failed(replica, replica.reason)
                self.replicas[name] = replica
                log.warning("%s: engine (pid %s) is gone; failed", name, pid)
                continue
            replica = Replica(name=name, spec=spec, state="starting", port=record.get("port"), pid=pid)
            replica.process = process
            self.replicas[name] = replica
            adopted.append(replica)
            log.info("%s: adopted engine pid %s on port %s", name, pid, replica.port)
        for path in sorted(self.failed_dir.glob("*.json")):
            try:
                marker = json.loads(path.read_text())
                name = marker["name"]
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if name not in self.replicas:
                self.replicas[name] = Replica(
                    name=name,
                    spec=None,
                    state="failed",
                    port=marker.get("port"),
                    reason=marker.get("reason", ""),
                    log_tail=marker.get("log_tail", ""),
                )
        # One quick check, so an engine that serves is reported ready in the hello already.
        results = await asyncio.gather(*(self._probe(r, timeout=2.0) for r in adopted))
        for replica, (ok, _) in zip(adopted, results):
            if ok and not await self._open_without_key(replica):
                self._set(replica, "ready")
            replica.task = self._spawn_task(self._run(replica))
        self._prune_logs()

    def converge(self, desired: list[DesiredReplica]) -> None:
        """Start what is listed and not running, stop what runs and is not listed. Failed ones stay failed."""
        wanted: dict[str, DesiredReplica] = {}
        for spec in desired:
            name = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(name, str) or not NAME_RE.match(name):
                log.warning("ignoring a desired replica with a bad name: %r", name)
                continue
            wanted[name] = spec
        for name, spec in wanted.items():
            replica = self.replicas.get(name)
            if replica is not None:
                if replica.spec is None and replica.state != "failed":
                    replica.spec = spec
                continue
            port = spec.get("port")
            replica = Replica(name=name, spec=spec, port=port if isinstance(port, int) else None)
            self.replicas[name] = replica
            log.info("%s: wanted (%s on port %s)", name, (spec.get("engine") or {}).get("kind"), replica.port)
            replica.task = self._spawn_task(self._run(replica))
            self.on_change()
        for name, replica in list(self.replicas.items()):
            if name in wanted or replica.stopping or replica.state == "stopped":
                continue
            if replica.state == "failed" and not self._alive(replica):
                del self.replicas[name]
                (self.failed_dir / f"{name}.json").unlink(missing_ok=True)
                self.on_change()
            else:
                self._spawn_task(self.stop(name))

    def statuses(self, consume_stopped: bool = False) -> list[ReplicaStatus]:
        """Every replica known here; with consume_stopped, the stopped ones are forgotten once reported."""
        result = [r.status() for r in self.replicas.values()]
        if consume_stopped:
            for name in [n for n, r in self.replicas.items() if r.state == "stopped"]:
                del self.replicas[name]
        return result

    async def stop(self, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is None or replica.stopping:
            return
        replica.stopping = True
        if replica.task is not None and not replica.task.done() and replica.task is not asyncio.current_task():
            replica.task.cancel()
            await asyncio.wait([replica.task])
        if replica.pid is not None:
            log.info("%s: stopping engine pid %s", name, replica.pid)
        await self._terminate(replica)
        (self.records / f"{name}.json").unlink(missing_ok=True)
        (self.failed_dir / f"{name}.json").unlink(missing_ok=True)
        replica.pid = None
        replica.popen = replica.process = None
        self._set(replica, "stopped")

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(name) for name in list(self.replicas)))

    async def wait_for(self, name: str, states: str | tuple[str, ...], timeout: float) -> Replica:
        """The replica once it is in one of `states`; TimeoutError (saying its state) otherwise."""
        states = (states,) if isinstance(states, str) else states
        deadline = time.monotonic() + timeout
        while True:
            replica = self.replicas.get(name)
            if replica is not None and replica.state in states:
                return replica
            if time.monotonic() > deadline:
                state = replica.state if replica else "unknown"
                reason = f" ({replica.reason})" if replica and replica.reason else ""
                raise TimeoutError(f"{name} is {state}{reason}, not {'/'.join(states)}, after {timeout:g}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Forget the engines without stopping them (they keep serving; the next agent adopts them)."""
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for client in (self._health_client, self._download_client):
            if client is not None:
                await client.aclose()
        self._health_client = self._download_client = None

    # One replica's life

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _set(self, replica: Replica, state: str, reason: str = "") -> None:
        if replica.state == state and replica.reason == reason:
            return
        replica.state, replica.reason = state, reason
        pid = f" (pid {replica.pid})" if replica.pid and state in ("starting", "ready") else ""
        log.log(
            logging.WARNING if state == "failed" else logging.INFO,
            "%s: %s%s%s",
            replica.name,
            state,
            pid,
            f": {reason}" if reason else "",
        )
        self.on_change()

    async def _run(self, replica: Replica) -> None:
        try:
            if replica.popen is None and replica.process is None:
                problem = _spec_problem(replica.spec or {})
                if problem:
                    raise ReplicaFailed(problem)
                model_path = await self._model_file(replica)
                self._start(replica, model_path)
            await self._watch(replica)
        except ReplicaFailed as exc:
            await self._fail(replica, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the agent must outlive any one replica's surprise
            log.exception("%s: unexpected error", replica.name)
            await self._fail(replica, f"agent error: {type(exc).__name__}: {exc}")

    def _start(self, replica: Replica, model_path: str) -> None:
        spec = replica.spec
        driver = driver_for(spec["engine"]["kind"])
        port = spec["port"]
        if not port_free(port, engine_host()):
            raise ReplicaFailed(f"port {port} is in use on this node")
        try:
            argv = driver.command(spec, model_path, port)
        except (ValueError, KeyError) as exc:
            raise ReplicaFailed(f"cannot build the engine command: {exc}") from None
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.update(driver.env(spec))
        extra = self._engine_user(env, model_path)
        shown = " ".join(a.replace(spec["engine_key"], "***") for a in argv)
        log_path = self.logs / f"{replica.name}.log"
        with open(log_path, "ab") as log_file:
            log_file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} llmgw agent starts: {shown}\n".encode())
            log_file.flush()
            try:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own session: it outlives the agent and is stopped as a group
                    close_fds=True,
                    **extra,
                )
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                raise ReplicaFailed(f"cannot start the engine: {exc}") from None
        replica.popen, replica.pid = popen, popen.pid
        try:
            create_time = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            create_time = 0.0
        write_json(
            self.records / f"{replica.name}.json",
            {
                "name": replica.name,
                "pid": popen.pid,
                "create_time": create_time,
                "port": port,
                "sha256": (spec.get("file") or {}).get("sha256", ""),
                "argv": argv,
                "started_at": time.time(),
                "spec": spec,
            },
        )
        log.info("%s: started %s", replica.name, shown)
        self._set(replica, "starting")

    def _engine_user(self, env: dict, model_path: str) -> dict:
        """Popen arguments to run the engine as ENGINE_USER when the agent is root and that user exists."""
        if os.geteuid() != 0:
            return {}
        try:
            user = pwd.getpwnam(ENGINE_USER)
        except KeyError:
            return {}
        # It reads the cached model through the state directory, which it may traverse but not list.
        os.chmod(self.state_dir, os.stat(self.state_dir).st_mode | 0o001)
        if model_path and os.path.exists(model_path):
            os.chmod(model_path, os.stat(model_path).st_mode | 0o044)
        env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    async def _watch(self, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        failures, next_check = 0, 0.0
        while True:
            exited, code = self._exited(replica)
            if exited:
                raise ReplicaFailed(_exit_reason(code))
            now = loop.time()
            if now >= next_check:
                ok, error = await self._probe(replica, timeout=self.health_timeout if replica.state == "ready" else 2.0)
                exited, code = self._exited(replica)
                if exited:
                    raise ReplicaFailed(_exit_reason(code))
                if replica.state == "ready":
                    failures = 0 if ok else failures + 1
                    if failures:
                        log.warning(
                            "%s: health check failed (%d/%d): %s", replica.name, failures, HEALTH_FAILURES, error
                        )
                    if failures >= HEALTH_FAILURES:
                        raise ReplicaFailed(f"health check failed {failures} times in a row: {error}")
                    next_check = loop.time() + self.health_interval
                elif ok:
                    problem = await self._open_without_key(replica)
                    if problem:
                        raise ReplicaFailed(problem)
                    self._set(replica, "ready")
                    next_check = loop.time() + self.health_interval
                elif loop.time() > deadline:
                    raise ReplicaFailed(f"did not become healthy within {self.start_timeout:g}s (last check: {error})")
                else:
                    next_check = loop.time() + STARTING_POLL
            await asyncio.sleep(WATCH_TICK)

    async def _probe(self, replica: Replica, timeout: float) -> tuple[bool, str]:
        spec = replica.spec or {}
        try:
            driver = driver_for(spec["engine"]["kind"])
            if self._health_client is None:
                self._health_client = httpx.AsyncClient(trust_env=False)
            response = await self._health_client.get(
                driver.health_url(replica.port),
                headers=driver.health_headers(spec["engine_key"]),
                timeout=timeout,
            )
        except (httpx.HTTPError, OSError, KeyError, TypeError, ValueError) as exc:
            return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if response.status_code == 200:
            return True, ""
        return False, f"HTTP {response.status_code} from {response.request.url.path}"

    async def _open_without_key(self, replica: Replica) -> str:
        """Why the engine must not serve: it answers without the engine key; "" when it refuses as it should."""
        url = driver_for(replica.spec["engine"]["kind"]).health_url(replica.port)
        try:
            response = await self._health_client.get(url, timeout=5.0)
        except httpx.HTTPError as exc:  # it just answered with the key; a hiccup here is no proof either way
            log.warning("%s: could not check that the engine requires its key: %r", replica.name, exc)
            return ""
        if response.status_code in (401, 403):
            return ""
        return f"engine answers {response.request.url.path} without the engine key (HTTP {response.status_code})"

    def _exited(self, replica: Replica) -> tuple[bool, int | None]:
        """(exited, exit code or None when unknown)."""
        if replica.popen is not None:
            code = replica.popen.poll()
            return code is not None, code
        if replica.process is not None:
            try:
                # An agent that re-executed itself is still the parent of the engines it started.
                pid, status = os.waitpid(replica.process.pid, os.WNOHANG)
                if pid:
                    return True, os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                pass
            try:
                running = replica.process.is_running() and replica.process.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                running = False
            return not running, None
        return True, None

    def _alive(self, replica: Replica) -> bool:
        return (replica.popen is not None or replica.process is not None) and not self._exited(replica)[0]

    async def _terminate(self, replica: Replica) -> None:
        """SIGTERM to the engine's process group, SIGKILL after stop_timeout (llama.cpp can hang on SIGTERM)."""
        if replica.pid is None or not self._alive(replica):
            self._kill_group(replica.pid, signal.SIGKILL)  # stragglers of a leader that already exited
            return
        pid = replica.pid
        self._kill_group(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_timeout
        while self._alive(replica) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._alive(replica):
            log.warning(
                "%s: engine pid %s still runs %gs after SIGTERM; sending SIGKILL", replica.name, pid, self.stop_timeout
            )
            self._kill_group(pid, signal.SIGKILL)
            deadline = loop.time() + 10.0
            while self._alive(replica) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self._kill_group(pid, signal.SIGKILL)

    @staticmethod
    def _kill_group(pid: int | None, sig: signal.Signals) -> None:
        if pid is None:
            return
        # Each engine leads its own session and group; its pid is not reused while the group has members.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)

    async def _fail(self, replica: Replica, reason: str) -> None:
        if replica.stopping:
            return
        if self._alive(replica):
            await self._terminate(replica)
        elif replica.pid is not None:
            self._kill_group(replica.pid, signal.SIGKILL)
        (self.records / f"{replica.name}.json").unlink(missing_ok=True)
        self._mark_failed(replica, reason)
        replica.pid = None
        self._set(replica, "failed", reason)

    def _mark_failed(self, replica: Replica, reason: str) -> None:
        """Remembered across agent restarts: a failed replica is never started again under its name."""
        replica.log_tail = log_tail(self.logs / f"{replica.name}.log")
        write_json(
            self.failed_dir / f"{replica.name}.json",
            {"name": replica.name, "reason": reason, "log_tail": replica.log_tail, "port": replica.port},
        )

    def _prune_logs(self) -> None:
        cutoff = time.time() - LOG_RETENTION
        for path in self.logs.glob("*.log"):
            with contextlib.suppress(OSError):
                if path.stem not in self.replicas and path.stat().st_mtime < cutoff:
                    path.unlink()

    # Model files

    async def _model_file(self, replica: Replica) -> str:
        """The model file's path in the cache, downloading it first (once per sha256) when missing."""
        file = replica.spec.get("file")
        if not file:
            return ""
        sha256, size = file["sha256"], int(file.get("size") or 0)
        path = self.cache / sha256
        if path.exists():
            if not size or path.stat().st_size == size:
                return str(path)
            log.warning("%s: cached %s has the wrong size; downloading it again", replica.name, sha256[:12])
            path.unlink()
        self._set(replica, "downloading")
        task = self._downloads.get(sha256)
        if task is None or task.done():
            task = self._spawn_task(self._download(file))
            self._downloads[sha256] = task
            task.add_done_callback(self._download_done)
        waiters = self._download_waiters.setdefault(sha256, set())
        waiters.add(replica.name)
        try:
            await asyncio.shield(task)
        finally:
            waiters.discard(replica.name)
            if not waiters and not task.done():
                task.cancel()  # nobody needs it any more; the partial file stays for a later resume
        return str(path)

    def _download_done(self, task: asyncio.Task) -> None:
        for sha256, running in list(self._downloads.items()):
            if running is task:
                del self._downloads[sha256]
        if not task.cancelled():
            task.exception()  # retrieved: the replicas that waited for it report it

    async def _download(self, file: dict) -> None:
        sha256 = file["sha256"]
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                await self._fetch(file)
                return
            except DownloadRetry as exc:
                if attempt == DOWNLOAD_ATTEMPTS:
                    raise ReplicaFailed(f"download of {file.get('name') or sha256} failed: {exc}") from None
                retries = DOWNLOAD_ATTEMPTS - 1
                log.warning("download of %s broke (%s); retry %d of %d", sha256[:12], exc, attempt, retries)
                await asyncio.sleep(min(2.0 ** (attempt - 1), 30.0))

    async def _fetch(self, file: dict) -> None:
        sha256, url, size = file["sha256"], file["url"], int(file.get("size") or 0)
        part, final = self.cache / f"{sha256}.part", self.cache / sha256
        have = part.stat().st_size if part.exists() else 0
        digest = await asyncio.to_thread(_hash_file, part) if have else hashlib.sha256()
        headers = {"Authorization": f"Bearer {self.token}"}
        if have:
            headers["Range"] = f"bytes={have}-"
        if self._download_client is None:
            self._download_client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=15.0))
        try:
            async with self._download_client.stream("GET", url, headers=headers) as response:
                status = response.status_code
                if status == 416 and have:
                    if have != size:
                        part.unlink(missing_ok=True)
                        raise DownloadRetry(f"the server refused to resume at byte {have}")
                    total = have  # the partial file is already whole
                elif status in (200, 206):
                    start = 0
                    if status == 206:
                        match = re.match(r"bytes (\d+)-", response.headers.get("content-range", ""))
                        start = int(match.group(1)) if match else -1
                    if start != have:  # the server sent the whole file, or not where we asked
                        if status == 206:
                            part.unlink(missing_ok=True)
                            raise DownloadRetry(f"asked for bytes from {have}, got {start}")
                        have, digest = 0, hashlib.sha256()
                    length = int(response.headers.get("content-length") or 0)
                    total = size or (have + length)
                    if have:
                        log.info("resuming download of %s at byte %d of %d", sha256[:12], have, total)
                    with open(part, "ab" if have else "wb") as f:
                        async for chunk in response.aiter_bytes():  # as they arrive: a break loses nothing
                            f.write(chunk)
                            digest.update(chunk)
                            have += len(chunk)
                            self._progress(sha256, have, total)
                elif status >= 500 or status == 429:
                    raise DownloadRetry(f"HTTP {status} from {url}")
                else:
                    body = (await response.aread())[:200].decode("utf-8", "replace")
                    raise ReplicaFailed(f"download of {url} failed: HTTP {status} {body}".strip())
        except httpx.TransportError as exc:
            raise DownloadRetry(f"{type(exc).__name__}: {exc}") from None
        got = digest.hexdigest()
        if got != sha256:
            part.unlink(missing_ok=True)
            raise ReplicaFailed(f"sha256 mismatch: expected {sha256}, got {got}")
        os.chmod(part, 0o644)
        os.replace(part, final)
        self._progress(sha256, have, total, force=True)
        log.info("downloaded %s (%d bytes)", sha256[:12], have)

    def _progress(self, sha256: str, done: int, total: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress.get(sha256, 0.0) < PROGRESS_INTERVAL:
            return
        self._last_progress[sha256] = now
        if force:
            self._last_progress.pop(sha256)
        for name in sorted(self._download_waiters.get(sha256, ())):
            self.on_progress(name, done, total)


def agent_url(server: str) -> str:
    """ws(s)://HOST[/prefix]/ws/agent/ from the server's http(s) URL."""
    parts = urlsplit(server.strip())
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a server URL: {server!r} (write e.g. https://llmgw.example.com)")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws/agent"):
        path += "/ws/agent"
    return urlunsplit((scheme, parts.netloc, path + "/", "", ""))


class Agent:
    """The stream to the server around an EngineSupervisor: hello, desired, report, progress, restart_agent."""

    def __init__(
        self,
        server: str,
        token: str,
        state_dir: Path,
        facts: Facts,
        *,
        stop_timeout: float = 10.0,
        start_timeout: float = 600.0,
        report_interval: float = 5.0,
        health_interval: float = 5.0,
    ):
        self.url = agent_url(server)
        self.token = token
        self.facts = facts
        self.report_interval = report_interval
        self.engines = EngineSupervisor(
            state_dir,
            token,
            stop_timeout=stop_timeout,
            start_timeout=start_timeout,
            health_interval=health_interval,
            on_change=self._changed,
            on_progress=self._progress,
        )
        self._ws = None
        self._dirty: asyncio.Event | None = None
        self._sends: set[asyncio.Task] = set()

    async def run(self) -> str:
        """Serves the stream until the server says restart_agent ("restart"); reconnects forever otherwise."""
        self._dirty = asyncio.Event()
        await self.engines.adopt()
        loop = asyncio.get_running_loop()
        delay = 0.5
        while True:
            connected_at = None
            try:
                async with connect(
                    self.url,
                    additional_headers={"Authorization": f"Bearer {self.token}"},
                    open_timeout=15,
                    ping_interval=20,
                    ping_timeout=20,
                    max_size=16 * 1024 * 1024,
                ) as ws:
                    connected_at = loop.time()
                    log.info("connected to %s", self.url)
                    if await self._session(ws) == "restart":
                        return "restart"
                    log.warning("server closed the stream (code %s); reconnecting", ws.close_code)
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    log.error("server refused this agent (HTTP %s): check the node token; retrying", status)
                else:
                    log.warning("server answered HTTP %s to the stream; retrying", status)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else None
                if code in REFUSED_CODES:
                    log.error(
                        "server closed the stream: %s (code %s); check the node token; retrying",
                        REFUSED_CODES[code],
                        code,
                    )
                elif code == 4000:
                    log.warning("another agent connected with this node's token and replaced this one; retrying")
                else:
                    log.warning("lost the stream to %s (%s); reconnecting", self.url, exc)
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                log.warning("cannot reach %s: %s; retrying", self.url, exc or type(exc).__name__)
            except Exception:  # whatever went wrong, engines keep running and the agent tries again
                log.exception("the stream to %s failed; reconnecting", self.url)
            if connected_at is not None and loop.time() - connected_at > 30:
                delay = 0.5
            await asyncio.sleep(delay * random.uniform(0.75, 1.25))
            delay = min(delay * 2, 30.0)

    async def _session(self, ws) -> str:
        self._dirty.clear()  # the hello says it all
        await ws.send(json.dumps({"type": "hello", "facts": self.facts, "replicas": self.engines.statuses()}))
        self._ws = ws
        reporter = asyncio.get_running_loop().create_task(self._report_loop())
        try:
            async for raw in ws:
                if self._handle(raw) == "restart":
                    log.info("server asked this agent to restart; engines keep running")
                    await ws.close()
                    return "restart"
            return "closed"
        finally:
            self._ws = None
            reporter.cancel()
            await asyncio.wait([reporter])

    def _handle(self, raw) -> str | None:
        try:
            message = json.loads(raw)
        except ValueError as exc:
            log.warning("ignoring a message that is not JSON (%s): %.100r", exc, raw)
            return None
        try:
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "desired":
                replicas = message.get("replicas")
                if not isinstance(replicas, list):
                    log.warning("ignoring a desired message without a replicas list")
                    return None
                self.engines.converge(replicas)
            elif kind == "restart_agent":
                return "restart"
            else:
                log.warning("ignoring a message of unknown type %r", kind)
        except Exception:  # a bad message must never end the agent
            log.exception("ignoring a message that could not be handled: %.200r", raw)
        return None

    async def _report_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=self.report_interval)
                await asyncio.sleep(0.1)  # one report for a burst of changes
            except TimeoutError:
                pass
            self._dirty.clear()
            report = {"type": "report", "full": True, "replicas": self.engines.statuses(consume_stopped=True)}
            await self._send(report)

    async def _send(self, message: dict) -> bool:
        ws = self._ws
        if ws is None:
            return False
        try:
            await ws.send(json.dumps(message))
        except ConnectionClosed:
            return False
        return True

    def _changed(self) -> None:
        if self._dirty is not None:
            self._dirty.set()

    def _progress(self, replica: str, done: int, total: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._send({"type": "progress", "replica": replica, "done": done, "total": total})
        )
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)


async def _serve(agent: Agent) -> str:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        return await agent.run()
    except asyncio.CancelledError:
        log.info("agent stopping; engines keep running")
        return "stopped"
    finally:
        await agent.engines.close()


def run(
    server: str,
    token: str,
    state_dir: Path,
    memory: int | None,
    gpus: list[int] | None,
    port_range: tuple[int, int],
    stop_timeout: float = 10.0,
    report_interval: float = 5.0,
    start_timeout: float = 600.0,
) -> None:
    """Runs the agent until SIGTERM/SIGINT; re-executes this process when the server asks for a restart."""
    if not token:
        raise ValueError("the agent needs a node token (--token)")
    agent_url(server)  # a bad URL is an error now, not a retry loop
    state_dir = Path(state_dir).resolve()
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    facts = node_facts.gather(memory=memory, gpus=gpus, port_range=port_range)
    engines = ", ".join(f"{k} {v}".strip() for k, v in facts["engines"].items()) or "none"
    log.info(
        "agent %s on %s: %d CPUs, %.1f GiB offered, %d GPU(s), engines: %s; state in %s",
        facts["agent_version"],
        facts["hostname"],
        facts["cpu_count"],
        facts["memory_bytes"] / 1024**3,
        len(facts["gpus"]),
        engines,
        state_dir,
    )
    agent = Agent(
        server,
        token,
        state_dir,
        facts,
        stop_timeout=stop_timeout,
        start_timeout=start_timeout,
        report_interval=report_interval,
    )
    if asyncio.run(_serve(agent)) == "restart":
        argv = [sys.executable, *sys.orig_argv[1:]]
        log.info("re-executing the agent: %s", " ".join(a if a != token else "***" for a in argv))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.agent", description="The llmgw node agent.")
    p.add_argument("--server", default=os.environ.get("LLMGW_SERVER", ""), help="e.g. https://llmgw.example.com")
    token = os.environ.get("LLMGW_AGENT_TOKEN", "")
    p.add_argument("--token", default=token, help="the node token (or LLMGW_AGENT_TOKEN, which keeps it out of ps)")
    p.add_argument("--state-dir", type=Path, default=Path(".llmgw/agent"), help="engine records, logs, model cache")
    p.add_argument("--memory", type=_arg(node_facts.parse_size), help="offer at most this much RAM, e.g. 8GiB")
    p.add_argument("--gpus", type=_arg(node_facts.parse_gpus), help="simulated GPUs' memory, e.g. 24GiB,24GiB, or none")
    p.add_argument("--port-range", type=_arg(node_facts.parse_port_range), default=(20000, 20999), help="LOW-HIGH")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds an engine may take to become healthy")
    p.add_argument("--report-interval", type=float, default=5.0, help="seconds between heartbeat reports")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.server or not args.token:
        parser().error("--server and --token are required (or LLMGW_SERVER and LLMGW_AGENT_TOKEN)")
    try:
        run(
            args.server,
            args.token,
            args.state_dir,
            args.memory,
            args.gpus,
            args.port_range,
            stop_timeout=args.stop_timeout,
            report_interval=args.report_interval,
            start_timeout=args.start_timeout,
        )
    except (ValueError, OSError) as exc:
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
