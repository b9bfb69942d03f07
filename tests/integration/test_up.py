"""`llmgw up` on its embedded defaults (SQLite, the embedded Valkey, a local agent, the SmolLM2 demo on the
real llama.cpp server from xllamacpp), then SIGTERM: nothing it started is left running."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.integration.harness import MANAGE, ROOT, free_port, wait_for

pytestmark = pytest.mark.integration


def test_up_runs_everything_and_sigterm_stops_everything(tmp_path):
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(LLMGW_HOME=str(home), PYTHONUNBUFFERED="1", LLMGW_ENGINE_HOST="127.0.0.1")
    out_path = tmp_path / "up.out"
    with open(out_path, "w") as out:
        up = subprocess.Popen(
            [sys.executable, str(MANAGE), "llmgw", "up", "--port", str(port), "--agent-memory", "2GiB"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def cli(*args):
        done = subprocess.run([sys.executable, str(MANAGE), "llmgw", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        wait_for(lambda: "llmgw is up" in out_path.read_text(), 120, what="up to start")
        printed = out_path.read_text()
        assert re.search(r"user admin, password \S{8,}", printed)
        assert f"dashboard  http://127.0.0.1:{port}/" in printed and f"gateway    http://127.0.0.1:{port}/v1/" in printed
        assert "embedded Valkey" in printed and "sqlite3" in printed

        import json

        def smollm2_ready():
            reps = json.loads(cli("ctl", "replicas", "--json"))
            return [r for r in reps if r["model"] == "smollm2" and r["state"] == "ready"]

        (replica,) = wait_for(smollm2_ready, 120, interval=1, what="the demo replica to be ready")
        key = cli("ctl", "engine-key", "show").strip()
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        url = f"http://127.0.0.1:{replica['port']}/v1/chat/completions"
        answer = httpx.post(url, json=chat, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        assert httpx.post(url, json=chat, timeout=60).status_code == 401
        assert httpx.post(url, json=chat, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401

        # `llmgw restart` under steady load through the gateway: the agent, then web, beat and worker restart;
        # the engine keeps serving (same pid) and no request fails
        secret = cli("ctl", "keys", "create", "up-load").split()[-1]
        outcomes: list[str] = []
        done = threading.Event()

        def load():
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret, max_retries=0, timeout=60)
            while not done.is_set():
                try:
                    c.chat.completions.create(model="smollm2", messages=chat["messages"], max_tokens=4)
                    outcomes.append("ok")
                except Exception as exc:
                    outcomes.append(repr(exc))

        workers = [threading.Thread(target=load) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            wait_for(lambda: outcomes.count("ok") >= 4, 60, what="requests through the gateway")
            restart = subprocess.run([sys.executable, str(MANAGE), "llmgw", "restart", "--timeout", "90"], env=env,
                                     cwd=ROOT, capture_output=True, text=True, timeout=600)
            served_during = len(outcomes)
            wait_for(lambda: len(outcomes) >= served_during + 4, 60, what="requests after the restart")
        finally:
            done.set()
            for w in workers:
                w.join(90)
        assert restart.returncode == 0, restart.stdout + restart.stderr
        said = restart.stdout
        assert re.search(r"agent \S+: back after", said), said
        for role in ("web", "beat", "worker"):
            assert re.search(rf"{role} {role}@\S+: back as {role}@\S+", said), said
        failed = [o for o in outcomes if o != "ok"]
        assert not failed, f"{len(failed)} of {len(outcomes)} failed: {failed[:3]}"
        (after,) = smollm2_ready()
        assert (after["name"], after["pid"]) == (replica["name"], replica["pid"])  # the engine was not restarted

        started = psutil.Process(up.pid).children(recursive=True)
        started.append(psutil.Process(replica["pid"]))  # the engine: its own session, not up's child
        names = " ".join(" ".join(p.cmdline()) for p in started)
        web = os.environ.get("LLMGW_WEB_SERVER") or "uvicorn"
        for part in (web, "celery", "worker", "beat", "llmgw agent", "valkey-server", "xllamacpp_launcher"):
            assert part in names, part
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGTERM)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            raise
    printed = out_path.read_text()
    assert up.returncode == 0, printed
    assert "stopped 1 engine(s)" in printed and "llmgw stopped." in printed
    time.sleep(0.5)
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    assert not (home / "run" / "redis-url").exists()


def test_up_refuses_a_busy_port(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
        env["LLMGW_HOME"] = str(tmp_path / "home")
        done = subprocess.run([sys.executable, str(MANAGE), "llmgw", "up", "--port", str(port)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: port {port} on 127.0.0.1 is in use; pick another with --port"
