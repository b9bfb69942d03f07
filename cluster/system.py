"""System restart: every agent over its stream, then every control-plane process, while the engines keep serving.

1. Each connected agent, one at a time, is sent `restart_agent`; it re-executes itself, adopts its engines
   (they never stop) and connects again. The next agent goes once this one is back.
2. Each control-plane process (cluster.control) is told over Redis to restart, one at a time, each once the one
   before is back: web processes first (with two behind a proxy, one always answers), then beat, then the
   workers, and last the process running the restart, if it is one of them (the worker of the API's task).

Every step writes an Event and is reported as it happens. A step that times out is reported and the restart
goes on with the next: a node whose agent does not come back keeps its engines, and the reconciler treats it
as any silent node.

The process running it holds a lock in Redis that lives LOCK_TTL seconds past its last heartbeat. When that
process dies (a worker killed mid-restart), the lock lapses, and the next reconcile tick in any worker records
`system.restart_interrupted`, saying what was restarted and what was not (`check_interrupted`): each step
restarts a part whole or not at all (an agent re-executes itself, a process restarts itself), so nothing is
left half-restarted, and `llmgw restart` may be run again at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from functools import partial

import redis
from celery import current_app
from django.db import transaction
from django.utils import timezone

from cluster import control, notify
from cluster.errors import Conflict, Unavailable
from cluster.events import record
from cluster.locks import redis_client
from cluster.models import Event, Node

LOCK = "llmgw:system:restart"
QUEUED = "llmgw:system:restart:queued"  # a restart asked for and not yet begun (a worker takes it soon)
QUEUED_TTL = 120  # seconds: a queued restart no worker took (the broker was away) stops blocking the next
RESTART_TASK = "cluster.tasks.restart_system"  # sent by name: the tasks module sits above this one
LOCK_TTL = 30  # seconds the running restart's lock outlives its last heartbeat
HEARTBEAT = 5.0
BEGUN, ENDS = "system.restart", ("system.restarted", "system.restart_interrupted")
AGENT_TIMEOUT = 60.0
PROCESS_TIMEOUT = 90.0


def queue_restart(actor: str, timeout: float | None = None) -> None:
    """Have a worker run the restart (the API's and the dashboard's way: the request returns at once and the
    steps appear as Events). OperationError while one runs or one is queued: a second click queues nothing."""
    r = redis_client()
    if r.exists(LOCK):
        raise Conflict("a system restart is already running; watch it in the events")
    if not r.set(QUEUED, actor, nx=True, ex=QUEUED_TTL):  # the claim: of two at once, one queues
        raise Conflict("a system restart is already queued; watch it in the events")
    try:
        current_app.send_task(RESTART_TASK, args=[actor], kwargs={"timeout": timeout} if timeout else {})
    except Exception as exc:
        r.delete(QUEUED)
        raise Unavailable(f"could not queue the system restart: the broker did not take it ({exc})") from None
    record("system.restart_queued", actor, "system restart queued: a worker runs it; its steps follow as events")


def restart_system(
    actor: str,
    report: Callable[[str], None] = lambda line: None,
    agent_timeout: float = AGENT_TIMEOUT,
    process_timeout: float = PROCESS_TIMEOUT,
    me: str | None = None,
) -> dict:
    """Run the whole restart; `me` is this process's control id when it is a control-plane process itself.
    Returns {"agents": {node: "back"|"timeout"}, "processes": {id: new id|"timeout"|"asked"}}. One at a time:
    OperationError while another runs."""
    lock = redis_client().lock(LOCK, timeout=LOCK_TTL, blocking=False, thread_local=False)
    if not lock.acquire():
        raise Conflict("a system restart is already running; watch it with: llmgw ctl events")
    redis_client().delete(QUEUED)  # begun: a new one may be queued for after it
    alive = _Heartbeat(lock)
    alive.start()
    try:
        return _restart(actor, report, agent_timeout, process_timeout, me)
    finally:
        alive.stop()
        try:
            lock.release()
        except redis.exceptions.LockError:
            pass


class _Heartbeat(threading.Thread):
    """Keeps the running restart's lock alive while this process runs it; when the process dies, the lock lapses
    within LOCK_TTL. A lock Redis lost (restarted empty) is taken again."""

    def __init__(self, lock):
        super().__init__(daemon=True, name="system-restart-heartbeat")
        self.lock, self._ended = lock, threading.Event()

    def run(self) -> None:
        while not self._ended.wait(HEARTBEAT):
            try:
                self.lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                try:
                    redis_client().set(LOCK, self.lock.local.token, nx=True, px=int(LOCK_TTL * 1000))
                except redis.exceptions.RedisError:
                    pass
            except redis.exceptions.RedisError:
                pass  # Redis away for a moment: the next beat

    def stop(self) -> None:
        self._ended.set()
        self.join(HEARTBEAT + 1)


def check_interrupted() -> bool:
    """A restart begun whose process died before it ended (its lock lapsed): record what it did and did not
    restart, once (every worker's reconcile tick asks). True when it recorded that."""
    begun = Event.objects.filter(kind=BEGUN).order_by("-id").first()  # by the kind's index: a few rows
    if begun is None or timezone.now() - begun.created_at < timedelta(seconds=LOCK_TTL):
        return False
    if Event.objects.filter(kind__in=ENDS, id__gt=begun.id).exists() or redis_client().exists(LOCK):
        return False
    with transaction.atomic():
        Event.objects.select_for_update().filter(pk=begun.pk).first()  # two ticks at once: one records it
        if Event.objects.filter(kind__in=ENDS, id__gt=begun.id).exists():
            return False
        steps = list(Event.objects.filter(id__gt=begun.id, kind__in=(
            "agent.restarted", "agent.restart_timeout", "process.restart", "process.restarted",
            "process.restart_timeout")).values_list("kind", "subject"))
        agents_done = [s for k, s in steps if k == "agent.restarted"]
        agents_left = [n for n in (begun.data or {}).get("agents", []) if n not in {s for k, s in steps
                                                                                   if k.startswith("agent.")}]
        asked = [s for k, s in steps if k == "process.restart"]
        back = {s for k, s in steps if k in ("process.restarted", "process.restart_timeout")}
        done = [f"agent {n}" for n in agents_done] + [f"process {p}" for p in asked if p in back]
        left = [f"agent {n}" for n in agents_left] + [f"process {p} (asked, not seen back)" for p in asked
                                                      if p not in back]
        if not asked:
            left.append("every control-plane process")
        message = (f"system restart cut short: the process running it stopped. Restarted: {', '.join(done) or 'none'}; "
                   f"not restarted: {', '.join(left)}. Nothing is half-restarted; run `llmgw restart` again")
        record("system.restart_interrupted", "system", message[:1000], done=done, not_done=left)
    return True


def _restart(actor, report, agent_timeout, process_timeout, me) -> dict:
    agents = list(Node.objects.filter(connected=True).order_by("name").values_list("name", flat=True))
    record(BEGUN, actor, "system restart: agents, then control-plane processes; engines keep serving", agents=agents)
    result: dict = {"agents": {}, "processes": {}}
    for line in _restart_agents(actor, agent_timeout, result["agents"]):
        report(line)
    for line in _restart_processes(actor, process_timeout, result["processes"], me):
        report(line)
    failed = [k for k, v in {**result["agents"], **result["processes"]}.items() if v == "timeout"]
    summary = "system restart done" if not failed else f"system restart done; did not come back: {', '.join(failed)}"
    record("system.restarted", actor, summary, failed=failed)
    report(summary)
    return result


def _restart_agents(actor: str, timeout: float, outcome: dict) -> Iterator[str]:
    nodes = list(Node.objects.filter(connected=True).order_by("name"))
    if not nodes:
        record("system.restart_step", actor, "agents: none connected")
        yield "agents: none connected"
    for node in nodes:
        since = timezone.now()
        record("agent.restart", actor, f"agent of node {node.name} asked to restart; its engines keep serving", subject=node.name)
        notify.restart_agent(node.pk)
        yield f"agent {node.name}: asked to restart"
        started = time.monotonic()
        back = _wait(partial(_connected_since, node.name, since), timeout)
        if back:
            outcome[node.name] = "back"
            record("agent.restarted", actor, f"agent {node.name}: back after {time.monotonic() - started:.1f}s",
                   subject=node.name)
            yield f"agent {node.name}: back after {time.monotonic() - started:.1f}s"
        else:
            outcome[node.name] = "timeout"
            record("agent.restart_timeout", actor, f"agent of node {node.name} did not reconnect within {timeout:.0f}s",
                   subject=node.name)
            yield f"agent {node.name}: did not reconnect within {timeout:.0f}s; going on"


def _restart_processes(actor: str, timeout: float, outcome: dict, me: str | None) -> Iterator[str]:
    procs = control.processes()
    order = {"web": 0, "beat": 1, "worker": 2}
    procs.sort(key=lambda p: (p.id == me, order.get(p.role, 9), p.host, p.started))
    if not procs:
        line = "control plane: no process registered (are web, worker and beat running with LLMGW_CONTROL on?)"
        record("system.restart_step", actor, line)
        yield line
    for proc in procs:
        if proc.id == me:  # last: its successor says it is back (cluster.system.successor_started)
            control.expect_successor(proc, {"actor": actor})
        record("process.restart", actor, f"{proc.role} process {proc.id} asked to restart", subject=proc.id,
               successor=proc.id == me)
        control.request_restart(proc)
        if proc.id == me:
            outcome[proc.id] = "asked"
            yield f"{proc.role} {proc.id}: asked to restart (this process; it finishes this task first)"
            return
        yield f"{proc.role} {proc.id}: asked to restart"
        started = time.monotonic()
        new = control.wait_replaced(proc, timeout)
        if new is None:
            outcome[proc.id] = "timeout"
            record("process.restart_timeout", actor, f"{proc.id} was not back within {timeout:.0f}s", subject=proc.id)
            yield f"{proc.role} {proc.id}: not back within {timeout:.0f}s (is it supervised?); going on"
        else:
            outcome[proc.id] = new.id
            line = f"{proc.role} {proc.id}: back as {new.id} after {time.monotonic() - started:.1f}s"
            record("process.restarted", actor, line, subject=proc.id)
            yield line


def successor_started(new_id: str, note: dict) -> None:
    """In a control-plane process that took the place of the one a system restart asked last (the worker that
    ran it): that it is back, as the restart says of every other process."""
    role = new_id.split("@", 1)[0]
    took = time.time() - float(note.get("asked", time.time()))
    record("process.restarted", str(note.get("actor", "system")), f"{role} {note['id']}: back as {new_id} after "
           f"{took:.1f}s", subject=str(note["id"]))


def _connected_since(name: str, since: datetime) -> bool:
    return Event.objects.filter(kind="node.connected", subject=name, created_at__gt=since).exists()


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return False
