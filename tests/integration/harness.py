"""A whole llmgw on loopback for integration tests: daphne, Celery worker and beat, agents, as real processes.

Tests talk to it as an operator would: the `llmgw` program (its code, in the test's process, over HTTP), the REST
API, and the engines' ports.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx

from agents.agent.records import stop_recorded_engines
from ground.ports import free_port
from llmgw.main import standalone
from llmgw.processes import Child, Supervisor
from llmgw.web import web_argv
from tests.workers import worker_index

ROOT = Path(__file__).resolve().parents[2]
MANAGE = ROOT / "manage.py"
TEST_ENGINE = ROOT / "tests" / "engine.py"
MiB = 1024**2


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.3, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}")


def holds_for(predicate, seconds: float, interval: float = 0.3, what: str = "condition") -> None:
    """That nothing happens: `predicate` stays true, checked all along, for `seconds` (time enough for what is
    being ruled out, a restart or a duplicate, to have shown)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), f"no longer true: {what}"
        time.sleep(interval)
    assert predicate(), f"no longer true: {what}"


def _with_db(url: str, db: str) -> str:
    parts = urlparse(url)
    return urlunparse(parts._replace(path="/" + db))


def _redis_db(url: str, db: int) -> str:
    """Database `db` of this worker's share of the Redis at `url` (conftest.py: workers sharing REDIS_URL's server
    take 8 databases each)."""
    parts = urlparse(url)
    return urlunparse(parts._replace(path=f"/{db + int(os.environ.get('LLMGW_TEST_REDIS_DB_BASE', 0))}"))


# The engine ports of this worker's agents, 21000 to 28999 for four workers: two workers' engines never want one
# port (an agent fails a replica whose port is taken), and none is an ephemeral port (32768 and up) that
# `free_port` may hand a web process. `llmgw up`'s own agent takes 20000-20999.
ENGINE_PORTS = 21000 + 2000 * worker_index()


@dataclass
class Agent:
    node: str
    token: str
    state_dir: Path
    memory: str
    port_range: str
    proc: Child | None = None


