"""Hundreds of nodes on one control plane: simulated agents against one `llmgw up`.

    python bench/fleet.py                         # 200 and 500 agents
    python bench/fleet.py --agents 100,500,1000

For each fleet size, a llmgw of its own (`llmgw up --no-demo --no-agent` in a temporary LLMGW_HOME, on a
database of its own on DATABASE_URL's PostgreSQL when set, else SQLite, and an embedded Valkey of its own),
then N simulated agents: websockets from this one process that say hello with a node's facts (8 GiB, no GPU),
report every 5 s like real agents, and answer every `desired` list at once with its replicas ready (no engine
runs). Measured:

- all connected: from the first dial to every agent holding its first `desired` (the server's answer to its
  hello);
- add → N ready: `ctl model add` of a model of N replicas (one per node, by placement's spread) to all N
  ready in /api/v1/status/;
- steady CPU: the web processes' and the worker's (and beat's) CPU over `--steady` seconds afterwards, in cores,
  with the agents reporting every 5 s;
- web RSS: the web processes' resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
import psutil
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from instance import Instance  # noqa: E402

from llmgw.valkey import EmbeddedValkey  # noqa: E402

REPORT_INTERVAL = 5.0
MODEL = "sim"
GiB = 1024**3
TEST_ENGINE = ROOT / "tests" / "engine.py"


class Sim:
    """N agents in one event loop."""

    def __init__(self, url: str, tokens: list[str]):
        self.ws_url = url.replace("http://", "ws://") + "/ws/agent/"
        self.tokens = tokens
        self.connected: dict[int, float] = {}
        self.opened: dict[int, float] = {}  # handshake done (first time)
        self.desired_messages = 0
        self.reports = 0
        self.errors: list[str] = []
        self.stop = asyncio.Event()

    def facts(self, i: int) -> dict:
        return {"hostname": f"sim-{i}", "cpu_count": 8, "memory_bytes": 8 * GiB, "memory_total_bytes": 8 * GiB,
                "gpus": [], "engines": {"command": ""}, "port_range": [20000, 20999], "agent_version": "sim"}

    async def agent(self, i: int) -> None:
        running: dict[str, int] = {}
        pid = 100000 + i

        def report() -> str:
            return json.dumps({"type": "report", "full": True, "replicas": [
                {"name": name, "state": "ready", "pid": pid, "port": port} for name, port in running.items()]})

        while not self.stop.is_set():
            try:
                async with connect(self.ws_url, additional_headers={"Authorization": f"Bearer {self.tokens[i]}"},
                                   open_timeout=120, ping_interval=None, max_size=16 * 1024 * 1024) as ws:
                    self.opened.setdefault(i, time.monotonic())
                    await ws.send(json.dumps({"type": "hello", "facts": self.facts(i), "replicas": []}))

                    async def heartbeat():
                        await asyncio.sleep(random.uniform(0, REPORT_INTERVAL))
                        while True:
                            await ws.send(report())
                            self.reports += 1
                            await asyncio.sleep(REPORT_INTERVAL)

                    beating = asyncio.ensure_future(heartbeat())
                    try:
                        async for raw in ws:
                            message = json.loads(raw)
                            if message.get("type") != "desired":
                                continue
                            self.desired_messages += 1
                            self.connected.setdefault(i, time.monotonic())
                            wanted = {r["name"]: r.get("port") or 0 for r in message["replicas"]}
                            if wanted != running:
                                running.clear()
                                running.update(wanted)
                                await ws.send(report())
                                self.reports += 1
                    finally:
                        beating.cancel()
            except Exception as exc:  # noqa: BLE001 - a bench counts what went wrong and dials again
                if not self.stop.is_set():
                    self.errors.append(f"agent {i}: {type(exc).__name__}: {exc}"[:200])
                    await asyncio.sleep(1)


class Control(Instance):
    """`llmgw up --no-agent` on a database and a Valkey of its own."""

    def __init__(self, n: int, database_url: str | None):
        self.valkey = EmbeddedValkey(Path(os.environ.get("TMPDIR", "/tmp")) / f"llmgw-bench-fleet-valkey-{os.getpid()}")
        redis_url = self.valkey.start()
        env = {"REDIS_URL": redis_url}
        self.dropdb = None
        if database_url:
            import psycopg

            name = f"llmgw_bench_fleet_{os.getpid()}_{n}"
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{name}"')
            env["DATABASE_URL"] = database_url.rsplit("/", 1)[0] + f"/{name}"
            self.dropdb = (database_url, name)
        super().__init__("fleet", env=env, up_args=["--no-agent"])
        self.env.update(env)

    def transactions(self) -> int | None:
        """The transactions PostgreSQL has run in this run's database so far (each statement outside one is one);
        None on SQLite."""
        if not self.dropdb:
            return None
        import psycopg

        admin, name = self.dropdb
        with psycopg.connect(admin, autocommit=True) as conn:
            row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                               (name,)).fetchone()
        assert row is not None  # the run's own database has its row
        return row[0]

    def processes(self) -> dict[str, list[psutil.Process]]:
        roles: dict[str, list[psutil.Process]] = {"web": [], "worker": [], "beat": []}
        for proc in psutil.Process(self.up.pid).children(recursive=True):
            try:
                cmd = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if "celery" in cmd and " beat" in cmd:
                roles["beat"].append(proc)
            elif "celery" in cmd and " worker" in cmd:
                roles["worker"].append(proc)
            elif "uvicorn" in cmd or "daphne" in cmd or "llmgw.web" in cmd:
                roles["web"].append(proc)
        return roles

    def stop(self) -> None:
        super().stop()
        self.valkey.stop()
        if self.dropdb:
            import psycopg

            admin, name = self.dropdb
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def spy(control: Control, o, n: int) -> list:
    """With --py-spy: each web and worker process recorded from the first dial to all ready (raw folded stacks)."""
    if not o.py_spy:
        return []
    import subprocess

    Path(o.profile_dir).mkdir(parents=True, exist_ok=True)
    spies = []
    for role, procs in control.processes().items():
        for proc in procs:
            out = Path(o.profile_dir) / f"fleet-{n}-{role}-{proc.pid}.txt"
            spies.append(subprocess.Popen([o.py_spy, "record", "--format", "raw", "--rate", "50", "-p", str(proc.pid),
                                           "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1)
    return spies


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


async def measure(n: int, o) -> dict:
    control = Control(n, o.database_url)
    try:
        headers = {"Authorization": f"Bearer {control.token}"}
        async with httpx.AsyncClient(base_url=control.url, headers=headers, timeout=120) as client:
            tokens = []
            for i in range(n):
                response = await client.post("/api/v1/nodes/", json={"name": f"sim-{i}"})
                response.raise_for_status()
                tokens.append(response.json()["token"])
            sim = Sim(control.url, tokens)
            spies = spy(control, o, n)
            started = time.monotonic()
            agents = [asyncio.ensure_future(sim.agent(i)) for i in range(n)]
            while len(sim.connected) < n:
                if time.monotonic() - started > o.timeout:
                    raise SystemExit(f"{len(sim.connected)} of {n} agents connected after {o.timeout:.0f} s: "
                                     f"{sim.errors[:3]}")
                await asyncio.sleep(0.05)
            connected = max(sim.connected.values()) - started
            opened = sorted(t - started for t in sim.opened.values())
            answered = sorted(t - started for t in sim.connected.values())
            print(f"  {n} agents: handshakes done at p50 {opened[n // 2]:.1f} s, all {opened[-1]:.1f} s; first desired "
                  f"at p50 {answered[n // 2]:.1f} s, all {answered[-1]:.1f} s", flush=True)

            sample = control.home / "sim.bin"
            sample.write_bytes(os.urandom(1024 * 1024))
            await asyncio.to_thread(control.cli, "mirror", "import", str(sample))
            await asyncio.to_thread(control.cli, "ctl", "engine", "add", "sim", "--kind", "command", "--command",
                                    f"{{python}} {TEST_ENGINE} --host {{host}} --port {{port}}")
            added = time.monotonic()
            await asyncio.to_thread(control.cli, "ctl", "model", "add", MODEL, "--file", "sim.bin", "--engine", "sim",
                                    "--replicas", str(n), "--memory", "1GiB", "--yes")
            while True:
                status = (await client.get("/api/v1/status/")).json()
                ready = next((m["ready"] for m in status["models"] if m["name"] == MODEL), 0)
                if ready >= n:
                    break
                if time.monotonic() - added > o.timeout:
                    raise SystemExit(f"{ready} of {n} replicas ready after {o.timeout:.0f} s")
                await asyncio.sleep(0.2)
            to_ready = time.monotonic() - added
            for proc in spies:
                proc.send_signal(2)  # py-spy writes what it has on SIGINT
                proc.wait(30)

            await asyncio.sleep(o.settle)
            roles = control.processes()
            before = {role: cpu_seconds(procs) for role, procs in roles.items()}
            reports, transactions = sim.reports, control.transactions()
            window = time.monotonic()
            await asyncio.sleep(o.steady)
            elapsed = time.monotonic() - window
            reports = sim.reports - reports
            await asyncio.sleep(1.5)  # PostgreSQL flushes its counters within a second
            if transactions is not None:
                after = control.transactions()
                assert after is not None  # on PostgreSQL both times
                transactions = after - transactions
            cores = {role: (cpu_seconds(procs) - before[role]) / elapsed for role, procs in roles.items()}
            rss = sum(p.memory_info().rss for p in roles["web"] if p.is_running())
            sim.stop.set()
            for task in agents:
                task.cancel()
            await asyncio.gather(*agents, return_exceptions=True)
            return {"agents": n, "connected": connected, "ready": to_ready, "web": cores["web"],
                    "worker": cores["worker"], "beat": cores["beat"], "rss": rss / 1024**2,
                    "per_report": transactions / reports if transactions is not None and reports else None,
                    "webs": len(roles["web"]), "errors": len(sim.errors), "first_errors": sim.errors[:3]}
    finally:
        control.stop()


def table(rows: list[dict]) -> None:
    print()
    print("| agents | all connected | model of N replicas: add → N ready | steady CPU web + worker (+ beat) "
          "| per 100 agents | web RSS | per web process | PostgreSQL transactions per report | agent errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        total = r["web"] + r["worker"] + r["beat"]
        per_report = f"{r['per_report']:.2f}" if r["per_report"] is not None else "- (SQLite)"
        print(f"| {r['agents']} | {r['connected']:.1f} s | {r['ready']:.1f} s | {r['web']:.2f} + {r['worker']:.2f} "
              f"(+ {r['beat']:.2f}) cores | {total / r['agents'] * 100:.3f} cores | {r['rss']:.0f} MiB "
              f"({r['webs']} web) | {r['rss'] / max(1, r['webs']):.0f} MiB | {per_report} | {r['errors']} |")
    for r in rows:
        for error in r["first_errors"]:
            print(f"  {r['agents']} agents: {error}")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        grow = b["agents"] / a["agents"]
        print(f"\n{grow:.1f}× the agents: all connected {b['connected'] / a['connected']:.1f}×, add → ready "
              f"{b['ready'] / a['ready']:.1f}×, steady CPU "
              f"{(b['web'] + b['worker'] + b['beat']) / max(1e-9, a['web'] + a['worker'] + a['beat']):.1f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default="200,500", help="fleet sizes, comma-separated")
    p.add_argument("--steady", type=float, default=30.0, help="seconds of steady state measured")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after all are ready before measuring")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--py-spy", metavar="BIN", help="record the web and worker processes with this py-spy")
    p.add_argument("--profile-dir", default="bench-profiles", help="where --py-spy writes (default ./bench-profiles)")
    p.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""),
                   help="a PostgreSQL server's URL; each run makes a database of its own there (default: "
                        "DATABASE_URL; none: SQLite)")
    o = p.parse_args()
    if o.database_url and not o.database_url.startswith(("postgres://", "postgresql://")):
        o.database_url = ""
    print(f"{os.cpu_count()} CPUs; database: {'PostgreSQL' if o.database_url else 'SQLite'}; "
          f"agents report every {REPORT_INTERVAL:.0f} s")
    rows = []
    for n in (int(x) for x in o.agents.split(",")):
        row = asyncio.run(measure(n, o))
        print(f"  {n} agents: connected {row['connected']:.1f} s, add → ready {row['ready']:.1f} s", flush=True)
        rows.append(row)
    table(rows)


if __name__ == "__main__":
    main()
