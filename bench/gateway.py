#!/usr/bin/env python
"""Gateway benchmark: one fake engine reached directly, through llmgw, through nginx and through LiteLLM.

    . .venv/bin/activate
    python bench/gateway.py                       # everything: about 3 to 5 minutes
    python bench/gateway.py --targets direct,llmgw-daphne --concurrency 1,16 --modes json

One run, side by side on this machine, against the same fake OpenAI engine (bench/fake_upstream.py: answers at
once, streams --chunks chunks, then the usage chunk and [DONE]):

- direct          the fake engine itself;
- llmgw-daphne    llmgw's gateway, run as `llmgw up` runs it by default (`python -m daphne -b 127.0.0.1 -p PORT
                  llmgw.asgi:application`), on a real llmgw instance this script sets up: a temporary LLMGW_HOME,
                  SQLite, the embedded Valkey (or REDIS_URL), `manage.py migrate`, a node at 127.0.0.1, a model
                  `bench` and a READY replica on the fake engine's port whose snapshot carries the engine key's
                  fingerprint, and a client key from `manage.py llmgw ctl keys create`. No Celery: with no
                  reconciler running nothing changes the rows;
- llmgw-uvicorn   the same application under uvicorn with uvloop and httptools, as `llmgw up --server uvicorn`
                  runs it;
- nginx           Debian's nginx (apt-get installs it when missing), `proxy_pass` to a keepalive upstream,
                  `proxy_buffering off`, one worker, run as our child with its own config, `daemon off`;
- litellm         LiteLLM's proxy, `litellm[proxy]==1.108.7` in its own virtual environment (made when missing,
                  under ~/.cache/llmgw-bench or LLMGW_BENCH_CACHE), LITELLM_LOCAL_MODEL_COST_MAP=True, a master
                  key, one worker, the model `bench` mapped to `openai/bench` with the fake engine as `api_base`.

Each is measured at each concurrency (default 1, 16, 64), non-streaming (json) and streaming (stream), with a
fixed number of requests per cell (300 at concurrency 1, 1000 up to 16, 2000 above; --scale) after a warm-up,
each cell bounded in time (--time-limit, default 30 s: a cell that hits it is flagged `!` and counts what it
finished). All targets run at once and every cell runs each target in turn, so whatever else the machine does
falls on all of them alike; that is done --rounds times (default 3) and the table shows each cell's fastest
round (highest req/s: on a shared machine, the least disturbed one) with every round's req/s in its last column. Every request asks for the usage
chunk (`stream_options.include_usage`), so every target sends the same events. The load generator is a raw
asyncio HTTP/1.1 client with keep-alive connections (one per concurrent request), in this process; the
`direct` rows show how far it and the fake engine go, which must be well past what any proxy does.

With two or more CPUs the proxies are pinned to the last CPU and everything else (this process, the fake
engine, Valkey) to the others (--no-pin to let the kernel place them): every proxy gets one core, as one web
process does, and idles while another is measured.

Columns: req/s, p50 and p99 of the whole request, p50 time to the first body byte (ttfc, streams), each also
as a ratio to `direct` in the same cell, and +p50, the added p50 latency (target minus direct). p99 is nearest
rank. The two targets of issue 3 are checked below the table: added p50 at concurrency 1 under 2 ms, and
llmgw's req/s at concurrency 64 at least twice LiteLLM's. No time is asserted; the exit code is 0 whatever the
numbers are (non-zero only when nothing could be measured, or on Ctrl-C). Every child process is stopped at
the end and the last line says whether any is left.

--py-spy BIN records each Python proxy for the whole run (py-spy's raw folded stacks, one file per target in
--profile-dir), for a flame graph or a quick sort of where the time goes. py-spy is not a requirement: install it
in a throwaway venv (`python -m venv /tmp/spy && /tmp/spy/bin/pip install py-spy`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import math
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "bench" / "fake_upstream.py"
LITELLM_VERSION = "1.108.7"
MODEL = "bench"
RESULT_MARK = "BENCH-RESULT "
ALL_TARGETS = ("direct", "llmgw-daphne", "llmgw-uvicorn", "nginx", "litellm")
ADDED_P50_TARGET_MS = 2.0
LITELLM_RATIO_TARGET = 2.0


def say(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the load generator ---------------------------------------------------------------------------------


class ClientConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time; parses Content-Length, chunked and
    until-close bodies, and notes when the first body byte came."""

    HEAD, LENGTH, CHUNKED, UNTIL_CLOSE = range(4)

    def __init__(self):
        self.transport = None
        self.future: asyncio.Future | None = None
        self.closed = False
        self.state = self.HEAD

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        future = self.future
        if future is not None and not future.done():
            if self.state == self.UNTIL_CLOSE:
                self._finish(time.perf_counter(), close=True)
            else:
                future.set_exception(ConnectionError(f"connection closed mid-answer ({exc or 'EOF'})"))

    def request(self, data: bytes) -> asyncio.Future:
        self.future = asyncio.get_running_loop().create_future()
        self.buffer = bytearray()
        self.body = bytearray()
        self.state = self.HEAD
        self.first: float | None = None
        self.status = 0
        self.close_after = False
        self.pos = 0
        self.transport.write(data)
        return self.future

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        future = self.future
        if future is None or future.done():
            return
        self.buffer += data
        if self.state == self.HEAD:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            del self.buffer[: end + 4]
            try:
                self.status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                future.set_exception(ConnectionError(f"bad status line {lines[0][:80]!r}"))
                self.transport.close()
                return
            if 100 <= self.status < 200:  # an interim answer: the real one follows
                self.state = self.HEAD
                return self.data_received(b"") if self.buffer else None
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip().lower()
            self.close_after = headers.get(b"connection") == b"close"
            if b"chunked" in headers.get(b"transfer-encoding", b""):
                self.state = self.CHUNKED
            elif b"content-length" in headers:
                self.state = self.LENGTH
                self.length = int(headers[b"content-length"])
            else:
                self.state = self.UNTIL_CLOSE
                self.close_after = True
        if self.first is None and self.buffer:
            self.first = now
        if self.state == self.LENGTH:
            if len(self.buffer) >= self.length:
                self.body = self.buffer[: self.length]
                self._finish(now)
        elif self.state == self.CHUNKED:
            buffer = self.buffer
            while True:
                eol = buffer.find(b"\r\n", self.pos)
                if eol < 0:
                    return
                size = int(bytes(buffer[self.pos : eol]).split(b";")[0], 16)
                if size == 0:
                    if buffer.find(b"\r\n\r\n", self.pos) < 0:
                        return
                    self._finish(now)
                    return
                if len(buffer) < eol + 2 + size + 2:
                    return
                self.body += buffer[eol + 2 : eol + 2 + size]
                self.pos = eol + 2 + size + 2
        elif self.state == self.UNTIL_CLOSE:
            self.body = self.buffer

    def _finish(self, now: float, close: bool = False) -> None:
        self.future.set_result((self.status, self.first or now, now, bytes(self.body), self.close_after or close))