@dataclass
class System:
    home: Path
    env: dict
    port: int
    procs: dict[str, Child] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    admin_token: str = ""
    _dropdb: tuple[str, str] | None = None
    supervisor: Supervisor = field(default_factory=Supervisor)
    host: str = "127.0.0.1"  # where the web process listens
    server: str = ""  # where `cli` points the program, when not at `url` (a proxy in front of two control planes)
    sha: str = ""  # the sha256 of the model file the tests add models with (make_model_file)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # processes

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> Child:
        """A new process under `name`; one still running under that name (a test that failed half-way) is
        stopped first, so none outlives the run."""
        earlier = self.procs.get(name)
        if earlier is not None:
            earlier.stop(signal.SIGKILL, 5)
        child = Child(name, argv, self.home / "logs" / f"{name}.log", env or self.env, cwd=ROOT).start()
        self.procs[name] = child
        return child

    def supervise(self, *names: str) -> None:
        """Start these processes again whenever they exit (until stopped), as systemd's `Restart=always` does
        for a fleet: what `llmgw restart` relies on to bring a control-plane process back."""
        for name in names:
            self.supervisor.watch(self.procs[name])
        self.supervisor.start_thread()

    def cli(self, *args: str, check: bool = True, token: str | None = None) -> subprocess.CompletedProcess:
        """`llmgw ARGS` as an operator runs it against this system from anywhere: the program's own code (what a
        laptop's install runs, llmgw.main.standalone) in this process, over HTTP to the web (or `server`), as the
        admin (or `token`'s user). What the program prints and its exit code, as a process's would be; a refusal is
        its one line on stderr and code 1. (`host_cli` runs the program as a process on the control plane's host.)"""
        out, err = io.StringIO(), io.StringIO()
        argv = ["--server", self.server or self.url, "--token", token or self.admin_token, *args]
        code = standalone(argv, out, err)  # one that hangs: pytest-timeout ends the test
        result = subprocess.CompletedProcess(["llmgw", *args], code, out.getvalue(), err.getvalue())
        if check and result.returncode != 0:
            raise AssertionError(f"llmgw {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def host_cli(self, *args: str, check: bool = True, env: dict | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
        """`llmgw ARGS` run as a program on the control plane's host (`manage.py llmgw`: Django booted, the API in
        its own process, acting as `cli`): for the tests of the program as a program."""
        result = subprocess.run(
            [sys.executable, str(MANAGE), "llmgw", *args], env=env or self.env, cwd=ROOT,
            capture_output=True, text=True, timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"llmgw {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def cli_json(self, *args: str):
        return json.loads(self.cli(*args, "--json").stdout)

    def api(self, method: str, path: str, token: str | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.admin_token}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def replicas(self, model: str | None = None) -> list[dict]:
        """As `ctl replicas --json` shows them (running ones and those failed in the last 10 minutes), read
        over the REST API: a poll costs milliseconds instead of a CLI process."""
        params = {"limit": 10000, "current": "true", **({"model": model} if model else {})}
        response = self.api_retrying("GET", "/api/v1/replicas/", params=params)
        assert response.status_code == 200, response.text
        return sorted(response.json()["results"], key=lambda r: (r["model"], r["created_at"]))

    def api_retrying(self, method: str, path: str, attempts: int = 20, **kwargs) -> httpx.Response:
        """The API, riding out a web process that is restarting (a refused connection) for a few seconds."""
        for attempt in range(attempts):
            try:
                return self.api(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def add_agent(self, node: str, memory: str = "1GiB", port_range: str | None = None, start: bool = True) -> Agent:
        out = self.cli("node", "add", node, "--server", self.url).stdout
        token = next(w for w in out.split() if w.startswith("lnt_"))
        low = ENGINE_PORTS + 200 * len(self.agents)
        agent = Agent(node, token, self.home / f"agent-{node}", memory, port_range or f"{low}-{low + 199}")
        self.agents[node] = agent
        if start:
            self.start_agent(node)
        return agent

    def start_agent(self, node: str, token: str | None = None) -> Child:
        agent = self.agents[node]
        env = dict(self.env, LLMGW_AGENT_TOKEN=token or agent.token)
        agent.proc = self.spawn(
            f"agent-{node}",
            [sys.executable, str(MANAGE), "llmgw", "agent", "--server", self.url, "--state-dir", str(agent.state_dir),
             "--memory", agent.memory, "--gpus", "none", "--port-range", agent.port_range, "--stop-timeout", "5"],
            env=env,
        )
        return agent.proc

    def wait_nodes_connected(self, names, timeout: float = 30.0) -> None:
        def connected():
            nodes = {n["name"]: n for n in self.api_retrying("GET", "/api/v1/nodes/").json()["results"]}
            return all(nodes.get(n, {}).get("connected") for n in names)

        wait_for(connected, timeout, what=f"nodes {names} connected")

    def wait_ready(self, model: str, count: int, timeout: float = 60.0) -> list[dict]:
        def ready():
            reps = self.replicas(model)
            ok = [r for r in reps if r["state"] == "ready"]
            return ok if len(ok) == count and len(reps) == count else None

        try:
            return wait_for(ready, timeout, what=f"{count} ready replica(s) of {model}")
        except AssertionError:
            raise AssertionError(f"{self.replicas(model)}\n{self.diagnostics()}") from None

    def engine_pid(self, replica: dict) -> int:
        return int(replica["pid"])

    def diagnostics(self) -> str:
        parts = [f"--- {p.name} ({'alive' if p.alive() else f'exit {p.returncode}'})\n{p.tail(25)}" for p in self.procs.values()]
        return "\n".join(parts)

    def stop(self) -> None:
        self.supervisor.stop_thread()
        for agent in self.agents.values():
            if agent.proc:
                agent.proc.stop()
        for name in ("beat", "worker", "web"):
            if name in self.procs:
                self.procs[name].stop()
        for agent in self.agents.values():
            stop_recorded_engines(agent.state_dir, timeout=2)
        for proc in self.procs.values():
            proc.stop(signal.SIGKILL, 5)
        if self._dropdb:
            import psycopg

            admin_url, name = self._dropdb
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


BOOTSTRAP = """
from django.core.management import call_command
call_command("migrate", verbosity=0)
from cluster.models import ClusterSettings
ClusterSettings.load()
ClusterSettings.objects.update(reconcile_interval_seconds=1)
from cluster.operations.users import add_user
user, token = add_user("admin", "admin", "cli", password="admin-password")
print("admin token", token)
"""


def start_system(home: Path, extra_env: dict | None = None, redis_db: int = 3, host: str = "127.0.0.1",
                 database_url: str | None = None, redis_url: str | None = None) -> System:
    """Migrate a fresh database, then start web, worker and beat. Agents are added by the tests. The web process
    listens on `host` (loopback; a test network's bridge for agents in namespaces). `database_url` (a PostgreSQL
    server's, where the run's database is made) and `redis_url` stand for DATABASE_URL and REDIS_URL: servers of
    the test's own, which it may restart."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_SETTINGS"))}
    env.update(
        LLMGW_HOME=str(home),
        DJANGO_SETTINGS_MODULE="llmgw.settings",
        PYTHONUNBUFFERED="1",
        LLMGW_NODE_TOLERANCE="6",
        LLMGW_NODE_LOST_GRACE="8",
        LLMGW_AGENT_REPORT_INTERVAL="1",
        LLMGW_BACKOFF_BASE="1",
        LLMGW_LOG_LEVEL="INFO",
        LLMGW_ENGINE_HOST="127.0.0.1",  # test engines listen on loopback only
    )
    env.update(extra_env or {})
    dropdb = None
    if (database_url or os.environ.get("DATABASE_URL", "")).startswith(("postgres", "postgresql")):
        import psycopg

        name = "llmgw_it_" + secrets.token_hex(4)
        admin_url = database_url or os.environ["DATABASE_URL"]
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        env["DATABASE_URL"] = _with_db(admin_url, name)
        dropdb = (admin_url, name)
    else:
        env["DATABASE_URL"] = f"sqlite:///{home / 'db.sqlite3'}"
    # Our own Redis db, so the in-process tests' flushes never touch the running system.
    env["REDIS_URL"] = _redis_db(redis_url or os.environ["REDIS_URL"], redis_db)
    system = System(home=home, env=env, port=free_port(), _dropdb=dropdb, host=host)
    env.setdefault("LLMGW_CONTROL_PLANE_URL", system.url)  # as `llmgw up` sets it: where peers fetch model files
    try:
        flush_redis(env["REDIS_URL"])
        # One process: migrate; the reconciler every second instead of every 5 (the cluster setting the
        # dashboard's Settings page changes: drains and hand-overs finish within a second of going idle, which
        # keeps the suite short); the admin whose token the tests act with.
        made = subprocess.run(
            [sys.executable, str(MANAGE), "shell", "-c", BOOTSTRAP], env=env, cwd=ROOT, capture_output=True,
            text=True, timeout=300,
        )
        assert made.returncode == 0, made.stderr
        system.admin_token = made.stdout.strip().split()[-1]
        py = sys.executable
        system.spawn("web", web_argv(host, system.port, env.get("LLMGW_WEB_SERVER") or None))
        system.spawn("worker", [py, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "-c", "1",
                                "--without-gossip", "--without-mingle", "-n", f"it-{system.port}@%h"])
        system.spawn("beat", [py, "-m", "celery", "-A", "llmgw", "beat", "-l", "info",
                              "-s", str(home / "celerybeat-schedule")])
        wait_for(lambda: _http_ok(system.url + "/login/"), 60, what="web to answer")
    except BaseException:
        print(system.diagnostics())
        system.stop()
        raise
    return system


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def add_test_engine(system: System, name: str = "testengine", args: str = "--load-seconds 1") -> None:
    system.cli(
        "ctl", "engine", "add", name, "--kind", "command",
        "--command", f"{{python}} {TEST_ENGINE} --host {{host}} --port {{port}} --model-path {{model_path}} {args}",
    )


def make_model_file(system: System, name: str = "tiny.bin", size: int = 2 * MiB) -> str:
    path = system.home / name
    path.write_bytes(os.urandom(size))
    out = system.cli("mirror", "import", str(path)).stdout
    return out.split("sha256 ")[1].split(",")[0]


def start_web(system: System, name: str = "web2", server: str | None = None) -> str:
    """Another web process (uvicorn or daphne; default: as LLMGW_WEB_SERVER) on the same database, Redis and
    settings, on the same address; returns its URL."""
    port = free_port()
    system.spawn(name, web_argv(system.host, port, server))
    url = f"http://{system.host}:{port}"
    wait_for(lambda: _http_ok(url + "/login/"), 60, what=f"{name} to answer")
    return url


def nginx_conf(prefix: Path, http: str, error_log_level: str = "warn", connections: int = 1024) -> Path:
    """A whole nginx.conf for nginx run as our own child (`daemon off`, one worker, every path under `prefix`),
    around the `http` block's contents. Also what bench/gateway.py runs nginx with."""
    (prefix / "temp").mkdir(parents=True, exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log {error_log_level};
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/temp/body;
    proxy_temp_path {prefix}/temp/proxy;
    fastcgi_temp_path {prefix}/temp/fastcgi;
    uwsgi_temp_path {prefix}/temp/uwsgi;
    scgi_temp_path {prefix}/temp/scgi;
{http}
}}
"""
    )
    return conf


def nginx_conf_from_docs(upstreams: list[str], port: int) -> str:
    """The nginx configuration docs/gateway.md ("Behind a proxy") tells operators to use, for these web processes
    (host:port) and this port: the test runs the advice itself, not a copy of it."""
    page = (ROOT / "docs" / "gateway.md").read_text()
    section = page.split("\n## Behind a proxy\n", 1)
    assert len(section) == 2, "docs/gateway.md has no section 'Behind a proxy'"
    match = re.search(r"```nginx\n(.*?)```", section[1], re.S)
    assert match, "docs/gateway.md's nginx configuration block is gone"
    conf = match.group(1)
    servers = re.findall(r"^ *server \S+:\d+ max_fails=0;\n", conf, re.M)
    assert servers, "docs/gateway.md's upstream lists no server"
    ours = "".join(f"    server {u} max_fails=0;\n" for u in upstreams)
    conf = conf.replace("".join(servers), ours)
    assert "listen 80;" in conf
    return conf.replace("listen 80;", f"listen 127.0.0.1:{port};")


def start_nginx(system: System, upstreams: list[str], name: str = "nginx") -> tuple[str, Child]:
    """Debian's nginx (bin/setup-debian installs it) in front of these web processes, configured as docs/gateway.md
    says, as our own child (`daemon off`); returns its URL and the process, whose error log says each retry."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    assert os.path.exists(binary), "Debian's nginx is missing: ./llmgw-test installs it (bin/setup-debian)"
    port = free_port()
    conf = nginx_conf(system.home / name, nginx_conf_from_docs([u.removeprefix("http://") for u in upstreams], port),
                      error_log_level="info")
    prefix = conf.parent
    child = system.spawn(name, [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e",
                                str(prefix / "error.log")])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _http_ok(url + "/login/"), 30, what=f"{name} to answer")
    return url, child
