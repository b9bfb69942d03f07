"""System restart: control-plane processes restart when told over Redis; the CLI and API front doors."""

import io
import os
import socket
import subprocess
import sys
import time

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from cluster import control, system
from cluster.errors import OperationError
from cluster.locks import redis_client
from cluster.models import Event
from tests.factories import client_for, make_node
from tests.rest import API, refused

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROCESS = """
import django, os, time
django.setup()
from cluster import control
control.start("worker")
print("registered", flush=True)
time.sleep(120)
"""


def cli(*args) -> str:
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def registered():
    """A real process that registers as a worker and obeys restart requests (its SIGTERM ends it)."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="llmgw.settings", REDIS_URL=settings.REDIS_URL, LLMGW_CONTROL="1")
    proc = subprocess.Popen([sys.executable, "-c", PROCESS], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "registered"
    deadline = time.monotonic() + 10
    while not [p for p in control.processes() if p.pid == proc.pid]:
        assert time.monotonic() < deadline, "the process did not register"
        time.sleep(0.1)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.integration
def test_a_process_registers_and_restarts_when_told(registered):
    (entry,) = [p for p in control.processes() if p.pid == registered.pid]
    assert (entry.role, entry.id) == ("worker", f"worker@{entry.host}:{registered.pid}")
    control.request_restart(entry)
    assert registered.wait(10) == -15  # it stopped itself with SIGTERM, for its supervisor to start again
    assert not [p for p in control.processes() if p.pid == registered.pid]


def test_entries_of_dead_processes_are_dropped():
    r = redis_client()
    r.hset(control.PROCS, "web@gone:1", '{"role": "web", "host": "gone", "pid": 1, "started": 0, "seen": 0}')
    r.hset(control.PROCS, "web@bad:2", "not json")
    assert control.processes() == []
    assert r.hlen(control.PROCS) == 0


@pytest.mark.integration
def test_restart_asks_each_process_and_waits_for_it(db, registered):
    """Nothing supervises the test's process, so it does not come back: the step times out, the restart goes on
    and says so; the Events tell the same (what `llmgw restart` prints; tests/integration run it whole)."""
    result = system.restart_system("test", agent_timeout=2, process_timeout=2)
    assert registered.wait(10) == -15
    assert list(result["processes"].values()) == ["timeout"]
    kinds = list(Event.objects.order_by("pk").values_list("kind", flat=True))
    assert kinds == ["system.restart", "system.restart_step", "process.restart", "process.restart_timeout",
                     "system.restarted"]
    assert Event.objects.get(kind="system.restarted").data == {"failed": [f"worker@{socket.gethostname()}:"
                                                                          f"{registered.pid}"]}


def test_restart_with_nothing_running_says_so(db):
    said = []
    system.restart_system("test", said.append, agent_timeout=1, process_timeout=1)
    assert "agents: none connected" in said
    assert any(line.startswith("control plane: no process registered") for line in said)
    assert said[-1] == "system restart done"
    steps = Event.objects.filter(kind="system.restart_step").values_list("message", flat=True)
    assert set(said[:2]) == set(steps)


def test_the_cli_says_when_no_worker_takes_the_restart(db, monkeypatch):
    """`llmgw restart` queues it for a worker and prints its steps as they happen; with no worker, it gives up
    waiting in one line (the restart stays queued until one takes it or the claim lapses)."""
    from llmgw.cli import system as cli_system

    monkeypatch.setattr(cli_system, "TAKEN_WITHIN", 1.0)
    with pytest.raises(CommandError, match="no worker began the queued restart"):
        cli("restart", "--timeout", "5")
    assert Event.objects.filter(kind="system.restart_queued", actor="cli").count() == 1


def test_an_agent_that_does_not_come_back_is_reported(db):
    node = make_node("gpu-1", connected=True)
    assert system.restart_system("test", agent_timeout=0.5, process_timeout=0.5)["agents"] == {"gpu-1": "timeout"}
    assert Event.objects.filter(kind="agent.restart", subject=node.name).exists()
    assert Event.objects.filter(kind="agent.restart_timeout", subject=node.name).exists()


def test_one_restart_at_a_time(db):
    operator = client_for("operator")
    events = Event.objects.count()
    lock = redis_client().lock(system.LOCK, timeout=60)
    assert lock.acquire()
    try:
        with pytest.raises(CommandError, match="already running"):
            cli("restart")
        refused(operator.post(f"{API}/system/restart/"), 409, "already running")
    finally:
        lock.release()
    assert Event.objects.count() == events


def test_the_api_queues_the_restart_for_a_worker(db):
    response = client_for("operator").post(f"{API}/system/restart/")
    assert response.status_code == 202, response.content
    assert response.json() == {"queued": True, "watch": "/api/v1/events/"}
    assert Event.objects.filter(kind="system.restart_queued").count() == 1


def test_a_double_click_queues_one_restart(db):
    operator = client_for("operator")
    assert operator.post(f"{API}/system/restart/").status_code == 202
    refused(operator.post(f"{API}/system/restart/"), 409, "already queued")
    with pytest.raises(OperationError, match="already queued"):
        system.queue_restart("user:other")
    assert redis_client().llen("celery") == 1  # one task message for the workers
    assert Event.objects.filter(kind="system.restart_queued").count() == 1
    # once a worker begins it, the next may be queued
    system.restart_system("test", agent_timeout=0.1, process_timeout=0.1)
    assert operator.post(f"{API}/system/restart/").status_code == 202


def test_a_broker_that_takes_no_task_is_a_503_and_leaves_no_claim(db, monkeypatch):
    from celery import current_app
    from kombu.exceptions import OperationalError

    def broker_away(*args, **kwargs):  # what kombu raises when it cannot reach the broker
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(current_app, "send_task", broker_away)
    refused(client_for("operator").post(f"{API}/system/restart/"), 503, "the broker did not take it")
    assert not redis_client().exists(system.QUEUED)  # the next click may queue it
    assert not Event.objects.filter(kind="system.restart_queued").exists()


def test_a_viewer_may_not_restart_the_system(db):
    refused(client_for("viewer").post(f"{API}/system/restart/"), 403)
    refused(client_for(None).post(f"{API}/system/restart/"), 401)


def test_the_process_that_ran_the_restart_is_said_to_be_back_by_its_successor(db):
    """The worker running a restart is asked last and cannot wait for itself: the next worker to register on its
    host records that it is back, as the restart does for every other process (what `llmgw restart` waits for)."""
    host = socket.gethostname()
    me = control.Process(f"worker@{host}:41", "worker", host, 41, time.time(), time.time())
    control.expect_successor(me, {"actor": "user:ann"})
    r = redis_client()
    control._succeed(r, "web", f"web@{host}:43", system.successor_started)  # another role: not its successor
    assert not Event.objects.filter(kind="process.restarted").exists()
    control._succeed(r, "worker", f"worker@{host}:42", system.successor_started)
    (back,) = Event.objects.filter(kind="process.restarted")
    assert (back.actor, back.subject) == ("user:ann", me.id)
    assert back.message.startswith(f"worker {me.id}: back as worker@{host}:42 after ")
    control._succeed(r, "worker", f"worker@{host}:44", system.successor_started)  # once
    assert Event.objects.filter(kind="process.restarted").count() == 1


def test_a_restart_whose_process_died_is_said_to_be_cut_short_once_its_lock_lapses(db):
    """A worker killed mid-restart holds nothing for long: its lock lapses LOCK_TTL after its last heartbeat, and
    the next reconcile tick records what was restarted and what was not; a new restart may be queued at once."""
    from datetime import timedelta

    from django.utils import timezone

    from cluster.events import record
    from cluster.tasks import reconcile_tick

    begun = record(system.BEGUN, "user:ops", "system restart: …", agents=["gpu-1", "gpu-2", "gpu-3"])
    record("agent.restart", "user:ops", "asked", subject="gpu-1")
    record("agent.restarted", "user:ops", "agent gpu-1: back after 2.0s", subject="gpu-1")
    record("agent.restart", "user:ops", "asked", subject="gpu-2")  # and then the worker was killed
    lock = redis_client().lock(system.LOCK, timeout=60)
    assert lock.acquire()
    try:
        assert not system.check_interrupted()  # just begun
        Event.objects.filter(pk=begun.pk).update(created_at=timezone.now() - timedelta(seconds=system.LOCK_TTL + 1))
        assert not system.check_interrupted()  # its process is alive: the lock is kept
    finally:
        lock.release()
    reconcile_tick()
    [cut] = Event.objects.filter(kind="system.restart_interrupted")
    assert cut.data == {"done": ["agent gpu-1"], "not_done": ["agent gpu-2", "agent gpu-3",
                                                              "every control-plane process"]}
    assert "run `llmgw restart` again" in cut.message
    assert not system.check_interrupted()  # said once
    response = client_for("operator").post(f"{API}/system/restart/")
    assert response.status_code == 202, response.content
    redis_client().delete(system.QUEUED)


def test_a_running_restart_keeps_its_lock_alive_and_takes_it_again_when_redis_lost_it(db, monkeypatch):
    monkeypatch.setattr(system, "HEARTBEAT", 0.05)
    monkeypatch.setattr(system, "LOCK_TTL", 0.3)
    lock = redis_client().lock(system.LOCK, timeout=0.3, thread_local=False)
    assert lock.acquire()
    alive = system._Heartbeat(lock)
    alive.start()
    try:
        time.sleep(0.6)  # twice the TTL: kept
        assert redis_client().exists(system.LOCK)
        redis_client().delete(system.LOCK)  # Redis restarted empty
        deadline = time.monotonic() + 5
        while redis_client().get(system.LOCK) != lock.local.token and time.monotonic() < deadline:
            time.sleep(0.02)
        assert redis_client().get(system.LOCK) == lock.local.token  # taken again
    finally:
        alive.stop()
        lock.release()
