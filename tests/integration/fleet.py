"""A fleet across network namespaces for the fault matrix (tests/integration/test_fleet.py).

Two control planes (web, Celery worker and beat each) on a PostgreSQL primary and its streaming standby
(DATABASE_URL names both, libpq's host list) and a Valkey primary, its replica and
three Sentinels of the test's own (tests/sentinel.py; the matrix restarts and kills them), Debian's nginx in front
of both webs as docs/gateway.md configures it, and agent hosts in network namespaces (tests/integration/netns.py),
each agent dialling both control planes (`--server A,B`) through a delaying relay of its own (no delay until a
scenario sets one), so it advertises its own address.

While a scenario runs, `Load` keeps a few requests in flight through nginx with the official `openai` client and
counts every failure, and `Watch` checks the invariants twice a second: per model, replicas counting toward it
never beyond what it wants plus one surge replica; never two engines for one replica; per node, the memory of its
replicas within what it offers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import openai
import psycopg

from agents.agent.records import engines_dir
from ground.ports import free_port
from tests.integration import netns
from tests.integration.harness import (
    MANAGE,
    Agent,
    System,
    add_test_engine,
    make_model_file,
    start_nginx,
    start_system,
    wait_for,
)
from tests.postgres import OwnPostgres
from tests.sentinel import MASTER as REDIS_MASTER
from tests.sentinel import SentinelSet

COUNTING = ("pending", "downloading", "starting", "ready")
HOLDING_MEMORY = ("downloading", "starting", "ready", "draining", "stopping")
MODEL = "fleet"


@dataclass
class Fleet:
    net: netns.Network
    system: System  # control plane A; B's processes are web-b, worker-b, beat-b in system.procs
    url_b: str
    nginx: str
    key: str
    postgres: OwnPostgres  # the primary
    valkey: SentinelSet
    standby: OwnPostgres | None = None  # streaming from the primary; DATABASE_URL names both
    hosts: dict[str, netns.Host] = field(default_factory=dict)
    relays: dict[str, netns.DelayRelay] = field(default_factory=dict)

    # the control planes

    def control_plane(self, which: str) -> list[str]:
        return ["web", "worker", "beat"] if which == "a" else ["web-b", "worker-b", "beat-b"]

    def kill_control_plane(self, which: str) -> None:
        """SIGKILL every process of one control plane at once, as a machine that loses its power."""
        for name in self.control_plane(which):
            popen = self.system.procs[name].popen
            assert popen is not None  # the control plane's processes are started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
        for name in self.control_plane(which):
            popen = self.system.procs[name].popen
            assert popen is not None
            popen.wait(10)

    @property
    def home_b(self) -> Path:
        """Control plane B's LLMGW_HOME: its mirror directory and its token its own, its secret key A's."""
        return self.system.home / "b"

    def env_b(self) -> dict:
        return dict(self.system.env, LLMGW_HOME=str(self.home_b), LLMGW_CONTROL_PLANE_URL=self.url_b,
                    LLMGW_SECRET_KEY=(self.system.home / "secret-key").read_text().strip())

    def start_control_plane(self, which: str) -> None:
        from llmgw.web import web_argv

        py, port, system = sys.executable, self.system.port, self.system
        if which == "a":
            env, home, suffix = system.env, system.home, ""
            system.spawn("web", web_argv(system.host, port))
            wait_for(lambda: _answers(system.url), 60, what="control plane A's web")
        else:
            self.home_b.mkdir(exist_ok=True)
            self.url_b = self.url_b or f"http://{system.host}:{free_port()}"
            env, home, suffix = self.env_b(), self.home_b, "-b"
            system.spawn("web-b", web_argv(system.host, int(self.url_b.rsplit(":", 1)[1])), env=env)
            wait_for(lambda: _answers(self.url_b), 60, what="control plane B's web")
        system.spawn(f"worker{suffix}", [py, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "-c", "1",
                                         "--without-gossip", "--without-mingle", "-n", f"fleet{suffix}-{port}@%h"],
                     env=env)
        system.spawn(f"beat{suffix}", [py, "-m", "celery", "-A", "llmgw", "beat", "-l", "info",
                                       "-s", str(home / "celerybeat-schedule")], env=env)

    def api(self, path: str, url: str | None = None, **params):
        import httpx

        response = httpx.get((url or self.url_b) + path, params=params, timeout=30,
                             headers={"Authorization": f"Bearer {self.system.admin_token}"})
        response.raise_for_status()
        return response.json()

    # agents

    def start_agent(self, name: str) -> None:
        host, agent, relay = self.hosts[name], self.system.agents[name], self.relays[name]
        env = dict(self.system.env, LLMGW_AGENT_TOKEN=agent.token, LLMGW_ENGINE_HOST=host.address)
        argv = [sys.executable, str(MANAGE), "llmgw", "agent", "--server", f"{relay.url},{self.url_b}",
                "--advertise-address", host.address, "--state-dir", str(agent.state_dir), "--memory", agent.memory,
                "--gpus", "none", "--port-range", agent.port_range, "--stop-timeout", "5"]
        agent.proc = self.system.spawn(f"agent-{name}", host.argv(argv), env=env)

    def engines(self) -> dict[str, list[tuple[str, int]]]:
        """Every engine process running on the hosts, by the replica its agent recorded it for: (host, pid)."""
        found: dict[str, list[tuple[str, int]]] = {}
        for name, host in self.hosts.items():
            recorded = {}
            for path in engines_dir(self.system.agents[name].state_dir).glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    record = json.loads(path.read_text())
                    recorded[int(record["pid"])] = record["name"]
            for pid in host.pids():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"tests/engine.py" in cmdline:
                    found.setdefault(recorded.get(pid, f"unrecorded pid {pid}"), []).append((name, pid))
        return found

    def rows(self, sql: str, *args) -> list[tuple]:
        with psycopg.connect(self.system.env["DATABASE_URL"], connect_timeout=5) as conn:
            return conn.execute(sql, args).fetchall()

    def replicas(self, model: str = MODEL) -> list[dict]:
        rows = self.rows(
            "SELECT r.name, r.state, r.restart, n.name FROM cluster_replica r JOIN cluster_model m ON m.id = r.model_id "
            "LEFT JOIN cluster_node n ON n.id = r.node_id WHERE m.name = %s ORDER BY r.id", model)
        return [{"name": n, "state": s, "restart": r, "node": node} for n, s, r, node in rows]

    def ready(self, model: str = MODEL) -> list[dict]:
        return [r for r in self.replicas(model) if r["state"] == "ready"]

    def orphans(self) -> list[str]:
        """Engines running with no live replica row naming them on their node."""
        live = {(name, node) for name, state, node in self.rows(
            "SELECT r.name, r.state, n.name FROM cluster_replica r JOIN cluster_node n ON n.id = r.node_id "
            "WHERE r.state NOT IN ('failed', 'stopped')")}
        return [f"{replica} on {host} (pid {pid})" for replica, found in self.engines().items()
                for host, pid in found if (replica, host) not in live]

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/login/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# A silent node is disconnected after TOLERANCE seconds and its replicas replaced after GRACE more (15 and 60 by
# default). Short, so that a cut past the grace is over in seconds; the grace not as short as the other
# integration tests' 8 s: a link losing 30 % of its packets each way now and then stalls a TCP stream for 10 s
# and more (a segment lost five times running, each retransmission waiting twice as long), and the lossy-link
# scenario's promise, nothing replaced, is about such a link, not about a node gone for good.
TOLERANCE = 6
GRACE = 20


def start_fleet(home: Path, hosts=("n1", "n2", "n3"), replicas: int = 2) -> Fleet:
    net = netns.Network()
    postgres = standby = valkey = system = fleet = None
    try:
        postgres = OwnPostgres()
        standby = postgres.standby()
        database_url = (f"postgres://postgres@127.0.0.1:{postgres.port},127.0.0.1:{standby.port}/postgres"
                        "?target_session_attrs=read-write")
        (home / "valkey").mkdir()
        valkey = SentinelSet(home / "valkey").start()
        system = start_system(home, host=net.address, database_url=database_url, redis_url=valkey.url, redis_db=0,
                              extra_env={"LLMGW_ENGINE_HOST": "", "LLMGW_NODE_TOLERANCE": str(TOLERANCE),
                                         "LLMGW_NODE_LOST_GRACE": str(GRACE), "LLMGW_REDIS_SENTINELS": valkey.addresses,
                                         "LLMGW_REDIS_MASTER": REDIS_MASTER})
        fleet = Fleet(net, system, "", "", "", postgres, valkey, standby=standby)
        fleet.start_control_plane("b")
        fleet.nginx, _ = start_nginx(system, [system.url, fleet.url_b])
        system.server = fleet.nginx  # the operator's program reaches either control plane through the proxy
        add_test_engine(system)
        system.sha = make_model_file(system)
        for name in hosts:
            fleet.hosts[name] = net.host(name)
            out = system.cli("node", "add", name, "--server", system.url).stdout
            token = next(w for w in out.split() if w.startswith("lnt_"))
            system.agents[name] = Agent(name, token, home / f"agent-{name}", "1GiB", "22000-22199")
            web_a = system.url.removeprefix("http://").rsplit(":", 1)
            fleet.relays[name] = netns.DelayRelay(net.address, (web_a[0], int(web_a[1])), 0.0)
            fleet.start_agent(name)
        system.wait_nodes_connected(list(hosts), timeout=60)
        system.cli("ctl", "model", "add", MODEL, "--file", system.sha, "--engine", "testengine", "--replicas",
                   str(replicas), "--memory", "300MiB")
        system.wait_ready(MODEL, replicas, timeout=90)
        fleet.key = system.cli("ctl", "keys", "create", "fleet-load").stdout.split()[-1]
        return fleet
    except BaseException:
        if system is not None:
            print(system.diagnostics())
        stop_fleet(fleet, net, system, postgres, valkey, standby)
        raise


def stop_fleet(fleet, net, system, postgres, valkey, standby=None) -> None:
    if fleet is not None:
        fleet.close()
    if system is not None:
        system.stop()
    if net is not None:
        net.close()
    if valkey is not None:
        valkey.stop()
    for server in (postgres, standby):
        if server is not None:
            server.close()


class Load:
    """A few requests in flight throughout, through nginx with the official client; every failure counted."""

    def __init__(self, url: str, key: str, workers: int = 3, model: str = MODEL, stream: bool = False):
        for client_log in ("httpx", "httpx2"):  # not a line per request (the openai client's is httpx2)
            logging.getLogger(client_log).setLevel(logging.WARNING)
        self.url, self.key, self.model, self.stream = url, key, model, stream
        self.ok = 0
        self.failures: list[tuple[float, str]] = []
        self.slowest = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self, worker: int) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=60)
        n = 0
        while not self._stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                # a new conversation each time: a rollout's canary takes its share of them
                said = client.chat.completions.create(
                    model=self.model, max_tokens=4, stream=self.stream,
                    messages=[{"role": "user", "content": f"worker {worker}, request {n}"}])
                if self.stream:
                    for _chunk in said:  # a stream that breaks raises here
                        pass
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # every failure is the finding: counted with what it said
                with self._lock:
                    self.failures.append((time.time(), f"{type(exc).__name__}: {exc}"[:300]))
            with self._lock:
                self.slowest = max(self.slowest, time.monotonic() - started)
            time.sleep(0.05)

    def mark(self) -> tuple[int, int]:
        with self._lock:
            self.slowest = 0.0
            return self.ok, len(self.failures)

    def since(self, mark: tuple[int, int]) -> tuple[int, list[str]]:
        with self._lock:
            return self.ok - mark[0], [f for _, f in self.failures[mark[1]:]]

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


# what each surface's stream ends with when its engine finishes the answer (tests/engine.py)
FINISHES = {"chat": "stop", "completions": "stop", "responses": "completed", "messages": "end_turn"}


@dataclass(eq=False)  # each stream itself
class Seen:
    """What a client saw of one stream, as its SDK gave it: the text, the finish, the whole answer where the
    SDK builds one (Responses, Messages), the gateway's request id and the replica it named, any error, and
    whether its words stopped for GAP seconds and then came again (its answer went on elsewhere)."""

    GAP = 1.5

    surface: str
    text: str = ""
    finish: str | None = None
    whole: str | None = None
    request_id: str = ""
    replica: str = ""
    error: str = ""
    went_on: bool = False
    done: bool = False
    last_at: float = 0.0

    def began(self, headers) -> None:
        self.request_id, self.replica = headers.get("x-request-id", ""), headers.get("x-llmgw-replica", "")

    def add(self, piece: str) -> None:
        now = time.monotonic()
        if piece and self.last_at and now - self.last_at >= self.GAP:
            self.went_on = True
        if piece:
            self.text, self.last_at = self.text + piece, now


def stream_through_sdk(url: str, key: str, model: str, seen: Seen) -> None:
    """One streamed answer of `seen.surface` through the official `openai` or `anthropic` client, read to its end."""
    say = [{"role": "user", "content": "count"}]
    try:
        if seen.surface == "messages":
            claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
            with claude.messages.stream(model=model, max_tokens=500, messages=say) as stream:
                seen.began(stream.response.headers)
                for piece in stream.text_stream:
                    seen.add(piece)
                final = stream.get_final_message()
            seen.finish = final.stop_reason
            seen.whole = "".join(getattr(block, "text", "") for block in final.content)
            return
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        if seen.surface == "chat":
            chat = client.chat.completions.with_raw_response.create(model=model, messages=say,
                                                                    max_tokens=500, stream=True)
            seen.began(chat.headers)
            for chunk in chat.parse():
                if chunk.choices:
                    seen.add(chunk.choices[0].delta.content or "")
                    seen.finish = chunk.choices[0].finish_reason or seen.finish
        elif seen.surface == "completions":
            completion = client.completions.with_raw_response.create(model=model, prompt="count:", max_tokens=500,
                                                                     stream=True)
            seen.began(completion.headers)
            for piece in completion.parse():
                if piece.choices:
                    seen.add(piece.choices[0].text)
                    seen.finish = piece.choices[0].finish_reason or seen.finish
        else:
            response = client.responses.with_raw_response.create(model=model, input="count", max_output_tokens=500,
                                                                  stream=True)
            seen.began(response.headers)
            for event in response.parse():
                if event.type == "response.output_text.delta":
                    seen.add(event.delta)
                elif event.type in ("response.completed", "response.failed", "response.incomplete"):
                    seen.finish, seen.whole = event.response.status, event.response.output_text
    except Exception as exc:  # what the client saw is the finding
        seen.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        seen.done = True


class Watch:
    """The invariants, checked twice a second while a scenario runs; what broke them, with when."""

    def __init__(self, fleet: Fleet, surge: int = 1):
        self.fleet, self.surge = fleet, surge
        self.broken: list[str] = []
        self.checks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.check()
            except (psycopg.Error, OSError):  # the database restarted under the scenario: checked again next time
                continue

    def check(self) -> None:
        fleet, now = self.fleet, time.strftime("%H:%M:%S")
        for model, wanted, counting in fleet.rows(
                "SELECT m.name, m.replicas, COUNT(r.id) FILTER (WHERE r.state = ANY(%s) AND r.restart <> 'replacing') "
                "FROM cluster_model m LEFT JOIN cluster_replica r ON r.model_id = m.id GROUP BY m.id", list(COUNTING)):
            if counting > wanted + self.surge:
                self.broken.append(f"{now} {model}: {counting} replicas count toward it, it wants {wanted}")
        for node, offered, held in fleet.rows(
                "SELECT n.name, n.memory_bytes, COALESCE(SUM(r.memory_bytes) FILTER (WHERE r.state = ANY(%s)), 0) "
                "FROM cluster_node n LEFT JOIN cluster_replica r ON r.node_id = n.id GROUP BY n.id",
                list(HOLDING_MEMORY)):
            if held > offered:
                self.broken.append(f"{now} node {node}: replicas hold {held} bytes of the {offered} it offers")
        for replica, found in fleet.engines().items():
            if len(found) > 1:
                self.broken.append(f"{now} two engines for {replica}: {found}")
        self.checks += 1

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(10)
        self.check()
        # every replica's state was written with an Event saying so (pending has several: placed, waiting, …)
        for name, state in self.fleet.rows(
                "SELECT r.name, r.state FROM cluster_replica r WHERE r.state <> 'pending' AND NOT EXISTS ("
                "SELECT 1 FROM cluster_event e WHERE e.subject = r.name AND e.kind = 'replica.' || r.state)"):
            self.broken.append(f"replica {name} is {state} with no replica.{state} Event")
        return self.broken