@dataclass
class Cell:
    target: str
    server: str
    concurrency: int
    mode: str
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    timed_out: bool = False
    cpu: float = 0.0  # CPU seconds the target's processes used while measured
    rounds: list[float] = field(default_factory=list)  # req/s of every round of this cell, in order

    @property
    def cpu_ms(self) -> float:
        return self.cpu / self.ok * 1000 if self.ok and self.cpu else math.nan

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def p(self, q: float, samples: list[float] | None = None) -> float:
        samples = self.latencies if samples is None else samples
        if not samples:
            return math.nan
        ordered = sorted(samples)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000

    def summary(self) -> dict:
        return {
            "target": self.target, "server": self.server, "concurrency": self.concurrency, "mode": self.mode,
            "ok": self.ok, "errors": self.errors, "first_error": self.first_error, "seconds": round(self.seconds, 3),
            "rps": round(self.rps, 1), "p50_ms": round(self.p(0.5), 3), "p99_ms": round(self.p(0.99), 3),
            "ttfc_p50_ms": round(self.p(0.5, self.firsts), 3) if self.mode == "stream" else None,
            "timed_out": self.timed_out, "cpu_ms_per_request": round(self.cpu_ms, 3),
            "rounds_rps": [round(r, 1) for r in self.rounds],
        }


