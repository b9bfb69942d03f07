"""The embedded SQLite control plane under a hundred engines' reports, with a writer holding the lock past the
busy timeout (what a reconciler run placing hundreds of replicas on a starved machine did): no report fails, no
node is marked lost."""

import sqlite3
import threading
import time

import pytest
from django.db import connection, connections
from django.utils import timezone

from cluster import planner, reconciler, reports
from cluster.models import Node, Replica
from tests.factories import make_agent_node, make_model, make_replica, seed_defaults

NODES = 100
THREADS = 6  # the agent streams' database threads (agents.consumers.STREAM_THREADS)
BUSY_TIMEOUT = 0.1  # seconds: shorter than the lock is held below, as a starved machine's long write was
HOLD = 1.0  # seconds the other writer holds the write lock, three times


pytestmark = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's own locks")


@pytest.mark.django_db(transaction=True)
def test_a_hundred_nodes_reports_survive_a_writer_holding_the_lock(monkeypatch) -> None:
    assert connection.settings_dict["NAME"] != ":memory:" and "mode=memory" not in str(connection.settings_dict["NAME"])
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone()[0] == "wal"
    seed_defaults()  # a transactional test before this one on its worker emptied the migrations' rows
    model = make_model("chat", replicas=NODES, memory_bytes=1024**3)
    nodes = [make_agent_node(f"n{i:03}") for i in range(NODES)]
    replicas = {n.pk: make_replica(model, n, Replica.State.READY) for n in nodes}
    # new connections (each thread's) wait this long for a lock before SQLite says "database is locked"
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "timeout", BUSY_TIMEOUT)
    path = connection.settings_dict["NAME"]
    connection.close()

    failures: list[str] = []
    done = threading.Event()

    def sweep(mine: list[Node]) -> None:
        for node in mine:
            status = {"name": replicas[node.pk].name, "state": "ready"}
            try:
                reports.report(node.pk, [status], full=True)  # a report applied whole
                reports.seen(node.pk)  # a heartbeat
            except Exception as exc:
                failures.append(f"{node.name}: {exc!r}")

    def agent_streams(mine: list[Node]) -> None:
        try:
            while not done.is_set():
                sweep(mine)
            sweep(mine)  # once more after the lock's last hold: every node has reported since
        finally:
            connections.close_all()

    def holder() -> None:
        other = sqlite3.connect(path, timeout=30, isolation_level=None)
        try:
            for _ in range(3):
                other.execute("BEGIN IMMEDIATE")
                other.execute("UPDATE cluster_node SET address = address")
                time.sleep(HOLD)
                other.execute("COMMIT")
                time.sleep(0.2)
        finally:
            other.close()

    threads = [threading.Thread(target=agent_streams, args=(nodes[i::THREADS],)) for i in range(THREADS)]
    lock = threading.Thread(target=holder)
    for t in [*threads, lock]:
        t.start()
    lock.join()
    released = timezone.now()
    time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(timeout=60)

    assert failures == []
    now = timezone.now()
    rows = list(Node.objects.all())
    # every node's report and heartbeat went through after the writer let go (however slow a loaded machine is)
    assert all(n.connected and n.last_seen is not None and n.last_seen >= released for n in rows), \
        [n.name for n in rows if n.last_seen is None or n.last_seen < released]
    actions = planner.plan(reconciler.take_snapshot(now))
    assert not [a for a in actions if isinstance(a, (planner.MarkNodeDisconnected, planner.Fail))]
    assert Replica.objects.filter(state=Replica.State.READY).count() == NODES
