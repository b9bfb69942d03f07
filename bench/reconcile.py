#!/usr/bin/env python
"""Reconciler benchmark: the planner alone, a steady-state tick and a churn tick, at fleet sizes, per database.

    python bench/reconcile.py [--sizes 10x50,100x500,1000x5000] [--backends sqlite,postgres] [--runs N]

Sizes are NODESxREPLICAS. For each backend and size a child process (this script with --child) gets a fresh
database and LLMGW_HOME, migrates, fills the fleet with bulk_create, measures, and prints its samples as JSON;
this process prints the table. Settings read DATABASE_URL at import, hence one process per database.

- SQLite: a file in a temporary LLMGW_HOME.
- PostgreSQL: a database `llmgw_bench_<hex>` created on the server of DATABASE_URL
  (default postgres://postgres@127.0.0.1:5432/test) and dropped WITH (FORCE) at the end.
- Redis: REDIS_URL if set, else an embedded Valkey for the whole run.

The fleet: every node connected and seen now, 64 GiB, engines xllamacpp and command; about replicas/5 models of
5 replicas each on one file, engine and profile, with memory_bytes set; every replica ready, a model's replicas
on distinct nodes, each with a port.

Measured (after one untimed warm-up run each):
- planner: `planner.plan(snapshot)` on one snapshot taken once;
- tick: `reconciler.reconcile_once()` in the steady state (snapshot, plan, nothing to apply);
- churn: `reconcile_once()` after 1 % of the replicas were marked failed, so it places as many replacements
  (Create actions, Replica rows, Events, notifications to the nodes' agent streams). Between runs the
  replacements and Events are deleted and the failed replicas set ready again, so every run does the same work.
Node `last_seen` is refreshed before every run (untimed), so nodes stay alive. No time is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "10x50,100x500,1000x5000"
DEFAULT_PG = "postgres://postgres@127.0.0.1:5432/test"
RESULT_MARK = "BENCH-RESULT "
TICK_TARGET_MS = 1000.0
PLANNER_TARGET_MS = 100.0
GIB = 1024**3
NODE_MEMORY = 64 * GIB
PORT_LOW, PORT_HIGH = 20000, 20999
CHURN_FRACTION = 0.01


def default_runs(replicas: int) -> int:
    return 20 if replicas <= 1000 else 7


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            nodes, replicas = (int(x.replace("_", "")) for x in part.split("x"))
        except ValueError:
            raise SystemExit(f"bad size {part!r}: use NODESxREPLICAS, e.g. 1000x5000") from None
        if nodes < 1 or replicas < 1:
            raise SystemExit(f"bad size {part!r}: nodes and replicas must be at least 1")
        sizes.append((nodes, replicas))
    if not sizes:
        raise SystemExit("no sizes given")
    return sizes


# --- the child: one database, one size ------------------------------------------------------------------


def child(nodes: int, replicas: int, runs: int) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    import django

    django.setup()

    from django.core.management import call_command
    from django.db import connection

    t0 = time.perf_counter()
    call_command("migrate", verbosity=0, interactive=False)
    migrate_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    fleet = populate(nodes, replicas)
    populate_s = time.perf_counter() - t0
    progress(f"{connection.vendor} {nodes}x{replicas}: migrated in {migrate_s:.1f}s, filled in {populate_s:.1f}s")

    result = {
        "backend": connection.vendor,
        "db_version": db_version(connection),
        "nodes": nodes,
        "replicas": replicas,
        "models": fleet["models"],
        "runs": runs,
    }
    result.update(measure(fleet, runs))
    print(RESULT_MARK + json.dumps(result), flush=True)


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def db_version(connection) -> str:
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("SHOW server_version")
            return "PostgreSQL " + cur.fetchone()[0].split()[0]
        if connection.vendor == "sqlite":
            cur.execute("SELECT sqlite_version()")
            return "SQLite " + cur.fetchone()[0]
    return connection.vendor


def populate(n_nodes: int, n_replicas: int) -> dict:
    import hashlib

    from django.utils import timezone

    from cluster.models import ClusterSettings, EngineVersion, Model, ModelFile, Node, Profile, Replica

    now = timezone.now()
    cluster = ClusterSettings.load()  # creates the row and the engine key, as a real cluster has them
    engine = EngineVersion.objects.get(name="xllamacpp")  # from migration 0002
    profile = Profile.objects.get(name="default")
    file = ModelFile.objects.create(
        sha256=hashlib.sha256(b"bench").hexdigest(), name="bench.gguf", size=2 * GIB, format="gguf", gguf={}
    )
    per_node = math.ceil(n_replicas / n_nodes)
    memory = min(4 * GIB, (NODE_MEMORY * 3 // 4) // per_node)  # a quarter of each node stays free for churn

    facts = {
        "cpu_count": 16,
        "memory_bytes": NODE_MEMORY,
        "gpus": [],
        "engines": {"xllamacpp": "", "command": ""},
        "port_range": [PORT_LOW, PORT_HIGH],
        "hostname": "",
    }
    Node.objects.bulk_create(
        Node(
            name=f"node-{i:05d}",
            token_hash=hashlib.sha256(f"node-{i:05d}".encode()).hexdigest(),
            address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
            facts=dict(facts, hostname=f"node-{i:05d}"),
            memory_bytes=NODE_MEMORY,
            connected=True,
            last_seen=now,
        )
        for i in range(n_nodes)
    )
    node_ids = list(Node.objects.order_by("name").values_list("id", flat=True))

    n_models = max(1, round(n_replicas / 5))
    wanted = [n_replicas // n_models + (1 if j < n_replicas % n_models else 0) for j in range(n_models)]
    Model.objects.bulk_create(
        Model(name=f"model-{j:05d}", file=file, engine=engine, profile=profile, replicas=wanted[j], memory_bytes=memory)
        for j in range(n_models)
    )
    models = list(Model.objects.order_by("name"))

    snapshot = {
        "profile": profile.name,
        "args": profile.args(),
        "engine": engine.spec(),
        "file": file.sha256,
        "engine_key": ClusterSettings.fingerprint(cluster.engine_key),
    }
    rows = []
    i = 0
    for model, count in zip(models, wanted):
        for _ in range(count):  # consecutive indexes: a model's replicas land on distinct nodes
            rows.append(
                Replica(
                    name=f"{model.name}-{i:08x}",
                    model=model,
                    node_id=node_ids[i % n_nodes],
                    state=Replica.State.READY,
                    port=PORT_LOW + i // n_nodes,
                    memory_bytes=memory,
                    snapshot=snapshot,
                    state_changed_at=now,
                )
            )
            i += 1
    Replica.objects.bulk_create(rows, batch_size=1000)
    return {"models": n_models}


def percentile(samples: list[float], q: float) -> float:
    """Nearest rank: with fewer than 100 samples, p99 is the slowest run."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def measure(fleet: dict, runs: int) -> dict:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from cluster import planner, reconciler
    from cluster.models import Event, Node, Replica

    def keep_alive():
        Node.objects.update(last_seen=timezone.now())

    def timed(fn, before=None, after=None) -> tuple[list[float], list]:
        samples, outs = [], []
        for run in range(runs + 1):  # run 0 warms up
            if before:
                before()
            t0 = time.perf_counter()
            out = fn()
            elapsed = (time.perf_counter() - t0) * 1000
            if after:
                after()
            if run:
                samples.append(elapsed)
                outs.append(out)
        return samples, outs

    # 1. the planner alone, on one snapshot
    keep_alive()
    snapshot = reconciler.take_snapshot()
    planner_ms, planned = timed(lambda: len(planner.plan(snapshot)))
    snapshot_ms, _ = timed(reconciler.take_snapshot, before=keep_alive)

    # 2. the steady tick
    tick_ms, applied = timed(reconciler.reconcile_once, before=keep_alive)
    keep_alive()
    with CaptureQueriesContext(connection) as q:
        reconciler.reconcile_once()
    tick_queries = len(q.captured_queries)

    # 3. the churn tick: 1 % of the replicas failed, spread over the models
    ids = list(Replica.objects.order_by("id").values_list("id", flat=True))
    max_id = ids[-1]
    k = max(1, round(len(ids) * CHURN_FRACTION))
    failed = ids[:: max(1, len(ids) // k)][:k]
    placed = []

    def fail():
        keep_alive()
        Replica.objects.filter(pk__in=failed).update(
            state=Replica.State.FAILED, reason="bench: churn", state_changed_at=timezone.now()
        )

    def restore():
        placed.append(Replica.objects.filter(pk__gt=max_id, node__isnull=False).count())
        Replica.objects.filter(pk__gt=max_id).delete()
        Event.objects.all().delete()
        Replica.objects.filter(pk__in=failed).update(state=Replica.State.READY, reason="")

    churn_ms, churn_actions = timed(reconciler.reconcile_once, before=fail, after=restore)
    fail()
    with CaptureQueriesContext(connection) as q:
        reconciler.reconcile_once()
    churn_queries = len(q.captured_queries)
    restore()

    return {
        "planner_ms": planner_ms,
        "snapshot_ms": snapshot_ms,
        "tick_ms": tick_ms,
        "churn_ms": churn_ms,
        "planner_actions": sorted(set(planned)),
        "tick_actions": sorted(set(applied)),
        "churn_failed": k,
        "churn_actions": sorted(set(churn_actions)),
        "churn_placed": sorted(set(placed)),
        "tick_queries": tick_queries,
        "churn_queries": churn_queries,
    }


# --- the parent: databases, children, the table --------------------------------------------------------


def pg_url_for(base: str, dbname: str) -> str:
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path="/" + dbname))


