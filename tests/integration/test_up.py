"""`llmgw up` on its embedded defaults (SQLite, the embedded Valkey, a local agent, the SmolLM2 demo on the
real llama.cpp server from xllamacpp), then SIGTERM: nothing it started is left running."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
import redis

from ground.ports import free_port
from llmgw.main import standalone
from tests.integration.harness import MANAGE, ROOT, wait_for

pytestmark = pytest.mark.integration


def answers(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.RedisError:
        return False


def usage_of(cli, key: str) -> tuple[int, int]:
    """A key's requests and tokens as the database has them (`ctl usage`)."""
    rows = json.loads(cli("ctl", "usage", "--key", key, "--json"))
    return sum(r["requests"] for r in rows), sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)


def test_up_runs_everything_and_sigterm_stops_everything(tmp_path):
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(LLMGW_HOME=str(home), PYTHONUNBUFFERED="1", LLMGW_ENGINE_HOST="127.0.0.1")
    out_path = tmp_path / "up.out"
    with open(out_path, "w") as out:
        up = subprocess.Popen(
            [sys.executable, str(MANAGE), "llmgw", "up", "--port", str(port), "--agent-memory", "2GiB",
             "--web-workers", "2"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )

    url, admin = f"http://127.0.0.1:{port}", {}

    def cli(*args):
        """`llmgw ARGS` against this `up` from anywhere (the program's code, in this process, over HTTP as the
        admin `up` made): a poll costs a request, not a process. `llmgw restart` below is run as a program."""
        if "token" not in admin:
            answer = httpx.post(f"{url}/api/v1/login/", json={"name": "admin", "password": admin["password"]}, timeout=30)
            admin["token"] = answer.json()["token"]
        out, err = io.StringIO(), io.StringIO()
        assert standalone(["--server", url, "--token", admin["token"], *args], out, err) == 0, err.getvalue()
        return out.getvalue()

    try:
        wait_for(lambda: "llmgw is up" in out_path.read_text(), 120, what="up to start")
        printed = out_path.read_text()
        admin["password"] = re.search(r"user admin, password (\S{8,})", printed).group(1)
        assert f"dashboard  http://127.0.0.1:{port}/" in printed and f"gateway    http://127.0.0.1:{port}/v1/" in printed
        assert "embedded Valkey" in printed and "sqlite3" in printed
        assert "llmgw is up (web, web-2, worker, beat, agent)" in printed  # two web processes on the one socket

        def smollm2_ready():
            reps = json.loads(cli("ctl", "replicas", "--json"))
            return [r for r in reps if r["model"] == "smollm2" and r["state"] == "ready"]

        (replica,) = wait_for(smollm2_ready, 120, what="the demo replica to be ready")

        # the first run's request to paste, as printed: with curl, and with the `openai` client
        lines = [line.strip() for line in printed.splitlines()]
        assert re.search(r"a client key for smollm2 \(shown once; .*\): sk-llmgw-\S+$", printed, re.M)
        pasted = subprocess.run(["bash", "-c", next(line for line in lines if line.startswith("curl "))],
                                capture_output=True, text=True, timeout=120)
        assert json.loads(pasted.stdout)["choices"][0]["message"]["content"], pasted
        # (this interpreter has `openai`, so `up` prints its line too, naming the interpreter by its path)
        pasted = subprocess.run(["bash", "-c", next(line for line in lines if "from openai import" in line)],
                                env=env, capture_output=True, text=True, timeout=120)
        assert pasted.returncode == 0 and pasted.stdout.strip(), pasted
        key = cli("ctl", "engine-key", "show").strip()
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        engine = f"http://127.0.0.1:{replica['port']}/v1/chat/completions"
        answer = httpx.post(engine, json=chat, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        assert httpx.post(engine, json=chat, timeout=60).status_code == 401
        assert httpx.post(engine, json=chat, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401

        # `llmgw restart` under steady load through the gateway: the agent, then web, beat and worker restart;
        # the engine keeps serving (same pid) and no request fails
        secret = cli("ctl", "keys", "create", "up-load").split()[-1]

        # what the demo model cannot do is refused in the gateway's words (the engine would answer 501 and 500),
        # and what its engine refuses is the client's 400, not a 502
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret, max_retries=0, timeout=60)
        assert json.loads(cli("ctl", "models", "--json"))[0]["capabilities"] == ["chat", "completions", "messages", "responses"]
        with pytest.raises(openai.BadRequestError, match="model smollm2 does not serve embeddings"):
            c.embeddings.create(model="smollm2", input="hello")
        picture = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
        with pytest.raises(openai.BadRequestError, match="model smollm2 does not take images"):
            c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": picture}])
        too_long = r"\(5001 tokens\) is longer than model smollm2's context \(\d+ tokens\)"
        with pytest.raises(openai.BadRequestError, match=too_long) as long:
            c.completions.create(model="smollm2", prompt="hi " * 5000, max_tokens=1)
        assert long.value.code == "context_length_exceeded"
        # a completion that asks for no limit stops at the model's cap (4096 unless set), not at the context's end
        cli("ctl", "model", "set", "smollm2", "--max-tokens", "6")
        count = [{"role": "user", "content": "Count from 1 to 100, one number per line."}]

        served = {"up-load": 0}  # requests answered 200 per key: its usage must count every one (issue 35)

        def held_to_six():  # (a tiny model now and then ends a short answer of its own: that is not the cap)
            done = c.chat.completions.create(model="smollm2", messages=count, temperature=0)
            served["up-load"] += 1
            return done if done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length" else None

        wait_for(held_to_six, 30, what="the cap to reach the gateway: 6 tokens, finish_reason length")
        # (and a wait for a replica past a loaded machine's agent reconnecting and engine loading, for `up` again)
        cli("ctl", "model", "set", "smollm2", "--max-tokens", "4096", "--wait", "90")
        outcomes = []  # "ok", or the repr of what was raised, per request
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
        assert len(re.findall(r"web web@\S+: back as web@\S+", said)) == 2, said  # each web process, in turn
        failed = [o for o in outcomes if o != "ok"]
        assert not failed, f"{len(failed)} of {len(outcomes)} failed: {failed[:3]}"
        # every web process restarted with its books finished: each request answered is in the usage
        served["up-load"] += len(outcomes)
        wait_for(lambda: usage_of(cli, "up-load")[0] == served["up-load"], 10, what="every request in the usage")
        # `up` said of each process the restart stopped that it is restarting, not that it exited with a code
        said_by_up = out_path.read_text()
        assert "web is restarting (it stopped as asked)" in said_by_up, said_by_up
        assert "exited (code" not in said_by_up, said_by_up
        (after,) = smollm2_ready()
        assert (after["name"], after["pid"]) == (replica["name"], replica["pid"])  # the engine was not restarted

        # the embedded Valkey killed: `up` reaps it, says so, and starts it again on its port; every request of a
        # rate-limited key gets through after it (stale pooled connections failed 2 of 16), the agent dials again,
        # the reconciler runs, and no other process had to restart
        redis_url = (home / "run" / "redis-url").read_text().strip()
        valkey_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])

        def valkey_process():
            found = [p for p in psutil.Process(up.pid).children() if "valkey-server" in " ".join(p.cmdline())]
            return found[0] if found else None

        old_valkey = valkey_process()
        limited = cli("ctl", "keys", "create", "up-limited", "--rpm", "1000").split()[-1]
        lc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=limited, max_retries=0, timeout=60)

        def sixteen_at_once() -> list[str]:  # as many of the gateway's pooled Redis connections
            def one(_):
                try:
                    lc.chat.completions.create(model="smollm2", messages=chat["messages"], max_tokens=1)
                    return "ok"
                except Exception as exc:
                    return repr(exc)

            with ThreadPoolExecutor(16) as pool:
                return list(pool.map(one, range(16)))

        assert sixteen_at_once() == ["ok"] * 16

        # a key's budget across the Valkey's loss (issue 35: it was served 647 and 687 tokens of its 400): four
        # short chats, a longer one under way as the Valkey is killed, then chats until refused
        booked = cli("ctl", "keys", "create", "up-books", "--budget", "400/day").split()[-1]
        bc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=booked, max_retries=0, timeout=120)
        spent = []
        for _ in range(4):
            short = bc.chat.completions.create(model="smollm2", messages=chat["messages"], max_tokens=8)
            spent.append(short.usage.total_tokens)
        longer = bc.chat.completions.create(model="smollm2", messages=count, max_tokens=150, stream=True,
                                            stream_options={"include_usage": True})
        next(iter(longer))  # under way
        connected_before = max([e["id"] for e in json.loads(cli("ctl", "events", "--kind", "node.connected",
                                                                 "--limit", "1000", "--json"))], default=0)
        said_before = out_path.read_text()
        old_valkey.send_signal(signal.SIGKILL)
        wait_for(lambda: "valkey exited (code -9); starting it again in" in out_path.read_text(), 30,
                 what="up to say its Valkey exited")
        new_valkey = wait_for(lambda: (p := valkey_process()) and p.pid != old_valkey.pid and p, 30,
                              what="a new Valkey")
        assert not psutil.pid_exists(old_valkey.pid)  # reaped, not a zombie
        restarted = redis.Redis.from_url(redis_url)
        wait_for(lambda: answers(restarted), 30, what="the Valkey on its port")
        assert f":{valkey_port}" in " ".join(new_valkey.cmdline())
        spent += [chunk.usage.total_tokens for chunk in longer if chunk.usage]
        outcomes = sixteen_at_once()
        assert outcomes == ["ok"] * 16, outcomes
        refused = None
        for _ in range(40):
            try:
                spent.append(bc.chat.completions.create(model="smollm2", messages=chat["messages"],
                                                        max_tokens=8).usage.total_tokens)
            except openai.RateLimitError as exc:
                refused = exc
                break
        assert refused is not None and refused.code == "budget_exceeded", spent
        # within the budget (issue 35 served 647 and 687), but for a request or two: a web process that finds the
        # Valkey slow a moment after its restart (0.25 s, on a loaded machine) holds the key to what it last knew
        # of the other's part while it goes on without it (docs/fair-sharing.md), which what the other serves
        # meanwhile may pass (CI saw 422: five short chats after the stream, the last in such a stretch)
        assert sum(spent) <= 400 + 2 * max(spent), spent
        wait_for(lambda: usage_of(cli, "up-books") == (len(spent), sum(spent)), 10, what="the budget key's usage")
        wait_for(lambda: any(e["id"] > connected_before for e in json.loads(
            cli("ctl", "events", "--kind", "node.connected", "--limit", "1000", "--json"))), 60,
            what="the agent to connect again")
        wait_for(lambda: [n for n in json.loads(cli("ctl", "nodes", "--json")) if n["connected"]], 60,
                 what="the node connected")
        wait_for(lambda: restarted.get("llmgw:reconcile:last"), 30, what="the reconciler to run on the new Valkey")
        restarted.close()
        exits = re.findall(r"^(\S+) exited \(code", out_path.read_text()[len(said_before):], re.M)
        assert exits == ["valkey"], out_path.read_text()[len(said_before):]

        # the Valkey hung (SIGSTOP; issue 35: a rate-limited key's requests got 503 after 5 s, the others their
        # 200 after 10 s, and the web logs 31 tracebacks): every request is answered, none waits on it for long
        # (a client giving up after 3 s), and each web process says so once, with no traceback
        def tracebacks() -> int:
            return sum(p.read_text(errors="replace").count("Traceback") for p in (home / "logs").glob("web*.log"))

        before = tracebacks()
        quick = [openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=k, max_retries=0, timeout=3)
                 for k in (limited, secret)]
        new_valkey.suspend()
        try:
            hung = []
            for client_ in quick * 3:
                try:
                    client_.chat.completions.create(model="smollm2", messages=chat["messages"], max_tokens=1)
                    hung.append("ok")
                except Exception as exc:
                    hung.append(repr(exc))
        finally:
            new_valkey.resume()
        assert hung == ["ok"] * 6, hung
        assert tracebacks() == before
        said = "".join(p.read_text(errors="replace") for p in (home / "logs").glob("web*.log"))
        assert "Redis did not answer within 0.25 s" in said
        wait_for(lambda: "Redis answers again" in "".join(p.read_text(errors="replace")
                                                          for p in (home / "logs").glob("web*.log")), 30,
                 what="the web processes to say Redis is back")

        started = psutil.Process(up.pid).children(recursive=True)
        started.append(psutil.Process(replica["pid"]))  # the engine: its own session, not up's child
        names = " ".join(" ".join(p.cmdline()) for p in started)
        # on the socket `up` holds, uvicorn or daphne, run by llmgw.web (llmgw/web.py says why)
        web = "-m llmgw.web"
        for part in (web, "celery", "worker", "beat", "llmgw agent", "valkey-server", "xllamacpp_launcher"):
            assert part in names, part
        assert sum(1 for p in started if web in " ".join(p.cmdline())) == 2
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
    _, alive = psutil.wait_procs(started, timeout=10)  # gone (or their parent's zombies)
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    assert not (home / "run" / "redis-url").exists()

    # `up` again, in the same home: the engine `up` stopped on its way out is a replica stopped on purpose, not a
    # crash; it is replaced, and the model neither backs off nor counts a failure
    with open(out_path, "w") as out:
        again = subprocess.Popen(
            [sys.executable, str(MANAGE), "llmgw", "up", "--port", str(port), "--agent-memory", "2GiB"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_for(lambda: "llmgw is up" in out_path.read_text(), 120, interval=0.05, what="up to start again")

        # requests from the moment it says "up", before its agent has reconnected (a few seconds): each waits for
        # the replica the node will take, as for one starting; none is refused 503 "no node is connected"
        def asked(i: int) -> str:
            time.sleep(i * 0.5)
            answer = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=120,
                                headers={"Authorization": f"Bearer {secret}"})
            return "ok" if answer.status_code == 200 else f"{answer.status_code} {answer.text}"

        with ThreadPoolExecutor(8) as pool:
            answered = list(pool.map(asked, range(8)))  # over the first 3.5 s
        assert answered == ["ok"] * 8, answered
        # the whole system stopped and started: the budget key's spend and usage are what they were
        assert usage_of(cli, "up-books") == (len(spent), sum(spent))
        # asking for what was left: refused only if the spend is kept (the prompt's overhead, learned again after
        # the start, is not there to tip it over)
        with pytest.raises(openai.RateLimitError, match="has used its budget|tokens left of its budget"):
            bc.chat.completions.create(model="smollm2", messages=chat["messages"], max_tokens=max(1, 400 - sum(spent)))
        (new,) = wait_for(smollm2_ready, 120, what="a new demo replica to be ready")
        assert new["name"] != replica["name"]
        reps = {r["name"]: r for r in json.loads(cli("ctl", "replicas", "--all", "--json"))}
        assert (reps[replica["name"]]["state"], reps[replica["name"]]["reason"]) == ("stopped", "stopped with `llmgw up`")
        failed = json.loads(cli("ctl", "events", "--kind", "replica.failed", "--json"))
        assert not failed, failed
        assert "backing off" not in cli("ctl", "models")
        on_the_host = subprocess.run([sys.executable, str(MANAGE), "llmgw", "status"], env=env, cwd=ROOT,
                                     capture_output=True, text=True, timeout=60)  # the host's program finds it
        assert on_the_host.returncode == 0 and "1 failed" not in on_the_host.stdout, on_the_host
    finally:
        os.kill(again.pid, signal.SIGTERM)
        again.wait(90)


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


@pytest.mark.parametrize("workers, said", [
    ("0", "error: --web-workers must be between 1 and 64, not 0"),
    ("many", "argument --web-workers: invalid int value: 'many'"),
])
def test_up_refuses_a_bad_web_worker_count(tmp_path, workers, said):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env["LLMGW_HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, str(MANAGE), "llmgw", "up", "--port", str(free_port()), "--web-workers",
                           workers], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