def build_request(port: int, key: str, stream: bool, path: str = "/v1/chat/completions") -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello, briefly."}], "max_tokens": 32}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nAccept: */*\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def answer_ok(status: int, body: bytes, stream: bool) -> str:
    """'' when the answer is a right one, else why not."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    if stream:
        if b"data: [DONE]" not in body:
            return f"stream without [DONE]: {body[-200:]!r}"
        if b'"usage"' not in body:
            return "stream without the usage chunk"
        return ""
    return "" if b'"choices"' in body and b'"usage"' in body else f"no choices/usage in {body[:200]!r}"


async def run_cell(cell: Cell, port: int, request: bytes, count: int, warmup: int, limit: float, cpu=None) -> Cell:
    loop = asyncio.get_running_loop()
    stream = cell.mode == "stream"
    conns: list[ClientConnection | None] = [None] * cell.concurrency

    async def connect() -> ClientConnection:
        _, conn = await loop.create_connection(ClientConnection, "127.0.0.1", port)
        return conn

    async def phase(n: int, record: bool, deadline: float) -> None:
        left = [n]

        async def worker(slot: int) -> None:
            while left[0] > 0 and time.perf_counter() < deadline:
                left[0] -= 1
                conn = conns[slot]
                try:
                    if conn is None or conn.closed:
                        conn = conns[slot] = await connect()
                    t0 = time.perf_counter()
                    status, first, end, body, close = await conn.request(request)
                except (OSError, ConnectionError) as exc:
                    if record:
                        cell.errors += 1
                        cell.first_error = cell.first_error or f"{type(exc).__name__}: {exc}"
                    if conns[slot] is not None:
                        conns[slot].transport.close()
                    conns[slot] = None
                    await asyncio.sleep(0.01)
                    continue
                if close:
                    conn.transport.close()
                    conns[slot] = None
                if not record:
                    continue
                why = answer_ok(status, body, stream)
                if why:
                    cell.errors += 1
                    cell.first_error = cell.first_error or why
                else:
                    cell.ok += 1
                    cell.latencies.append(end - t0)
                    cell.firsts.append(first - t0)

        tasks = [loop.create_task(worker(i)) for i in range(cell.concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()) + 30)
        for task in pending:
            task.cancel()
        if pending:
            cell.timed_out = True
            await asyncio.wait(pending)
        if record and left[0] > 0:
            cell.timed_out = True

    gc.collect()
    gc.disable()
    try:
        await phase(warmup, False, time.perf_counter() + limit)
        cpu0 = cpu() if cpu else 0.0
        t0 = time.perf_counter()
        await phase(count, True, t0 + limit)
        cell.seconds += time.perf_counter() - t0
        cell.cpu += (cpu() - cpu0) if cpu else 0.0
    finally:
        gc.enable()
        for conn in conns:
            if conn is not None and conn.transport is not None:
                conn.transport.close()
    return cell


def requests_for(concurrency: int, scale: float) -> int:
    base = 300 if concurrency <= 1 else 1000 if concurrency <= 16 else 2000
    return max(concurrency * 4, int(base * scale))


# --- child processes ------------------------------------------------------------------------------------


class Children:
    """Every process this run starts, each in its own session (so its whole group can be stopped by its id)."""

    def __init__(self, workdir: Path, proxy_cpus: set[int] | None):
        self.workdir = workdir
        self.proxy_cpus = proxy_cpus
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None, proxy: bool = False, cwd=None) -> subprocess.Popen:
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
        cpus = self.proxy_cpus if proxy else None

        def pin():
            if cpus:
                os.sched_setaffinity(0, cpus)

        proc = subprocess.Popen(
            argv, env=env, cwd=cwd or ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=pin,
        )
        log.close()
        self.procs[name] = proc
        self.logs[name] = log_path
        return proc

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])
        except (KeyError, OSError):
            return ""

    def stop(self, name: str, timeout: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # the group we made for it: it and whatever it started
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                # the leader is gone; its group may not be (workers): give them the same signal
                deadline = time.monotonic() + wait
                while _group_alive(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not _group_alive(proc.pid):
                    break
            except subprocess.TimeoutExpired:
                continue

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def strays() -> list[str]:
    """Our own processes still running (there should be none at the end)."""
    try:
        import psutil
    except ImportError:
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip() and "ps -o" not in line]
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
        except psutil.Error:
            pass
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (nginx's worker), 0 when unknown."""
    try:
        import psutil
    except ImportError:
        return 0.0
    total = 0.0
    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def wait_ready(children: Children, name: str, port: int, key: str, timeout: float, path: str = "/v1/chat/completions") -> None:
    """Until a real request through `name` answers 200 (or the process dies, or the time is up)."""
    payload = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        proc = children.procs.get(name)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{children.tail(name)}")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=payload, method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if response.status == 200 and b"choices" in response.read():
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:300]!r}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise RuntimeError(f"{name} did not answer within {timeout:.0f}s ({last}):\n{children.tail(name)}")