def pg_admin(base: str):
    import psycopg

    try:
        return psycopg.connect(base, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError:  # the named database may not exist; the server's own one does
        return psycopg.connect(pg_url_for(base, "postgres"), autocommit=True, connect_timeout=5)


def run_child(backend: str, nodes: int, replicas: int, runs: int, redis_url: str) -> dict:
    home = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    env = dict(
        os.environ,
        LLMGW_HOME=str(home),
        REDIS_URL=redis_url,
        DJANGO_SETTINGS_MODULE="llmgw.settings",
        LLMGW_LOG_LEVEL="WARNING",  # one INFO line per Event otherwise; the bench measures the work, not a terminal
        PYTHONHASHSEED="0",
    )
    admin, dbname = None, None
    try:
        if backend == "sqlite":
            env["DATABASE_URL"] = f"sqlite:///{home / 'bench.sqlite3'}"
        else:
            from psycopg import sql

            base = os.environ.get("DATABASE_URL") or DEFAULT_PG
            if not base.startswith(("postgres://", "postgresql://")):
                raise RuntimeError(f"DATABASE_URL is not PostgreSQL: {base}")
            admin = pg_admin(base)
            dbname = f"llmgw_bench_{secrets.token_hex(4)}"
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
            env["DATABASE_URL"] = pg_url_for(base, dbname)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{nodes}x{replicas}", "--runs", str(runs)]
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(RESULT_MARK):
                return dict(json.loads(line[len(RESULT_MARK):]), backend=backend)
        raise RuntimeError(f"the {backend} {nodes}x{replicas} run exited with code {proc.returncode}, no result")
    finally:
        if admin is not None:
            from psycopg import sql

            if dbname:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
            admin.close()
        shutil.rmtree(home, ignore_errors=True)


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_header() -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 1024**2:.1f} GiB RAM"
                break
    except OSError:
        pass
    import django

    return [
        f"Python {platform.python_version()} ({platform.python_implementation()}), Django {django.get_version()}",
        f"{platform.system()} {platform.release()} {platform.machine()}; {cpu}; {os.cpu_count()} CPUs{mem}",
    ]


