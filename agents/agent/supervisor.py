"""The node's engines kept as the desired list says: started, watched for health, adopted, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import httpx

from agents.agent import processes, records
from agents.agent.downloads import ModelDownloads
from agents.agent.replicas import NAME_RE, Replica, ReplicaFailed, log_tail, spec_problem, write_json
from ground.engines import EngineDriver, driver_for
from ground.protocol import DesiredReplica, ReplicaStatus

log = logging.getLogger("llmgw.agent")

# seconds between health checks while an engine loads: a request waiting for a model loaded on demand waits for
# this check to see the engine ready (a GET on loopback)
STARTING_POLL = 0.1
WATCH_TICK = 0.25  # seconds between checks that an engine process still runs
HEALTH_FAILURES = 3  # consecutive failed health checks that fail a ready replica
LOG_RETENTION = 7 * 24 * 3600  # engine logs of replicas long gone are deleted after a week


class EngineSupervisor(ModelDownloads):
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
        self._downloads: dict[str, asyncio.Task[None]] = {}
        self._download_waiters: dict[str, set[str]] = {}
        self._last_progress: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._health_client: httpx.AsyncClient | None = None
        self._download_client: httpx.AsyncClient | None = None

    # The interface

    async def adopt(self) -> None:
        """Take over the engines an earlier agent started and that still run; remember the ones that failed."""
        adopted = []
        for path in sorted(self.records.glob("*.json")):
            try:
                record = records.read(path)
                name, pid, spec = record["name"], int(record["pid"]), record["spec"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("deleting unreadable engine record %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            process = records.running(record)
            if process is None:
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
        for path in sorted(records.stopped_dir(self.state_dir).glob("*.json")):
            # stopped on purpose while no agent ran (`llmgw up` stopping, `service stop --engines`): reported once
            try:
                record = records.read(path)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("deleting unreadable engine record %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            path.unlink(missing_ok=True)
            if record["name"] not in self.replicas:
                reason = str(record.get("reason") or "stopped on purpose")
                self.replicas[record["name"]] = Replica(name=record["name"], spec=None, state="stopped",
                                                        port=record.get("port"), reason=reason, on_purpose=True)
                log.info("%s: its engine was %s while no agent ran", record["name"], reason)
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
            if replica.state == "failed" and not processes.alive(replica):
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
        await processes.terminate(replica, self.stop_timeout)
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

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
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
                spec = replica.spec
                problem = spec_problem(spec or {})
                if problem or spec is None:  # no spec at all: spec_problem has said why
                    raise ReplicaFailed(problem)
                model_path = await self._model_file(replica, spec)
                processes.start(
                    replica,
                    spec,
                    model_path,
                    self.state_dir,
                    log_path=self.logs / f"{replica.name}.log",
                    record_path=self.records / f"{replica.name}.json",
                )
                self._set(replica, "starting")
            await self._watch(replica)
        except ReplicaFailed as exc:
            await self._fail(replica, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the agent must outlive any one replica's surprise
            log.exception("%s: unexpected error", replica.name)
            await self._fail(replica, f"agent error: {type(exc).__name__}: {exc}")

    async def _watch(self, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        failures, next_check = 0, 0.0
        while True:
            exited, code = processes.exited(replica)
            if exited:
                raise ReplicaFailed(processes.exit_reason(code))
            now = loop.time()
            if now >= next_check:
                ok, error = await self._probe(replica, timeout=self.health_timeout if replica.state == "ready" else 2.0)
                exited, code = processes.exited(replica)
                if exited:
                    raise ReplicaFailed(processes.exit_reason(code))
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
            await asyncio.sleep(max(0.0, min(WATCH_TICK, next_check - loop.time())))

    def _health_target(self, replica: Replica) -> tuple[type[EngineDriver], str]:
        """The replica's engine driver and the URL its engine answers health checks on; KeyError, TypeError or
        ValueError when its spec or port cannot say."""
        spec: Mapping[str, Any] = replica.spec or {}
        driver = driver_for(spec["engine"]["kind"])
        if replica.port is None:
            raise ValueError("the replica has no port")
        return driver, driver.health_url(replica.port)

    def _health_http(self) -> httpx.AsyncClient:
        if self._health_client is None:
            self._health_client = httpx.AsyncClient(trust_env=False)
        return self._health_client

    async def _probe(self, replica: Replica, timeout: float) -> tuple[bool, str]:
        spec: Mapping[str, Any] = replica.spec or {}
        try:
            driver, url = self._health_target(replica)
            headers = driver.health_headers(spec["engine_key"])
            response = await self._health_http().get(url, headers=headers, timeout=timeout)
        except (httpx.HTTPError, OSError, KeyError, TypeError, ValueError) as exc:
            return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if response.status_code == 200:
            return True, ""
        return False, f"HTTP {response.status_code} from {response.request.url.path}"

    async def _open_without_key(self, replica: Replica) -> str:
        """Why the engine must not serve: it answers without the engine key; "" when it refuses as it should."""
        _, url = self._health_target(replica)
        try:
            response = await self._health_http().get(url, timeout=5.0)
        except httpx.HTTPError as exc:  # it just answered with the key; a hiccup here is no proof either way
            log.warning("%s: could not check that the engine requires its key: %r", replica.name, exc)
            return ""
        if response.status_code in (401, 403):
            return ""
        return f"engine answers {response.request.url.path} without the engine key (HTTP {response.status_code})"

    async def _fail(self, replica: Replica, reason: str) -> None:
        if replica.stopping:
            return
        if processes.alive(replica):
            await processes.terminate(replica, self.stop_timeout)
        elif replica.pid is not None:
            processes.kill_group(replica.pid, signal.SIGKILL)
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
