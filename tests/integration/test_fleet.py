"""The fault matrix: a fleet across network namespaces with two control planes (tests/integration/fleet.py).

Each scenario runs with requests in flight throughout (`Load`) and the invariants watched (`Watch`), and adds a
row to the report printed at the end (`pytest -s`): requests served and failed, duplicates, orphans, and the time
to recover.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

from tests.integration import netns
from tests.integration.fleet import (
    FINISHES,
    GRACE,
    MODEL,
    TOLERANCE,
    Load,
    Seen,
    Watch,
    start_fleet,
    stop_fleet,
    stream_through_sdk,
)
from tests.integration.harness import add_test_engine, holds_for, make_model_file, wait_for

pytestmark = pytest.mark.integration

REPORT: list[tuple] = []


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    why = netns.unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the fleet tests: {why}")
        pytest.skip(why)
    started = start_fleet(tmp_path_factory.mktemp("fleet"))
    try:
        yield started
    finally:
        print(report())
        stop_fleet(started, started.net, started.system, started.postgres, started.valkey, started.standby)


def report() -> str:
    lines = ["", "| scenario | served | failed | invariants broken | orphans | recovered in |", "|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(str(c) for c in row)} |" for row in REPORT]
    return "\n".join(lines)


@pytest.fixture
def scenario(fleet, request):
    """The fleet steady (every host's agent connected, the model's replicas ready), load on, invariants watched."""
    def steady():
        rows = [r for r in fleet.replicas() if r["state"] not in ("failed", "stopped")]
        return len(rows) == 2 and all(r["state"] == "ready" for r in rows)

    wait_for(steady, 120, what=f"two ready replicas of {MODEL} and no other: {fleet.replicas()}")
    fleet.system.wait_nodes_connected(list(fleet.hosts), timeout=60)
    load, watch = Load(fleet.nginx, fleet.key), Watch(fleet)
    outcome = {"recovered": "-", "orphans": 0}
    try:
        yield load, watch, outcome
    finally:
        load.stop()
        broken = watch.stop()
        served, failed = load.since((0, 0))
        REPORT.append((request.node.name.removeprefix("test_"), served, len(failed), len(broken), outcome["orphans"],
                       outcome["recovered"]))
        for host in fleet.hosts.values():
            host.heal()
        for relay in fleet.relays.values():
            relay.delay = 0.0
    assert not broken, broken
    assert not failed, failed[:5]


def host_with_a_replica(fleet) -> tuple[str, list[str]]:
    ready = fleet.ready()
    node = ready[0]["node"]
    return node, sorted(r["name"] for r in ready if r["node"] == node)


def no_orphans_within(fleet, seconds: float) -> float:
    started = time.monotonic()
    wait_for(lambda: not fleet.orphans(), seconds, what=f"no engine without a live replica row: {fleet.orphans()}")
    return time.monotonic() - started


def pids_of(system) -> dict[str, int]:
    return {name: proc.popen.pid for name, proc in system.procs.items() if proc.alive()}


def assert_none_restarted(system, pids: dict[str, int]) -> None:
    now = pids_of(system)
    gone = [name for name in pids if now.get(name) != pids[name]]
    assert not gone, "\n".join(f"--- {name} (exit {system.procs[name].returncode})\n{system.procs[name].tail(80)}"
                                for name in gone)


def a_replica_placed_and_removed(fleet, after: str) -> float:
    """The reconciler acts: the model to three replicas, the third ready, and back to two."""
    system = fleet.system
    wait_for(lambda: system.cli("ctl", "model", "set", MODEL, "--replicas", "3", check=False).returncode == 0, 60,
             what=f"the CLI to change the model after {after}")
    wait_for(lambda: len(fleet.ready()) == 3, 90, what=f"a third replica ready after {after}")
    placed = time.monotonic()
    system.cli("ctl", "model", "set", MODEL, "--replicas", "2")
    wait_for(lambda: len(fleet.ready()) == 2, 60, what="back to two")
    return placed


def test_a_node_cut_off_shorter_than_the_tolerance_moves_nothing(fleet, scenario):
    load, watch, outcome = scenario
    node, replicas = host_with_a_replica(fleet)
    before_rows, before_engines = fleet.replicas(), fleet.engines()
    fleet.hosts[node].cut()
    time.sleep(TOLERANCE / 2)
    fleet.hosts[node].heal()
    holds_for(lambda: fleet.replicas() == before_rows and fleet.engines() == before_engines, TOLERANCE + GRACE + 4,
              what="the same replicas and the same engine processes")


def test_a_node_cut_off_past_the_grace_is_replaced_and_its_stale_engine_stops_after(fleet, scenario):
    load, watch, outcome = scenario
    node, replicas = host_with_a_replica(fleet)
    host = fleet.hosts[node]
    cut_at = time.monotonic()
    host.cut()
    wait_for(lambda: len([r for r in fleet.ready() if r["node"] != node]) == 2, 90,
             what="two ready replicas on the other nodes")
    outcome["recovered"] = f"{time.monotonic() - cut_at:.1f} s (replaced)"
    stale = [name for name, found in fleet.engines().items() if any(h == node for h, _ in found)]
    assert set(replicas) <= set(stale)  # still running over there, cut off
    host.heal()
    took = no_orphans_within(fleet, 60)
    outcome["recovered"] += f", stale engine stopped {took:.1f} s after the heal"
    assert not set(replicas) & set(fleet.engines())


def test_a_lossy_slow_link_replaces_nothing_and_fails_nothing(fleet, scenario):
    load, watch, outcome = scenario
    node, replicas = host_with_a_replica(fleet)
    before = fleet.replicas()
    fleet.relays[node].delay = 0.2
    fleet.hosts[node].lossy(30)
    since = fleet.api("/api/v1/events/", limit=1)["results"][0]["id"]

    def unchanged() -> bool:
        if fleet.replicas() == before:
            return True
        said = fleet.api("/api/v1/events/", after=since, limit=100)["results"]
        print(f"replicas were {before}, now {fleet.replicas()}; since the loss began:",
              *(f"{e['created_at']} {e['kind']} {e['message']}" for e in said), sep="\n  ")
        return False

    holds_for(unchanged, 60, interval=1.0, what="no replica replaced (the replicas and Events: printed above)")
    fleet.hosts[node].heal()
    fleet.relays[node].delay = 0.0
    fleet.system.wait_nodes_connected([node], timeout=60)


def test_a_control_plane_killed_the_agents_the_gateway_and_a_rollout_go_on_through_the_other(fleet, scenario):
    """Killed while a rollout of a new model file watches its canary (beside the model's two replicas, half of the
    new conversations): the other control plane's beat and worker carry the rollout on from the database, promote
    it and replace both replicas one at a time."""
    load, watch, outcome = scenario
    system = fleet.system
    next_sha = make_model_file(system, "fleet-next.bin")
    # a model file uploaded through A alone; B's worker pulls it (cluster/mirror/sync.py) before A is lost
    uploaded = system.api("POST", "/api/v1/model-files/", files={"file": ("pulled.bin", os.urandom(3 * 1024 * 1024))})
    assert uploaded.status_code == 201, uploaded.text
    sha = uploaded.json()["sha256"]
    wait_for(lambda: all(len(fleet.api(f"/api/v1/model-files/{f}/")["locations"]) == 2 for f in (sha, next_sha)),
             60, what="control plane B holding the files uploaded through A")
    system.cli("ctl", "rollout", "start", MODEL, "--file", next_sha, "--traffic", "50%", "--watch", "5s",
               "--min-requests", "10")
    wait_for(lambda: fleet.api(f"/api/v1/models/{MODEL}/rollout/")["watching_since"], 60,
             what="the canary ready and watched")
    last_event = fleet.api("/api/v1/events/", limit=1)["results"][0]["id"]
    killed_at = time.monotonic()
    fleet.kill_control_plane("a")
    assert fleet.api(f"/api/v1/models/{MODEL}/rollout/")["state"] == "watching"  # mid-way
    shutil.rmtree(system.home / "mirror")  # its disk gone with it

    def reconnected():
        events = fleet.api("/api/v1/events/", kind_prefix="node.connected", after=last_event, limit=100)["results"]
        return {e["subject"] for e in events} >= set(fleet.hosts)

    wait_for(reconnected, 60, what="every agent connected to control plane B")
    outcome["recovered"] = f"agents on B {time.monotonic() - killed_at:.1f} s after the kill"
    # a replica of a model on that file starts: its agent downloads the file from B
    system.cli("ctl", "model", "add", "pulled", "--file", sha, "--engine", "testengine", "--replicas", "1",
               "--memory", "300MiB")
    def pulled_ready() -> bool:
        if len(fleet.ready("pulled")) == 1:
            return True
        said = fleet.api("/api/v1/events/", after=last_event, limit=200)["results"]
        print(f"{time.monotonic() - killed_at:.1f} s: {fleet.replicas('pulled')}",
              *(f"{e['created_at']} {e['kind']} {e['message']}" for e in said if "pulled" in e["message"]
                or e["kind"].startswith(("file.", "control_plane."))), sep="\n  ")
        return False

    wait_for(pulled_ready, 90, interval=2.0, what="a replica of the model on the file A held (printed above)")
    outcome["recovered"] += f"; a replica on A's file ready {time.monotonic() - killed_at:.1f} s after"
    # meanwhile B judged the rollout, promoted it and replaced the model's replicas
    done = wait_for(lambda: (r := fleet.api(f"/api/v1/models/{MODEL}/rollout/"))["state"] == "promoted" and r, 120,
                    what=f"the rollout promoted by B: {fleet.api(f'/api/v1/models/{MODEL}/rollout/')}")
    outcome["recovered"] += f"; the rollout promoted {time.monotonic() - killed_at:.1f} s after"
    assert done["figures"]["canary"]["requests"] >= 10 and not done["figures"]["canary"]["errors"], done
    assert fleet.api(f"/api/v1/models/{MODEL}/")["file"]["sha256"] == next_sha
    system.cli("ctl", "model", "remove", "pulled")
    wait_for(lambda: not [r for r in fleet.replicas("pulled") if r["state"] not in ("stopped", "failed")], 60,
             what="the model on A's file removed")
    # the reconciler still acts (B's beat and worker): a third replica, and back to two
    system.cli("ctl", "model", "set", MODEL, "--replicas", "3")
    wait_for(lambda: len(fleet.ready()) == 3, 60, what="a third replica ready, placed by B's reconciler")
    system.cli("ctl", "model", "set", MODEL, "--replicas", "2")
    wait_for(lambda: len(fleet.ready()) == 2 and len([r for r in fleet.replicas() if r["state"] != "stopped"
                                                       and r["state"] != "failed"]) == 2, 60, what="back to two")

    fleet.start_control_plane("a")
    wait_for(lambda: (system.home / "mirror" / sha).exists(), 60, what="A pulling back the file its disk lost")
    web_log = system.home / "logs" / "web.log"
    served_before = web_log.read_text().count("llmgw.access")
    wait_for(lambda: web_log.read_text().count("llmgw.access") > served_before + 5, 30,
             what="nginx sending requests to control plane A again")


def test_an_agent_host_that_reboots_has_its_replicas_failed_and_replaced_once(fleet, scenario):
    load, watch, outcome = scenario
    node, replicas = host_with_a_replica(fleet)
    fleet.hosts[node].kill_all()  # the agent and its engines, at once
    rebooted_at = time.monotonic()
    fleet.start_agent(node)

    def replaced():
        rows = {r["name"]: r for r in fleet.replicas()}
        return all(rows[name]["state"] == "failed" for name in replicas) and len(fleet.ready()) == 2

    wait_for(replaced, 90, what="the host's replicas failed and the model back to two ready")
    outcome["recovered"] = f"{time.monotonic() - rebooted_at:.1f} s"
    rows = fleet.replicas()
    assert len([r for r in rows if r["state"] in ("pending", "downloading", "starting", "ready")]) == 2
    outcome["orphans"] = len(fleet.orphans())
    assert not fleet.orphans()


def test_postgresql_and_redis_restarted_under_load_need_no_restart_of_llmgw(fleet, scenario):
    load, watch, outcome = scenario
    system = fleet.system
    pids = pids_of(system)
    started = time.monotonic()
    fleet.postgres.stop("fast")
    time.sleep(1)
    fleet.postgres.start()
    fleet.valkey.restart_primary()  # empty: no persistence
    placed = a_replica_placed_and_removed(fleet, "PostgreSQL and Redis restarted")
    outcome["recovered"] = f"{placed - started:.1f} s (reconciler placed a replica)"
    assert_none_restarted(system, pids)


def test_the_redis_primary_killed_its_replica_is_promoted_and_llmgw_follows(fleet, scenario):
    """Valkey behind three Sentinels (LLMGW_REDIS_SENTINELS): its primary SIGKILLed under load, the Sentinels
    promote the replica, and every llmgw process goes on with no restart — the gateways (their counts and
    queues), the channel layer (the agents' streams), Celery's broker (the reconciler places a replica after)."""
    load, watch, outcome = scenario
    system = fleet.system
    pids = pids_of(system)
    mark = load.mark()
    killed = fleet.valkey.primary
    took = fleet.valkey.kill_primary()
    time.sleep(3)  # requests go on through the failover and after it
    served, failed = load.since(mark)
    a_replica_placed_and_removed(fleet, "the failover")
    outcome["recovered"] = f"promoted in {took:.1f} s; {served} served, {len(failed)} failed meanwhile"
    system.wait_nodes_connected(list(fleet.hosts), timeout=60)
    assert_none_restarted(system, pids)
    fleet.valkey.revive(killed)  # the set whole again: a primary and a replica


def test_the_postgresql_primary_lost_its_standby_is_promoted_and_llmgw_follows(fleet, scenario):
    """The primary stopped `immediate` (its machine gone) under load, the standby promoted (`pg_ctl promote`):
    every llmgw process finds it through DATABASE_URL's host list (target_session_attrs=read-write) with no
    restart, nothing is done twice (the invariants), and the reconciler acts again within seconds."""
    load, watch, outcome = scenario
    system = fleet.system
    pids = pids_of(system)
    before = fleet.rows("SELECT count(*) FROM cluster_event")[0][0]
    lost, standby = fleet.postgres, fleet.standby
    lost.stop("immediate")
    began = time.monotonic()
    standby.promote()
    fleet.postgres, fleet.standby = standby, lost
    placed = a_replica_placed_and_removed(fleet, "the promotion")
    outcome["recovered"] = f"{placed - began:.1f} s (reconciler placed a replica)"
    assert fleet.rows("SELECT count(*) FROM cluster_event")[0][0] > before  # the promoted primary took writes
    system.wait_nodes_connected(list(fleet.hosts), timeout=60)
    assert_none_restarted(system, pids)
    lost.rebuild_as_standby_of(standby)  # the pair whole again: the lost machine back as the standby


def test_a_worker_killed_in_the_middle_of_a_system_restart(fleet, scenario):
    """The restart says what it did not do once the worker running it is gone, holds nothing, and runs again to
    the end. Every control-plane process is supervised from here on, as systemd would."""
    load, watch, outcome = scenario
    system = fleet.system
    system.supervise(*fleet.control_plane("a"), *fleet.control_plane("b"))
    last = fleet.api("/api/v1/events/", limit=1)["results"][0]["id"]
    assert system.api("POST", "/api/v1/system/restart/").status_code == 202

    def steps(kind: str) -> list[dict]:
        return fleet.api("/api/v1/events/", kind_prefix=kind, after=last, limit=100)["results"]

    wait_for(lambda: steps("agent.restarted"), 60, what="the first agent restarted")
    logs = system.home / "logs"
    [running] = [name for name in ("worker", "worker-b") if "restart_system[" in (logs / f"{name}.log").read_text()]
    killed_at = time.monotonic()
    os.killpg(system.procs[running].popen.pid, signal.SIGKILL)
    [cut] = wait_for(lambda: steps("system.restart_interrupted"), 90, what="the restart said to be cut short")
    outcome["recovered"] = f"cut short said {time.monotonic() - killed_at:.1f} s after the kill"
    assert cut["data"]["done"] and any(step.startswith("agent ") for step in cut["data"]["done"])
    assert "every control-plane process" in cut["data"]["not_done"]
    assert not steps("system.restarted")

    # nothing half-restarted: every agent is connected; and the restart runs again, to the end
    system.wait_nodes_connected(list(fleet.hosts), timeout=60)
    done = system.cli("restart", "--timeout", "60")
    assert "system restart done" in done.stdout, done.stdout


# a model whose answers stream for 6 s (120 words, 50 ms a word), numbered so that a word repeated or dropped at a
# seam shows
SLOW = "fleet-slow"
SLOW_ANSWER = " ".join(f"s{i:03d}" for i in range(120))


def test_a_node_cut_off_with_streams_in_flight_their_answers_go_on_whole_at_the_other_replica(fleet, scenario):
    """Two streams of each surface through nginx with the official SDKs, one of each pair on either replica (least
    in flight, started one after the other), then one replica's host cut off: its engine goes silent to the
    gateway, and past the model's stream idle timeout (2 s) each of its answers goes on at the other replica. The
    host is healed once they have (within the tolerance: the node is not lost, nothing is replaced), and every
    client gets the whole answer, each word once, and the finish the engine gives; their records say which were
    resumed, and why."""
    load, watch, outcome = scenario
    system = fleet.system
    add_test_engine(system, "slowengine", f"--load-seconds 1 --delay-ms 50 --answer '{SLOW_ANSWER}'")
    system.cli("ctl", "model", "add", SLOW, "--file", system.sha, "--engine", "slowengine", "--replicas", "2",
               "--memory", "300MiB", "--routing", "least-inflight", "--stream-idle-timeout", "2s")
    try:
        system.wait_ready(SLOW, 2, timeout=60)
        nodes = {r["name"]: r["node"] for r in fleet.ready(SLOW)}
        assert len(set(nodes.values())) == 2, f"the two replicas on one node: {nodes}"
        seen, threads = [], []
        for surface in [s for s in FINISHES for _ in range(2)]:
            seen.append(Seen(surface))
            threads.append(threading.Thread(target=stream_through_sdk, daemon=True,
                                            args=(fleet.nginx, fleet.key, SLOW, seen[-1])))
            threads[-1].start()
            wait_for(lambda: seen[-1].request_id or seen[-1].done, 30, interval=0.05, what=f"{surface}'s answer")
            time.sleep(0.3)  # its count shared with the other web process (gateway/runtime.py SHARED_INTERVAL)
        wait_for(lambda: all(len(s.text.split()) >= 3 or s.done for s in seen), 30, what="every stream's first words")
        assert not [s for s in seen if s.done], f"a stream ended before the cut: {seen}"
        cut_node = sorted(nodes.values())[0]
        cut = {name for name, node in nodes.items() if node == cut_node}
        there = [s for s in seen if s.replica in cut]
        assert {s.surface for s in there} == set(FINISHES), f"not every surface on {sorted(cut)}: {seen}"
        host = fleet.hosts[cut_node]
        host.cut()
        cut_at = time.monotonic()
        try:
            wait_for(lambda: all(s.went_on or s.done for s in there), 20, interval=0.1,
                     what=f"the streams on {sorted(cut)} going on elsewhere: {there}")
        finally:
            host.heal()
        healed = time.monotonic() - cut_at
        wait_for(lambda: all(s.done for s in seen), 30, interval=0.1, what=f"every stream to end: {seen}")
        for thread in threads:
            thread.join(5)
        for s in seen:
            assert not s.error, s
            assert s.text == SLOW_ANSWER and s.finish == FINISHES[s.surface], s
            assert s.whole in (None, SLOW_ANSWER), s  # the answer the SDK built, where it builds one
            assert s.went_on == (s in there), s

        # their records: each answer begun on the cut replica resumed at the other (its engine silent, or its
        # node lost), none of the others
        ids = {s.request_id for s in seen}
        assert "" not in ids and len(ids) == len(seen), seen

        def records() -> dict[str, dict] | None:
            found = {r["request_id"]: r for r in fleet.api("/api/v1/requests/", model=SLOW, limit=100)["results"]}
            return found if ids <= set(found) else None

        found = wait_for(records, 30, what="the streams' request records")
        for s in seen:
            record = found[s.request_id]
            first, last = record["tries"][0], record["tries"][-1]
            assert first[0] == s.replica, (s, record["tries"])
            if s not in there:
                assert record["resumes"] == 0, (s, record["tries"])
                continue
            assert record["resumes"] == 1 and first[3].endswith("; resumed"), (s, record["tries"])
            assert "went silent" in first[3] or "left the fleet" in first[3], (s, record["tries"])
            assert last[0] not in cut and last[3] == "answered 200", (s, record["tries"])
        resumed = fleet.api("/api/v1/requests/", model=SLOW, resumed="true", limit=100)["results"]
        assert {r["request_id"] for r in resumed} == {s.request_id for s in there}
        said = sorted(found[s.request_id]["tries"][0][3].removesuffix("; resumed") for s in there)
        outcome["recovered"] = (f"{len(there)} of {len(seen)} streams resumed ({', '.join(said)}), the node healed "
                                f"{healed:.1f} s after the cut; every stream whole")
    finally:
        system.cli("ctl", "model", "remove", SLOW)
        wait_for(lambda: not [r for r in fleet.replicas(SLOW) if r["state"] not in ("stopped", "failed")], 60,
                 what=f"{SLOW} removed")