def fmt_ms(x: float) -> str:
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def table(results: list[dict]) -> list[str]:
    head = [
        "backend", "nodes", "replicas",
        "planner med ms", "planner p99 ms", "tick med ms", "tick p99 ms", "churn med ms", "churn p99 ms",
        "planner / 100 ms target", "tick / 1 s target",
    ]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["backend"], str(r["nodes"]), str(r["replicas"]), "error: " + r["error"]] + [""] * 7)
            continue
        p, t, c = r["planner_ms"], r["tick_ms"], r["churn_ms"]
        rows.append([
            r["backend"], f"{r['nodes']:,}", f"{r['replicas']:,}",
            fmt_ms(statistics.median(p)), fmt_ms(percentile(p, 0.99)),
            fmt_ms(statistics.median(t)), fmt_ms(percentile(t, 0.99)),
            fmt_ms(statistics.median(c)), fmt_ms(percentile(c, 0.99)),
            f"{statistics.median(p) / PLANNER_TARGET_MS:.3f}", f"{statistics.median(t) / TICK_TARGET_MS:.3f}",
        ])
    return format_rows(head, rows, right_from=1)


def detail(results: list[dict]) -> list[str]:
    head = [
        "backend", "nodes", "replicas", "models", "runs", "snapshot med ms",
        "tick actions", "tick queries", "churn failed", "churn actions", "churn placed", "churn queries",
    ]
    rows = []
    for r in results:
        if "error" in r:
            continue
        rows.append([
            r["backend"], f"{r['nodes']:,}", f"{r['replicas']:,}", f"{r['models']:,}", str(r["runs"]),
            fmt_ms(statistics.median(r["snapshot_ms"])),
            "/".join(map(str, r["tick_actions"])), str(r["tick_queries"]),
            str(r["churn_failed"]), "/".join(map(str, r["churn_actions"])),
            "/".join(map(str, r["churn_placed"])), str(r["churn_queries"]),
        ])
    return format_rows(head, rows, right_from=1)