# --- what the targets need ------------------------------------------------------------------------------


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


def nginx_binary(install: bool) -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found or not install:
        if not found:
            raise RuntimeError("nginx is not installed (run without --no-install, or apt-get install nginx)")
        return found
    if os.geteuid() != 0:
        raise RuntimeError("nginx is not installed and this is not root: apt-get install nginx first")
    say("installing Debian's nginx (apt-get install -y nginx)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Keep the package from starting its own nginx on port 80: a policy-rc.d that says no, for the install only.
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    try:
        result = run(["apt-get", "install", "-y", "--no-install-recommends", "nginx"], env=env)
        if result.returncode != 0:
            say("apt-get install failed; apt-get update, then again")
            run(["apt-get", "update"], env=env)
            result = run(["apt-get", "install", "-y", "--no-install-recommends", "nginx"], env=env)
        if result.returncode != 0:
            raise RuntimeError(f"apt-get install nginx failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    return shutil.which("nginx") or "/usr/sbin/nginx"


def litellm_venv(install: bool) -> Path:
    base = Path(os.environ.get("LLMGW_BENCH_CACHE") or Path.home() / ".cache" / "llmgw-bench")
    venv = base / f"litellm-{LITELLM_VERSION}"
    exe = venv / "bin" / "litellm"
    if exe.exists() and run([str(venv / "bin" / "python"), "-c", "import litellm.proxy.proxy_server"]).returncode == 0:
        return venv
    if not install:
        raise RuntimeError(f"no LiteLLM {LITELLM_VERSION} venv at {venv} (run without --no-install)")
    say(f"making LiteLLM's venv at {venv} (pip install 'litellm[proxy]=={LITELLM_VERSION}'; a minute or two)")
    base.mkdir(parents=True, exist_ok=True)
    for argv in (
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
    ):
        result = run(argv)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return venv


def module_version(python: str, module: str) -> str:
    result = run([python, "-c", f"import importlib.metadata as m; print(m.version({module!r}))"])
    return result.stdout.strip() if result.returncode == 0 else "-"


def importable(python: str, module: str) -> bool:
    return run([python, "-c", f"import {module}"]).returncode == 0


# --- llmgw: a real instance, set up from nothing ---------------------------------------------------------


def setup_child(upstream_port: int) -> None:
    """In a child with LLMGW_HOME and friends set: the rows the gateway routes by. Prints the engine key."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    import django

    django.setup()
    from django.utils import timezone

    from cluster.models import ClusterSettings, EngineVersion, Model, ModelFile, Node, Profile, Replica

    gib = 1024**3
    now = timezone.now()
    cluster = ClusterSettings.load()  # makes the engine key, as a real cluster has one
    engine = EngineVersion.objects.get(name="xllamacpp")  # from migration 0002
    profile = Profile.objects.get(name="default")
    file = ModelFile.objects.create(
        sha256=hashlib.sha256(b"bench/gateway.py").hexdigest(), name="bench.gguf", size=gib, format="gguf", gguf={}
    )
    node = Node.objects.create(
        name="bench-node", token_hash=Node.hash_token(Node.new_token()), address="127.0.0.1",
        facts={"cpu_count": os.cpu_count(), "memory_bytes": 16 * gib, "gpus": [], "engines": {"xllamacpp": ""},
               "port_range": [upstream_port, upstream_port], "hostname": socket.gethostname()},
        memory_bytes=16 * gib, connected=True, last_seen=now,
    )
    model = Model.objects.create(name=MODEL, file=file, engine=engine, profile=profile, replicas=1, memory_bytes=gib)
    Replica.objects.create(
        name=Replica.new_name(MODEL), model=model, node=node, state=Replica.State.READY, port=upstream_port,
        memory_bytes=gib, state_changed_at=now,
        snapshot={"profile": profile.name, "args": profile.args(), "engine": engine.spec(), "file": file.sha256,
                  "engine_key": ClusterSettings.fingerprint(cluster.engine_key)},
    )
    print(RESULT_MARK + json.dumps({"engine_key": cluster.engine_key}), flush=True)


def setup_llmgw(home: Path, env: dict, upstream_port: int) -> tuple[str, str]:
    """migrate, the rows, a client key: (engine key, client key)."""
    py = sys.executable
    manage = str(ROOT / "manage.py")
    steps = [
        ("migrate", [py, manage, "migrate", "--no-input", "-v", "0"]),
        ("rows", [py, str(Path(__file__).resolve()), "--setup-llmgw", str(upstream_port)]),
        ("key", [py, manage, "llmgw", "ctl", "keys", "create", "bench"]),
    ]
    out = {}
    for name, argv in steps:
        result = run(argv, env=env, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"llmgw setup step {name} failed ({' '.join(argv)}):\n{result.stdout}\n{result.stderr}")
        out[name] = result.stdout
    engine_key = next(json.loads(line[len(RESULT_MARK):]) for line in out["rows"].splitlines() if line.startswith(RESULT_MARK))["engine_key"]
    match = re.search(r"(sk-\S+)\s*$", out["key"].strip())
    if not match:
        raise RuntimeError(f"no key in the output of `ctl keys create`: {out['key']!r}")
    return engine_key, match.group(1)


# --- nginx and LiteLLM configs --------------------------------------------------------------------------


def nginx_conf(workdir: Path, port: int, upstream_port: int) -> Path:
    prefix = workdir / "nginx"
    for sub in ("", "temp"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/temp/body;
    proxy_temp_path {prefix}/temp/proxy;
    fastcgi_temp_path {prefix}/temp/fastcgi;
    uwsgi_temp_path {prefix}/temp/uwsgi;
    scgi_temp_path {prefix}/temp/scgi;
    upstream engine {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""
    )
    return conf


def litellm_config(workdir: Path, upstream_port: int, engine_key: str, master_key: str) -> Path:
    path = workdir / "litellm.yaml"
    path.write_text(
        f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: {engine_key}
general_settings:
  master_key: {master_key}
litellm_settings:
  telemetry: false
"""
    )
    return path


# --- the table ------------------------------------------------------------------------------------------


def fmt(value: float, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def ratio(value: float, base: float) -> str:
    if value is None or base is None or not base or math.isnan(value) or math.isnan(base):
        return "-"
    return f"{value / base:.2f}x"


def print_table(cells: list[Cell], order: list[tuple[str, str]]) -> None:
    by_key = {(c.target, c.server, c.concurrency, c.mode): c for c in cells}
    header = ["mode", "conc", "target", "server", "req/s", "x direct", "p50 ms", "x direct", "p99 ms", "x direct",
              "ttfc p50", "x direct", "+p50 ms", "cpu ms/req", "ok", "err", "req/s of each round"]
    rows = []
    modes = [m for m in ("json", "stream") if any(c.mode == m for c in cells)]
    concs = sorted({c.concurrency for c in cells})
    for mode in modes:
        for conc in concs:
            direct = by_key.get(("direct", "fake", conc, mode))
            for target, server in order:
                cell = by_key.get((target, server, conc, mode))
                if cell is None:
                    continue
                p50, p99 = cell.p(0.5), cell.p(0.99)
                ttfc = cell.p(0.5, cell.firsts) if mode == "stream" else math.nan
                d = direct
                rows.append([
                    mode, str(conc), target.split("-")[0], server,
                    fmt(cell.rps, 0), ratio(cell.rps, d.rps) if d else "-",
                    fmt(p50), ratio(p50, d.p(0.5)) if d else "-",
                    fmt(p99), ratio(p99, d.p(0.99)) if d else "-",
                    fmt(ttfc), ratio(ttfc, d.p(0.5, d.firsts)) if d and mode == "stream" else "-",
                    fmt(p50 - d.p(0.5)) if d and cell is not d else "-",
                    fmt(cell.cpu_ms, 3),
                    str(cell.ok), str(cell.errors) + ("!" if cell.timed_out else ""),
                    "/".join(f"{r:.0f}" for r in cell.rounds),
                ])
        rows.append(None)
    widths = [max(len(header[i]), *(len(r[i]) for r in rows if r)) for i in range(len(header))]
    left = {0, 2, 3, 16}

    def line(values):
        return "  ".join(v.ljust(widths[i]) if i in left else v.rjust(widths[i]) for i, v in enumerate(values)).rstrip()

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows[:-1]:
        print(line(r) if r else "")


def print_targets(cells: list[Cell], servers: list[str]) -> None:
    by_key = {(c.target, c.server, c.concurrency, c.mode): c for c in cells}
    print("\nTargets (issue 3):")
    for mode in ("json", "stream"):
        direct = by_key.get(("direct", "fake", 1, mode))
        for server in servers:
            gw = by_key.get((f"llmgw-{server}", server, 1, mode))
            if direct and gw and gw.ok and direct.ok:
                added = gw.p(0.5) - direct.p(0.5)
                verdict = "met" if added < ADDED_P50_TARGET_MS else "MISSED"
                print(f"  added p50 at concurrency 1, {mode:6s} llmgw/{server:8s}: {added:6.2f} ms "
                      f"(target < {ADDED_P50_TARGET_MS:g} ms: {verdict})")
    for mode in ("json", "stream"):
        lite = by_key.get(("litellm", "uvicorn", 64, mode))
        for server in servers:
            gw = by_key.get((f"llmgw-{server}", server, 64, mode))
            if lite and gw and lite.rps:
                r = gw.rps / lite.rps
                verdict = "met" if r >= LITELLM_RATIO_TARGET else "MISSED"
                print(f"  req/s at concurrency 64, {mode:6s} llmgw/{server:8s} / LiteLLM: {gw.rps:7.0f} / {lite.rps:7.0f}"
                      f" = {r:5.2f}x (target >= {LITELLM_RATIO_TARGET:g}x: {verdict})")


# --- the run --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(ALL_TARGETS), help=f"comma-separated, of {', '.join(ALL_TARGETS)}")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--modes", default="json,stream")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per streamed answer")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the request counts per cell (300 at c=1, 1000 up to c=16, 2000 above)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every cell this many times, interleaved; the table shows the fastest round")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds at most per cell (and per warm-up)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the proxy to its own CPU")
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing nginx, uvicorn, LiteLLM")
    parser.add_argument("--py-spy", metavar="BIN", help="record each Python proxy with this py-spy (raw folded stacks)")
    parser.add_argument("--profile-dir", metavar="DIR", default="bench-profiles", help="where --py-spy writes (default ./bench-profiles)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, configs)")
    parser.add_argument("--json", metavar="FILE", help="also write every cell's numbers to FILE")
    parser.add_argument("--setup-llmgw", type=int, metavar="UPSTREAM_PORT", help=argparse.SUPPRESS)
    o = parser.parse_args(argv)
    if o.setup_llmgw:
        setup_child(o.setup_llmgw)
        return 0

    targets = [t.strip() for t in o.targets.split(",") if t.strip()]
    unknown = set(targets) - set(ALL_TARGETS)
    if unknown:
        parser.error(f"unknown targets {', '.join(sorted(unknown))}")
    if "direct" not in targets:
        targets.insert(0, "direct")  # the baseline of every ratio
    targets = [t for t in ALL_TARGETS if t in targets]
    concurrencies = [int(c) for c in o.concurrency.split(",") if c.strip()]
    modes = [m.strip() for m in o.modes.split(",") if m.strip()]
    if set(modes) - {"json", "stream"}:
        parser.error("--modes takes json and/or stream")

    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus = None
    if not o.no_pin and len(cpus) >= 2:
        proxy_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # this process and what it starts, but for the proxies

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-gateway-"))
    children = Children(workdir, proxy_cpus)
    valkey = None
    cells: dict[tuple, list[Cell]] = {}  # every round of every cell
    running: list[tuple[str, str, int, str]] = []  # target, server, port, key
    info: dict[str, str] = {}
    failures: list[str] = []
    interrupted = False

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        install = not o.no_install
        upstream_port = free_port()
        engine_key = client_key = None
        env = None
        if any(t.startswith("llmgw") for t in targets):
            home = workdir / "llmgw-home"
            home.mkdir()
            env = dict(os.environ, LLMGW_HOME=str(home), DATABASE_URL=f"sqlite:///{home / 'db.sqlite3'}",
                       PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="llmgw.settings")
            env.pop("LLMGW_DEBUG", None)
            if os.environ.get("REDIS_URL"):
                info["redis"] = f"{os.environ['REDIS_URL']} (REDIS_URL)"
            else:
                sys.path.insert(0, str(ROOT))
                from llmgw.valkey import EmbeddedValkey

                valkey = EmbeddedValkey(workdir / "valkey")
                env["REDIS_URL"] = valkey.start()
                info["redis"] = "embedded Valkey"
            say("setting up llmgw: migrate, node/model/replica rows, a client key")
            engine_key, client_key = setup_llmgw(home, env, upstream_port)
        engine_key = engine_key or "lek_" + secrets.token_urlsafe(32)

        children.start("fake-upstream", [sys.executable, str(FAKE), "--port", str(upstream_port), "--key", engine_key,
                                         "--chunks", str(o.chunks)])
        wait_ready(children, "fake-upstream", upstream_port, engine_key, 15)
        info["fake engine loop"] = "uvloop" if importable(sys.executable, "uvloop") else "asyncio"

        def start_llmgw(target: str, server: str):
            port = free_port()
            sys.path.insert(0, str(ROOT))
            from llmgw.web import web_argv  # exactly what `llmgw up --server SERVER` runs

            children.start(target, web_argv("127.0.0.1", port, server), env, proxy=True)
            wait_ready(children, target, port, client_key, 60)
            return port, client_key

        def start_nginx(target: str, server: str):
            binary = nginx_binary(install)
            info["nginx"] = run([binary, "-v"]).stderr.strip().split("/")[-1] or "?"
            port = free_port()
            conf = nginx_conf(workdir, port, upstream_port)
            children.start(target, [binary, "-p", str(conf.parent), "-c", str(conf)], proxy=True)
            wait_ready(children, target, port, engine_key, 15)
            return port, engine_key

        def start_litellm(target: str, server: str):
            venv = litellm_venv(install)
            port = free_port()
            master = "sk-bench-master-" + secrets.token_hex(8)
            config = litellm_config(workdir, upstream_port, engine_key, master)
            lenv = {k: v for k, v in os.environ.items()
                    if not k.startswith(("DATABASE_URL", "REDIS_", "LITELLM_", "OPENAI_", "DJANGO_", "LLMGW_"))}
            lenv.update(LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1",
                        PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}")
            children.start(target, [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
                                    "--port", str(port), "--num_workers", "1"], lenv, proxy=True, cwd=workdir)
            wait_ready(children, target, port, master, 180)
            info["litellm"] = module_version(str(venv / "bin" / "python"), "litellm")
            return port, master

        starters = {"llmgw-daphne": ("daphne", start_llmgw), "llmgw-uvicorn": ("uvicorn", start_llmgw),
                    "nginx": ("nginx", start_nginx), "litellm": ("uvicorn", start_litellm)}
        running.append(("direct", "fake", upstream_port, engine_key))
        for target in targets[1:]:
            server, start = starters[target]
            say(f"{target}: starting")
            try:
                port, key = start(target, server)
            except Exception as exc:
                failures.append(f"{target}: {exc}")
                say(f"{target}: could not start: {str(exc).splitlines()[0]}")
                children.stop(target)
                continue
            running.append((target, server, port, key))
            if o.py_spy and target != "nginx":
                Path(o.profile_dir).mkdir(parents=True, exist_ok=True)
                out = Path(o.profile_dir).resolve() / f"{target}.txt"
                children.start(f"py-spy-{target}", [o.py_spy, "record", "--pid", str(children.procs[target].pid), "--rate", "250",
                                                    "--nonblocking", "--format", "raw", "-o", str(out)])
                info.setdefault("profiles", str(Path(o.profile_dir).resolve()))

        # Every cell runs each target in turn, so whatever else the machine does falls on all of them alike.
        for mode in modes:
            for conc in concurrencies:
                count = requests_for(conc, o.scale)
                warmup = max(2 * conc, min(200, count // 5))
                for round_ in range(o.rounds):
                    for target, server, port, key in running:
                        cell = Cell(target, server, conc, mode)
                        cells.setdefault((target, server, conc, mode), []).append(cell)
                        request = build_request(port, key, mode == "stream")
                        name = "fake-upstream" if target == "direct" else target
                        pid = children.procs[name].pid
                        asyncio.run(run_cell(cell, port, request, count, warmup if round_ == 0 else 2 * conc,
                                             o.time_limit, lambda: cpu_seconds(pid)))
                        say(f"{target:14s} {mode:6s} c={conc:<3d} round {round_ + 1}: {cell.rps:8.0f} req/s  "
                            f"p50 {fmt(cell.p(0.5))} ms  ok {cell.ok}  errors {cell.errors}"
                            + (" (time limit)" if cell.timed_out else ""))
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: stopping what this run started")
    finally:
        for target, *_ in running[1:][::-1]:
            children.stop(target)
        for name in [n for n in children.procs if n.startswith("py-spy-")]:
            try:
                children.procs[name].wait(30)  # py-spy writes its file when the process it records ends
            except subprocess.TimeoutExpired:
                pass
        children.stop_all()
        if valkey is not None:
            valkey.stop()
        load_after = os.getloadavg()
        left = strays()
        if o.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    if not cells:
        print("no cell was measured", file=sys.stderr)
        for failure in failures:
            print(failure, file=sys.stderr)
        return 1
    best = []  # per cell, the fastest round: on a shared machine, the least disturbed one
    for rounds in cells.values():
        pick = max(rounds, key=lambda c: (c.rps, -c.errors))
        pick.rounds = [c.rps for c in rounds]
        best.append(pick)
    order = [(t, s) for t, s, _, _ in running]
    servers = [s for t, s in order if t.startswith("llmgw-")]
    print(f"\nbench/gateway.py on {platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {time.monotonic() - started:.0f} s, "
          f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after")
    print(f"  pinning: {'proxy on CPU ' + ','.join(map(str, sorted(proxy_cpus))) + '; client, fake engine, Valkey on CPU ' + ','.join(map(str, cpus[:-1])) if proxy_cpus else 'none'}")
    print(f"  daphne {module_version(sys.executable, 'daphne')}, uvicorn {module_version(sys.executable, 'uvicorn')} "
          f"(uvloop {'yes' if importable(sys.executable, 'uvloop') else 'no'}, "
          f"httptools {'yes' if importable(sys.executable, 'httptools') else 'no'}), "
          f"Django {module_version(sys.executable, 'Django')}, httpx {module_version(sys.executable, 'httpx')}, "
          f"nginx {info.get('nginx', '-')}, LiteLLM {info.get('litellm', '-')} (its uvicorn, uvloop)")
    print(f"  redis: {info.get('redis', '-')}; fake engine: {o.chunks} content chunks per stream, {info.get('fake engine loop')}; "
          f"requests per cell: " + ", ".join(f"c={c}: {requests_for(c, o.scale)}" for c in concurrencies)
          + f", at most {o.time_limit:g} s; {o.rounds} round{'s' if o.rounds > 1 else ''}"
          + (", the table shows each cell's fastest round" if o.rounds > 1 else ""))
    print("  ttfc: time to the first body byte; +p50: p50 minus direct's p50; cpu ms/req: CPU time of the target's")
    print("  processes (direct: the fake engine's) per request, which other load on the machine changes little;")
    print("  err '!': the cell hit --time-limit")
    if info.get("profiles"):
        print(f"  py-spy profiles (folded stacks) in {info['profiles']}")
    print()
    print_table(best, order)
    print_targets(best, servers)
    for failure in failures:
        print(f"\nnot measured: {failure}")
    for c in (c for rounds in cells.values() for c in rounds):
        if c.errors:
            print(f"errors in {c.target} {c.mode} c={c.concurrency}: {c.errors}, first: {c.first_error[:300]}")
    print(f"\nchild processes left: {len(left)}" + (": " + "; ".join(left) if left else " (none)"))
    if o.json:
        Path(o.json).write_text(json.dumps([c.summary() for c in best], indent=1))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
