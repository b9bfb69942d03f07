"""One engine process: started in its own session, checked for exit, stopped with its whole process group."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import signal
import subprocess
import time
from pathlib import Path
from typing import TypedDict

import psutil

from agents.agent.records import EngineRecord
from agents.agent.replicas import Replica, ReplicaFailed, write_json
from ground.engines import driver_for, engine_host
from ground.ports import port_free
from ground.protocol import DesiredReplica

log = logging.getLogger("llmgw.agent")

ENGINE_USER = "llmgw-engine"  # when the agent runs as root, engines run as this user if it exists
SECRET_ENV = ("LLMGW_TOKEN", "LLMGW_AGENT_TOKEN")  # the agent's own secrets never reach an engine


def exit_reason(code: int | None) -> str:
    if code is None:
        return "engine exited (its exit code is unknown: it was started by an earlier agent)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine was killed by {name}"
    return f"engine exited with code {code}"


def start(
    replica: Replica, spec: DesiredReplica, model_path: str, state_dir: Path, log_path: Path, record_path: Path
) -> None:
    """Spawns the replica's engine (as `spec` says), its output appended to log_path, and records it for a later
    agent to adopt."""
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
    extra = _engine_user(state_dir, env, model_path)
    shown = " ".join(a.replace(spec["engine_key"], "***") for a in argv)
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
    record: EngineRecord = {
        "name": replica.name,
        "pid": popen.pid,
        "create_time": create_time,
        "port": port,
        "sha256": (spec.get("file") or {}).get("sha256", ""),
        "argv": argv,
        "started_at": time.time(),
        "spec": spec,
    }
    write_json(record_path, record)
    log.info("%s: started %s", replica.name, shown)


class RunAs(TypedDict, total=False):
    """Popen's arguments that run a process as another user."""

    user: int
    group: int
    extra_groups: list[int]


def _engine_user(state_dir: Path, env: dict[str, str], model_path: str) -> RunAs:
    """Popen arguments to run the engine as ENGINE_USER when the agent is root and that user exists."""
    if os.geteuid() != 0:
        return {}
    try:
        user = pwd.getpwnam(ENGINE_USER)
    except KeyError:
        return {}
    # It reads the cached model through the state directory, which it may traverse but not list.
    os.chmod(state_dir, os.stat(state_dir).st_mode | 0o001)
    if model_path and os.path.exists(model_path):
        os.chmod(model_path, os.stat(model_path).st_mode | 0o044)
    env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def exited(replica: Replica) -> tuple[bool, int | None]:
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


def alive(replica: Replica) -> bool:
    return (replica.popen is not None or replica.process is not None) and not exited(replica)[0]


async def terminate(replica: Replica, stop_timeout: float) -> None:
    """SIGTERM to the engine's process group, SIGKILL after stop_timeout (llama.cpp can hang on SIGTERM)."""
    if replica.pid is None or not alive(replica):
        kill_group(replica.pid, signal.SIGKILL)  # stragglers of a leader that already exited
        return
    pid = replica.pid
    kill_group(pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + stop_timeout
    while alive(replica) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if alive(replica):
        log.warning("%s: engine pid %s still runs %gs after SIGTERM; sending SIGKILL", replica.name, pid, stop_timeout)
        kill_group(pid, signal.SIGKILL)
        deadline = loop.time() + 10.0
        while alive(replica) and loop.time() < deadline:
            await asyncio.sleep(0.05)
    kill_group(pid, signal.SIGKILL)


def kill_group(pid: int | None, sig: signal.Signals) -> None:
    if pid is None:
        return
    # Each engine leads its own session and group; its pid is not reused while the group has members.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
