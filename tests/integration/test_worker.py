"""The control plane's processes and their servers: the Celery worker under a broker that goes away (a real
worker and beat, `start_system`, on a Valkey of the test's own, which it restarts); a web process's pool of
PostgreSQL connections."""

from __future__ import annotations

import re
import time

import psutil
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from llmgw.valkey import EmbeddedValkey
from tests.integration.harness import start_system, wait_for

pytestmark = pytest.mark.integration


def test_a_worker_holding_messages_it_has_not_acknowledged_survives_redis_restarting(tmp_path, postgresql_server):
    # PostgreSQL (the run's, or its own server) holds the worker's one task up (the Event table locked); beat's next
    # ticks wait, delivered to the worker and not yet acknowledged, when Redis restarts empty. Celery 5.7.0 alone exits here
    # ("Unrecoverable error: AttributeError"; llmgw.worker.Consumer says why).
    valkey = EmbeddedValkey(tmp_path / "valkey")
    system = start_system(tmp_path / "home", redis_url=valkey.start(), database_url=postgresql_server)
    worker = system.procs["worker"]

    def log() -> str:
        return worker.log_path.read_text(errors="replace")

    try:
        wait_for(lambda: " ready." in log(), 60, what="the worker to be ready")
        with psycopg.connect(system.env["DATABASE_URL"]) as held, \
                psycopg.connect(system.env["DATABASE_URL"], autocommit=True) as looking:
            received = log().count("] received")
            held.execute("LOCK TABLE cluster_event IN ACCESS EXCLUSIVE MODE")

            def held_up() -> bool:  # the tick under way waits for the lock; the next ones wait behind it
                waiting = looking.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
                return waiting.fetchone()[0] > 0 and log().count("] received") >= received + 3

            wait_for(held_up, 60, what="a tick waiting for the lock and two more delivered behind it")
            valkey.stop()
            valkey.start()
            wait_for(lambda: "Connection to broker lost" in log(), 30, what="the worker to see Redis go")
        mark = log().count("Connected to redis")
        wait_for(lambda: not worker.alive() or log().count("Connected to redis") > mark, 30,
                 what="the worker to connect again")
        assert worker.alive(), worker.tail(60)
        ticks = len(re.findall(r"reconcile_tick\[\S+\] succeeded", log()))
        wait_for(lambda: len(re.findall(r"reconcile_tick\[\S+\] succeeded", log())) > ticks + 2, 30,
                 what="beat's ticks to run again")
        assert worker.alive() and "Unrecoverable error" not in log(), worker.tail(60)
    finally:
        system.stop()
        valkey.stop()


def test_a_web_process_on_postgresql_keeps_its_connections_in_a_pool(tmp_path, postgresql_server):
    # Every agent's report is a few queries run through database_sync_to_async, which gives the connection back
    # after each: a web process without its pool opened a PostgreSQL connection for each of them (bench/fleet.py).
    # With the pool, the connections stay open between requests.
    system = start_system(tmp_path / "home", database_url=postgresql_server)
    try:
        web = psutil.Process(system.procs["web"].pid)
        port = int(conninfo_to_dict(system.env["DATABASE_URL"]).get("port") or 5432)

        def connected() -> int:
            return sum(1 for c in web.net_connections(kind="tcp")
                       if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)

        for _ in range(3):  # requests that read the database, each on a connection of the web process's
            assert system.api("GET", "/api/v1/nodes/").status_code == 200
        wait_for(lambda: connected() >= 1, 10, what="a connection held by the web process's pool")
        time.sleep(1.5)
        assert connected() >= 1
    finally:
        system.stop()