def format_rows(head: list[str], rows: list[list[str]], right_from: int) -> list[str]:
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) if rows else len(head[i]) for i in range(len(head))]

    def line(cells):
        return "  ".join(c.ljust(w) if i < right_from else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(head), "  ".join("-" * w for w in widths)] + [line(row) for row in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"NODESxREPLICAS, comma-separated (default {DEFAULT_SIZES})")
    ap.add_argument("--backends", default="sqlite,postgres", help="sqlite and/or postgres (default both)")
    ap.add_argument(
        "--runs", type=int, default=None, help="timed runs per measure (default 20; 7 above 1,000 replicas)"
    )
    ap.add_argument("--child", metavar="SIZE", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.runs is not None and args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.child:
        ((nodes, replicas),) = parse_sizes(args.child)
        child(nodes, replicas, args.runs or default_runs(replicas))
        return 0

    sizes = parse_sizes(args.sizes)
    backends = [b.strip().lower() for b in args.backends.split(",") if b.strip()]
    aliases = {"postgresql": "postgres", "pg": "postgres"}
    backends = [aliases.get(b, b) for b in backends]
    for b in backends:
        if b not in ("sqlite", "postgres"):
            ap.error(f"unknown backend {b!r}: use sqlite or postgres")

    sys.path.insert(0, str(ROOT))
    valkey = None
    redis_url = os.environ.get("REDIS_URL", "")
    results = []
    load_before = load_average()
    try:
        if not redis_url:
            from llmgw.valkey import EmbeddedValkey

            valkey_dir = Path(tempfile.mkdtemp(prefix="llmgw-bench-valkey-"))
            valkey = EmbeddedValkey(valkey_dir)
            redis_url = valkey.start()
        for backend in backends:
            for nodes, replicas in sizes:
                runs = args.runs or default_runs(replicas)
                print(f"{backend} {nodes:,} x {replicas:,}, {runs} runs ...", file=sys.stderr, flush=True)
                try:
                    results.append(run_child(backend, nodes, replicas, runs, redis_url))
                except Exception as exc:
                    print(f"  failed: {exc}", file=sys.stderr, flush=True)
                    results.append({"backend": backend, "nodes": nodes, "replicas": replicas, "error": str(exc)})
    finally:
        if valkey is not None:
            valkey.stop()
            shutil.rmtree(valkey.workdir, ignore_errors=True)

    versions = sorted({r["db_version"] for r in results if "db_version" in r})
    print()
    for line in machine_header():
        print(line)
    redis_kind = "REDIS_URL" if valkey is None else "embedded Valkey"
    print("Databases: " + (", ".join(versions) or "-") + f"; Redis: {redis_kind}")
    print(f"Load average (1/5/15 min) before: {load_before}, after: {load_average()} (other work shows in p99)")
    print("med = median, p99 = nearest rank (the slowest run below 100 runs); ratios use the median")
    print()
    for line in table(results):
        print(line)
    print()
    for line in detail(results):
        print(line)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
