"""The gateway end to end: the official openai client, sync and async, against the real daphne and real replicas.

Replicas run the test engine (tests/engine.py) unless a test is about llama.cpp; every test brings its own models
and keys. A test removes its models when it ends; the module waits, at its end, until all of them are gone.
Engine-side behaviour a test needs (a 500, an echo of what reached the engine) comes from the test engine's
--echo-body: `"test_engine_status": N` in a body makes it answer N.
"""

import asyncio
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import httpx
import openai
import pytest
import redis

from tests.integration.harness import add_test_engine, start_web, wait_for

pytestmark = pytest.mark.integration

ANSWER = "Hello from the test engine."
SLOW_ANSWER = "one two three four five six seven eight nine ten"
SLOW_SLOTS = 3  # a replica of the slow model's
HELLO = [{"role": "user", "content": "Say hello please"}]  # three prompt tokens for the test engine
ENDPOINTS = {
    "/v1/chat/completions": {"messages": HELLO},
    "/v1/completions": {"prompt": "Say hello"},
    "/v1/embeddings": {"input": "Say hello"},
}


# helpers


def create_key(system, name: str, *args: str) -> str:
    """`ctl keys create`; the secret is the last word of what it prints."""
    return system.cli("ctl", "keys", "create", name, *args).stdout.split()[-1]


def client(system, key: str, url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or system.url) + "/v1", api_key=key, max_retries=0, timeout=60)


def aclient(system, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=system.url + "/v1", api_key=key, max_retries=0, timeout=60)


def add_model(system, name: str, engine: str, *args: str, replicas: int = 1, memory: str = "100MiB") -> None:
    system.cli(
        "ctl", "model", "add", name, "--file", system.sha, "--engine", engine,
        "--replicas", str(replicas), "--memory", memory, *args,
    )


def remove_models(system, *names: str) -> None:
    for name in names:
        system.cli("ctl", "model", "remove", name, check=False)
    wait_for(
        lambda: not set(names) & {m["name"] for m in system.cli_json("ctl", "models")}, 60, what=f"{names} removed"
    )


def post(system, path: str, body=None, key: str | None = None, content: bytes | None = None, url: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.post((url or system.url) + path, json=body, content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    """An OpenAI-shaped JSON error, never an HTML page."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    assert "<html" not in response.text.lower()
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["type"], error
    return error


def assert_raised(excinfo, kind, status: int, code: str) -> openai.APIStatusError:
    exc = excinfo.value
    assert type(exc) is kind, (type(exc), exc)
    assert exc.status_code == status and exc.code == code, (exc.status_code, exc.code, exc.message)
    assert_error(httpx.Response(exc.response.status_code, headers=dict(exc.response.headers),
                                content=exc.response.content), status, code)
    return exc


def chat_text(completion) -> str:
    return completion.choices[0].message.content


def stream_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def inflight_total(system) -> int:
    """Requests in flight as every web process shares them in Redis."""
    r = redis.Redis.from_url(system.env["REDIS_URL"])
    try:
        return sum(int(n) for key in r.scan_iter(match="llmgw:inflight:*") for n in r.hgetall(key).values())
    finally:
        r.close()


def in_one_minute(check) -> None:
    """Rate limits count per wall-clock minute: a check whose requests straddled two minutes, and failed for it,
    runs once more, whole, in the new minute (`check(attempt)` makes its keys anew for each attempt)."""
    for attempt in range(2):
        minute = time.time() // 60
        try:
            check(attempt)
            return
        except (AssertionError, pytest.fail.Exception):
            if attempt or time.time() // 60 == minute:
                raise


def access_lines(system, prefix: str, proc: str = "web") -> list[str]:
    return [line for line in system.procs[proc].log_path.read_text(errors="replace").splitlines()
            if "llmgw.access" in line and f"key={prefix} " in line]


# fixtures: one fast echoing model with two replicas, one slow-streaming model with two replicas


@pytest.fixture(scope="module")
def gw(system):
    """A key for every model and `gw-chat` (two replicas of the echoing test engine). A test's own models go
    with `gw.remove(name)`: removed at once, and the end of the module waits until every one of them is gone."""
    add_test_engine(system, name="gw-echo", args="--echo-body")
    add_model(system, "gw-chat", "gw-echo", replicas=2)
    key = create_key(system, "gw-main")
    system.wait_ready("gw-chat", 2)
    removed = []

    def remove(name: str) -> None:
        system.cli("ctl", "model", "remove", name, check=False)
        removed.append(name)

    yield SimpleNamespace(key=key, model="gw-chat", client=client(system, key), remove=remove)
    remove_models(system, "gw-chat", *removed)


@pytest.fixture(scope="module")
def slow(system, gw):
    """Ten tokens 0.4 s apart when streamed; a plain answer after 0.4 s. Three slots a replica (one more request at
    once is a 500): requests wait in admission's queue, and the failover below is a test of admission too."""
    add_test_engine(system, name="gw-slow", args=f"--delay-ms 400 --answer '{SLOW_ANSWER}' --parallel {{parallel}}")
    system.cli("ctl", "profile", "add", "gw-three", "--parallel", str(SLOW_SLOTS))
    # spread by load: the failover test wants streams on both replicas, which one opening's prefix key would not give
    add_model(system, "gw-slow", "gw-slow", "--routing", "least-inflight", "--profile", "gw-three", replicas=2)
    key = create_key(system, "gw-slow-key")
    system.wait_ready("gw-slow", 2)
    yield SimpleNamespace(key=key, model="gw-slow")
    gw.remove("gw-slow")


# the endpoints, sync and async


def test_chat_completions_embeddings_with_the_sync_client(gw):
    c = gw.client
    done = c.chat.completions.create(model=gw.model, messages=HELLO)
    assert chat_text(done) == ANSWER and done.choices[0].finish_reason == "stop"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 5)
    short = c.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=2)
    assert chat_text(short) == "Hello from" and short.choices[0].finish_reason == "length"

    chunks = list(c.chat.completions.create(model=gw.model, messages=HELLO, stream=True))
    assert stream_text(chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(ch.usage is None and ch.choices for ch in chunks), "the usage chunk the gateway asked for is not passed on"

    chunks = list(c.chat.completions.create(model=gw.model, messages=HELLO, stream=True, stream_options={"include_usage": True}))
    assert stream_text(chunks) == ANSWER
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 5)
    assert all(ch.usage is None for ch in chunks[:-1])

    text = c.completions.create(model=gw.model, prompt="Say hello")
    assert text.choices[0].text == ANSWER and text.usage.prompt_tokens == 2
    pieces = list(c.completions.create(model=gw.model, prompt="Say hello", stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == ANSWER

    emb = c.embeddings.create(model=gw.model, input=["one", "two words"])
    assert [d.index for d in emb.data] == [0, 1] and all(len(d.embedding) == 8 for d in emb.data)
    assert emb.data[0].embedding != emb.data[1].embedding and emb.usage.prompt_tokens == 3


def test_the_async_client(system, gw):
    async def main():
        async with aclient(system, gw.key) as c:
            done, emb, listed, one = await asyncio.gather(
                c.chat.completions.create(model=gw.model, messages=HELLO),
                c.embeddings.create(model=gw.model, input="hello"),
                c.models.list(),
                c.models.retrieve(gw.model),
            )
            stream = await c.chat.completions.create(
                model=gw.model, messages=HELLO, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            many = await asyncio.gather(*[c.chat.completions.create(model=gw.model, messages=HELLO) for _ in range(10)])
            with pytest.raises(openai.NotFoundError) as missing:
                await c.chat.completions.create(model="gw-no-such-model", messages=HELLO)
            return done, emb, listed, one, chunks, many, missing

    done, emb, listed, one, chunks, many, missing = asyncio.run(main())
    assert chat_text(done) == ANSWER and len(emb.data[0].embedding) == 8
    assert gw.model in [m.id for m in listed.data] and one.id == gw.model and one.ready is True
    assert stream_text(chunks) == ANSWER and chunks[-1].usage.completion_tokens == 5
    assert [chat_text(m) for m in many] == [ANSWER] * 10
    assert_raised(missing, openai.NotFoundError, 404, "model_not_found")


def test_models_list_and_retrieve_say_whether_a_replica_is_ready(system, gw):
    add_model(system, "gw-huge", "testengine", "--wait", "30", memory="64GiB")
    try:
        wait_for(lambda: (system.replicas("gw-huge") or [{}])[0].get("reason"), 30, what="gw-huge to be unplaceable")
        c = gw.client

        def listed():
            models = {m.id: m for m in c.models.list().data}
            return "gw-huge" in models and models

        models = wait_for(listed, 10, what="gw-huge listed")
        assert models[gw.model].ready is True and models[gw.model].object == "model"
        assert models["gw-huge"].ready is False
        assert c.models.retrieve(gw.model).ready is True
        assert c.models.retrieve("gw-huge").ready is False
        with pytest.raises(openai.NotFoundError) as missing:
            c.models.retrieve("gw-no-such-model")
        assert_raised(missing, openai.NotFoundError, 404, "model_not_found")
        with pytest.raises(openai.AuthenticationError) as bad:
            client(system, "sk-not-a-key").models.list()
        assert_raised(bad, openai.AuthenticationError, 401, "invalid_api_key")

        # nothing is on its way (the replica cannot be placed): 503 at once, not after the model's 30 s wait
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as unready:
            c.chat.completions.create(model="gw-huge", messages=HELLO)
        took = time.monotonic() - started
        exc = assert_raised(unready, openai.InternalServerError, 503, "no_replica_ready")
        assert int(exc.response.headers["retry-after"]) >= 1
        assert took < 10, f"answered after {took:.1f}s: it waited for a replica that cannot come"
    finally:
        gw.remove("gw-huge")


# errors, each as the client's own exception


def test_keys_are_checked_and_limits_enforced(system, gw):
    with pytest.raises(openai.AuthenticationError) as bad:
        client(system, "sk-not-a-real-key").chat.completions.create(model=gw.model, messages=HELLO)
    assert_raised(bad, openai.AuthenticationError, 401, "invalid_api_key")
    assert_error(post(system, "/v1/chat/completions", {"model": gw.model, "messages": HELLO}), 401, "invalid_api_key")

    with pytest.raises(openai.NotFoundError) as missing:
        gw.client.chat.completions.create(model="gw-no-such-model", messages=HELLO)
    assert_raised(missing, openai.NotFoundError, 404, "model_not_found")

    add_model(system, "gw-other", "testengine", replicas=0)  # a key may name only models that exist
    only = client(system, create_key(system, "gw-only-other", "--models", "gw-other"))
    with pytest.raises(openai.PermissionDeniedError) as denied:
        only.chat.completions.create(model=gw.model, messages=HELLO)
    assert_raised(denied, openai.PermissionDeniedError, 403, "model_not_allowed")
    remove_models(system, "gw-other")
    allowed = client(system, create_key(system, "gw-only-chat", "--models", gw.model))
    assert chat_text(allowed.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER

    expires = (datetime.now(UTC) + timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    brief = client(system, create_key(system, "gw-brief", "--expires", expires))
    assert chat_text(brief.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER

    def per_minute(attempt: int) -> None:  # while the brief key's seconds run out
        limited = client(system, create_key(system, f"gw-rpm2-{attempt}", "--rpm", "2"))
        for _ in range(2):
            assert chat_text(limited.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER
        with pytest.raises(openai.RateLimitError) as limit:
            limited.chat.completions.create(model=gw.model, messages=HELLO)
        exc = assert_raised(limit, openai.RateLimitError, 429, "rate_limited")
        assert 1 <= int(exc.response.headers["retry-after"]) <= 60

        tokens = client(system, create_key(system, f"gw-tpm5-{attempt}", "--tpm", "5"))
        assert chat_text(tokens.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER  # 3 + 5 tokens
        with pytest.raises(openai.RateLimitError) as over:
            tokens.chat.completions.create(model=gw.model, messages=HELLO)
        assert_raised(over, openai.RateLimitError, 429, "rate_limited")

    in_one_minute(per_minute)

    time.sleep(max(0.0, datetime.fromisoformat(expires).timestamp() - time.time()) + 0.3)
    with pytest.raises(openai.AuthenticationError) as expired:
        brief.chat.completions.create(model=gw.model, messages=HELLO)
    assert "expired" in assert_raised(expired, openai.AuthenticationError, 401, "invalid_api_key").message

    revoked = client(system, create_key(system, "gw-revoked"))
    assert chat_text(revoked.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER
    system.cli("ctl", "keys", "revoke", "gw-revoked")

    def refused():
        try:
            revoked.chat.completions.create(model=gw.model, messages=HELLO)
        except openai.AuthenticationError as exc:
            return exc.code == "invalid_api_key"
        return False

    wait_for(refused, 10, what="the revoked key to be refused")


def as_json(**fields) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    "path, content, says",
    [
        ("/v1/chat/completions", b'{"model": "gw-chat", "messages": [', "not valid JSON"),
        ("/v1/chat/completions", b"\xff\xfe not utf-8", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "must be a JSON object"),
        ("/v1/chat/completions", b"", "not valid JSON"),
        ("/v1/chat/completions", json.dumps({"messages": HELLO}).encode(), "`model` is required"),
        ("/v1/chat/completions", json.dumps({"model": 5, "messages": HELLO}).encode(), "`model` is required"),
        ("/v1/chat/completions", json.dumps({"model": "gw-chat"}).encode(), "`messages` is required"),
        ("/v1/chat/completions", json.dumps({"model": "gw-chat", "messages": 5}).encode(), "`messages` must be a list"),
        ("/v1/chat/completions", as_json(model="gw-chat", messages=HELLO, stream="yes"), "`stream` must be"),
        ("/v1/chat/completions", as_json(model="gw-chat", messages=HELLO, stream=True, stream_options=5), "`stream_options`"),
        ("/v1/completions", json.dumps({"model": "gw-chat"}).encode(), "`prompt` is required"),
        ("/v1/embeddings", json.dumps({"model": "gw-chat"}).encode(), "`input` is required"),
    ],
)
def test_bad_bodies_are_400_invalid_request(system, gw, path, content, says):
    error = assert_error(post(system, path, content=content, key=gw.key), 400, "invalid_request")
    assert says in error["message"], error


def test_bad_requests_through_the_client_and_what_is_never_a_500(system, gw):
    c = gw.client
    with pytest.raises(openai.BadRequestError) as wrong:
        c.chat.completions.create(model=gw.model, messages=5)
    assert_raised(wrong, openai.BadRequestError, 400, "invalid_request")
    with pytest.raises(openai.BadRequestError) as wrong:
        c.chat.completions.create(model=gw.model, messages=HELLO, extra_body={"stream": "yes"})
    assert_raised(wrong, openai.BadRequestError, 400, "invalid_request")

    # over the body limit (8 MiB by default): 413, before any JSON parsing
    with pytest.raises(openai.APIStatusError) as big:
        c.chat.completions.create(model=gw.model, messages=[{"role": "user", "content": "x" * (9 * 1024 * 1024)}])
    assert_raised(big, openai.APIStatusError, 413, "request_too_large")

    # an engine that answers 500 (or 503 on every replica) is a 502 upstream_error, streamed or not
    for status in (500, 503):
        with pytest.raises(openai.InternalServerError) as failed:
            c.chat.completions.create(model=gw.model, messages=HELLO, extra_body={"test_engine_status": status})
        assert_raised(failed, openai.InternalServerError, 502, "upstream_error")
        with pytest.raises(openai.InternalServerError) as failed:
            c.chat.completions.create(model=gw.model, messages=HELLO, stream=True, extra_body={"test_engine_status": status})
        assert_raised(failed, openai.InternalServerError, 502, "upstream_error")
    # an engine's own 4xx is the client's 400, in the gateway's words with the engine's reason
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model=gw.model, messages=HELLO, stream=stream, extra_body={"test_engine_status": 400})
        said = assert_raised(refused, openai.BadRequestError, 400, "invalid_request")
        assert said.body["message"] == f"model {gw.model} refused the request: failing with 400 on purpose"

    for path in ("/v1/nope", "/v1", "/v1/", "/v1/chat/completions/", "/v1/models/", "/v1x", "/v1x/chat/completions",
                 "/metrics/", "/metricsX"):
        assert_error(post(system, path, {"model": gw.model}, key=gw.key), 404, "not_found")
        assert_error(httpx.get(system.url + path, timeout=30), 404, "not_found")  # JSON, never a page
    auth = {"Authorization": f"Bearer {gw.key}"}
    assert_error(httpx.get(system.url + "/v1/chat/completions", headers=auth), 405, "method_not_allowed")
    assert_error(httpx.get(system.url + "/v1/models"), 401, "invalid_api_key")
    assert_error(httpx.get(system.url + "/v1/models/gw-nope", headers=auth), 404, "model_not_found")
    assert "Traceback" not in system.procs["web"].tail(400)


def test_unknown_fields_pass_through_untouched_and_the_client_key_stays_at_the_gateway(system, gw):
    extra = {"top_k": 7, "x_vendor": {"nested": [1, 2.5, "three", None, True]}, "cache_prompt": False, "seed": 12345678901234}
    sent = {"model": gw.model, "messages": HELLO, "max_tokens": 9, **extra}
    raw = gw.client.chat.completions.with_raw_response.create(model=gw.model, messages=HELLO, max_tokens=9, extra_body=extra)
    echo = json.loads(raw.content)["echo"]
    assert echo["body"] == sent, "the engine gets the body as the client sent it"
    assert json.dumps(echo["body"]["x_vendor"]) == json.dumps(extra["x_vendor"])
    engine_key = system.cli("ctl", "engine-key", "show").stdout.strip()
    headers = echo["headers"]
    assert headers["authorization"] == f"Bearer {engine_key}"
    assert gw.key not in json.dumps(headers), "the client's key never reaches an engine"
    assert not [h for h in headers if h.startswith(("x-stainless", "openai-"))], headers
    assert "openai" not in headers.get("user-agent", "").lower(), headers

    done = gw.client.embeddings.create(model=gw.model, input="hi", extra_body={"dimensions_hint": [3]})
    body = done.model_extra["echo"]["body"]
    assert (body["model"], body["input"], body["dimensions_hint"]) == (gw.model, "hi", [3])


# the system stopped and started


def test_stop_answers_503_system_stopped_and_start_serves_again(system, gw):
    chat = {"model": gw.model, "messages": HELLO}
    system.cli("stop")
    try:
        wait_for(lambda: post(system, "/v1/chat/completions", chat, key=gw.key).status_code == 503, 10, what="stopped")
        for path, body in ENDPOINTS.items():
            response = post(system, path, {"model": gw.model, **body}, key=gw.key)
            assert_error(response, 503, "system_stopped")
            assert int(response.headers["retry-after"]) >= 1
        # before anything else: the key and the model are not even looked at
        assert_error(post(system, "/v1/chat/completions", chat, key="sk-wrong"), 503, "system_stopped")
        assert_error(post(system, "/v1/chat/completions", {**chat, "model": "gw-nope"}, key=gw.key), 503, "system_stopped")
        assert_error(post(system, "/v1/chat/completions", content=b"{broken", key=gw.key), 503, "system_stopped")
        with pytest.raises(openai.InternalServerError) as stopped:
            gw.client.chat.completions.create(model=gw.model, messages=HELLO, stream=True)
        assert_raised(stopped, openai.InternalServerError, 503, "system_stopped")
        # every model goes to zero replicas; its definition stays
        wait_for(lambda: system.replicas(gw.model) == [], 30, what="the replicas to stop")
        assert gw.model in [m["name"] for m in system.cli_json("ctl", "models")]
        wait_for(lambda: gw.client.models.retrieve(gw.model).ready is False, 10, what="the model to show not ready")
    finally:
        system.cli("start")
    system.wait_ready(gw.model, 2)
    wait_for(lambda: gw.client.models.retrieve(gw.model).ready, 10, what="ready again")
    assert chat_text(gw.client.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER


# waiting for a replica, failover, in-flight counts


def test_a_request_waits_for_a_replica_that_is_on_its_way(system, gw):
    add_test_engine(system, name="gw-slowload", args="--load-seconds 4")
    add_model(system, "gw-wait", "gw-slowload", "--wait", "30")
    try:
        started = time.monotonic()
        done = gw.client.chat.completions.create(model="gw-wait", messages=HELLO)
        assert chat_text(done) == ANSWER
        assert time.monotonic() - started > 3, "the engine loads for 4 s: the request must have waited"
        pieces = list(gw.client.chat.completions.create(model="gw-wait", messages=HELLO, stream=True))
        assert stream_text(pieces) == ANSWER
    finally:
        gw.remove("gw-wait")


def test_inflight_counts_return_to_zero_after_many_requests_and_cancelled_streams(system, slow):
    system.wait_ready(slow.model, 2)
    wait_for(lambda: inflight_total(system) == 0, 10, what="no request in flight at the start")
    secret = create_key(system, "gw-inflight-" + os.urandom(3).hex())
    seen = []

    async def main():
        async with aclient(system, secret) as c:
            async def whole():
                return chat_text(await c.chat.completions.create(model=slow.model, messages=HELLO))

            async def whole_stream():
                stream = await c.chat.completions.create(model=slow.model, messages=HELLO, stream=True)
                return stream_text([chunk async for chunk in stream])

            async def closed_early():
                stream = await c.chat.completions.create(model=slow.model, messages=HELLO, stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                await stream.close()
                return "closed"

            async def until_cancelled(first: asyncio.Event):
                stream = await c.chat.completions.create(model=slow.model, messages=HELLO, stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first.set()
                return "not cancelled"

            async def gives_up():  # a client-side timeout, while the engine has not answered yet
                try:
                    await c.with_options(timeout=0.15).chat.completions.create(model=slow.model, messages=HELLO)
                except openai.APITimeoutError:
                    return "timed out"
                return "answered"

            async def watch():
                while True:
                    seen.append(inflight_total(system))
                    await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch())
            firsts = [asyncio.Event() for _ in range(5)]
            doomed = [asyncio.create_task(until_cancelled(e)) for e in firsts]
            # the doomed streams under way first (five of the six slots), then the rest, most of which wait for
            # a slot in admission's queue
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in firsts]), 30)
            others = [whole() for _ in range(10)] + [whole_stream() for _ in range(5)]
            others += [closed_early() for _ in range(5)] + [gives_up() for _ in range(5)]
            results = asyncio.gather(*others)
            await asyncio.sleep(0.1)
            for task in doomed:
                task.cancel()
            out = await results
            cancelled = await asyncio.gather(*doomed, return_exceptions=True)
            watcher.cancel()
            return out, cancelled

    out, cancelled = asyncio.run(main())
    assert out[:10] == [SLOW_ANSWER] * 10 and out[10:15] == [SLOW_ANSWER] * 5
    assert out[15:20] == ["closed"] * 5 and set(out[20:]) <= {"timed out", "answered"}
    assert all(isinstance(r, asyncio.CancelledError) for r in cancelled), cancelled
    # every slot of both replicas: the rest waited in admission's queue
    assert max(seen) >= 2 * SLOW_SLOTS, f"the shared counts saw the requests in flight: {seen}"
    wait_for(lambda: inflight_total(system) == 0, 10, what="the shared in-flight counts back to zero")
    # one access-log line for each request that reached the gateway, the cancelled ones too (499: the client went
    # away): the 25 that did for certain, and those of the five that gave up after 0.15 s that got there before
    # (on a loaded machine one may give up while its connection still waits to be accepted)
    wait_for(lambda: len(access_lines(system, secret[:14])) >= 25, 10, what="25 access lines")
    time.sleep(1)
    lines = access_lines(system, secret[:14])
    assert len(lines) <= 30 and sum("status=499" in line for line in lines) >= 10, lines


def test_failover_when_a_replica_dies_under_load(system, slow):
    reps = system.wait_ready(slow.model, 2)
    victim = reps[0]
    c = client(system, slow.key)
    stop = threading.Event()

    def stream_one(first: threading.Event):
        text = ""
        try:
            for chunk in c.chat.completions.create(model=slow.model, messages=HELLO, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                    first.set()
            return text, None
        except openai.APIError as exc:
            return text, exc

    def keep_asking():
        answers = []
        while not stop.is_set():
            try:
                answers.append(chat_text(c.chat.completions.create(model=slow.model, messages=HELLO)))
            except Exception as exc:  # noqa: BLE001 - each one is a failure to report
                answers.append(exc)
        return answers

    with ThreadPoolExecutor(10) as pool:
        firsts = [threading.Event() for _ in range(4)]
        streams = [pool.submit(stream_one, e) for e in firsts]
        assert all(e.wait(20) for e in firsts), "the streams began"
        askers = [pool.submit(keep_asking) for _ in range(4)]
        wait_for(lambda: inflight_total(system) >= 5, 20, interval=0.05, what="the askers' requests in flight too")
        os.kill(victim["pid"], signal.SIGKILL)
        served = len(access_lines(system, slow.key[:14]))  # answered so far
        # the askers go on past the kill: enough answers after it to have met the dead replica
        wait_for(lambda: len(access_lines(system, slow.key[:14])) >= served + 12, 60, what="answers after the kill")
        stop.set()
        cut = [s.result(30) for s in streams]
        answers = [a for f in askers for a in f.result(30)]

    assert answers and all(a == SLOW_ANSWER for a in answers), [a for a in answers if a != SLOW_ANSWER]
    # the streams on the dead replica went on at the other (gateway/resume.py): every one whole, no error
    assert all(exc is None and text == SLOW_ANSWER for text, exc in cut), cut
    resumed = wait_for(lambda: system.api("GET", "/api/v1/requests/", params={
        "model": slow.model, "resumed": "true"}).json()["results"] or None, 10, what="the resumed streams' records")
    assert all(r["tries"][0][0] == victim["name"] and r["streamed"] for r in resumed), resumed

    def replaced():
        ready = [r for r in system.replicas(slow.model) if r["state"] == "ready"]
        return len(ready) == 2 and victim["name"] not in [r["name"] for r in ready]

    wait_for(replaced, 60, what="the killed replica to be replaced")
    wait_for(lambda: inflight_total(system) == 0, 10, what="no request left in flight")


# two web processes, usage, the access log


def test_rate_limits_hold_across_two_web_processes(system, gw):
    url2 = start_web(system, "web2")
    try:
        def across_two(attempt: int) -> None:
            secret = create_key(system, f"gw-rpm3-{attempt}", "--rpm", "3")
            one, two = client(system, secret), client(system, secret, url=url2)
            assert chat_text(one.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER
            assert chat_text(one.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER
            assert chat_text(two.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER
            with pytest.raises(openai.RateLimitError) as limit:
                two.chat.completions.create(model=gw.model, messages=HELLO)
            assert_raised(limit, openai.RateLimitError, 429, "rate_limited")
            with pytest.raises(openai.RateLimitError):
                one.chat.completions.create(model=gw.model, messages=HELLO)
            assert len(access_lines(system, secret[:14], "web2")) == 2

        in_one_minute(across_two)
    finally:
        system.procs.pop("web2").stop()


@pytest.mark.parametrize("server", ["daphne"])
def test_either_web_server_serves_the_gateway_and_the_agent_stream(system, gw, server):
    """daphne runs the same application as uvicorn (the default, which serves every other test here): the openai
    client's chat and stream, the agent websocket (refusing a bad token), and the dashboard's static files."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = start_web(system, f"web-{server}", server=server)
    try:
        secret = create_key(system, f"gw-{server}")
        c = client(system, secret, url=url)
        assert chat_text(c.chat.completions.create(model=gw.model, messages=HELLO)) == ANSWER
        assert stream_text(c.chat.completions.create(model=gw.model, messages=HELLO, stream=True)) == ANSWER
        with pytest.raises(openai.AuthenticationError):
            client(system, "sk-wrong", url=url).models.list()
        ws_url = url.replace("http://", "ws://") + "/ws/agent/"
        with pytest.raises(InvalidStatus) as refused:  # refused before the handshake completes, as under daphne
            connect(ws_url, additional_headers={"Authorization": "Bearer wrong"}, open_timeout=10)
        assert refused.value.response.status_code == 403
        assert len(access_lines(system, secret[:14], f"web-{server}")) == 2
        # the dashboard's static files (WhiteNoise) and its login page: `llmgw up` needs nothing else
        for path in ("/static/dashboard/dashboard.css", "/static/dashboard/live.js", "/static/django_htmx/htmx-2.min.js"):
            assert httpx.get(url + path, timeout=10).status_code == 200, path
        assert "Log in" in httpx.get(url + "/login/", timeout=10).text
    finally:
        system.procs.pop(f"web-{server}").stop()


def test_usage_per_key_and_model_and_the_access_log(system, gw):
    secret = create_key(system, "gw-usage")
    c = client(system, secret)
    marker = "zebra-quokka-" + os.urandom(4).hex()
    prompt = [{"role": "user", "content": f"secret words {marker}"}]  # three words
    for _ in range(2):
        assert chat_text(c.chat.completions.create(model=gw.model, messages=prompt)) == ANSWER
    assert stream_text(list(c.chat.completions.create(model=gw.model, messages=prompt, stream=True))) == ANSWER
    usage = list(c.chat.completions.create(model=gw.model, messages=prompt, stream=True, stream_options={"include_usage": True}))
    assert usage[-1].usage.total_tokens == 8
    assert c.embeddings.create(model=gw.model, input=f"two {marker}").usage.prompt_tokens == 2
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gw-no-such-model", messages=prompt)

    # the access log: one line per request, with the key's prefix; never the prompt
    prefix = secret[:14]
    lines = wait_for(lambda: len(access_lines(system, prefix)) == 6 and access_lines(system, prefix), 10, what="six access lines")
    assert sum(f"model={gw.model} " in line and "status=200" in line for line in lines) == 5
    assert sum("model=unknown('gw-no-such-model')" in line and "status=404" in line for line in lines) == 1
    said = r"replica=\S+ status=\d+ duration_ms=[\d.]+ prompt_tokens=\d+ completion_tokens=\d+"
    assert all(re.search(said, line) for line in lines)
    assert secret not in system.procs["web"].log_path.read_text(errors="replace")
    assert marker not in system.procs["web"].log_path.read_text(errors="replace"), "the prompt is never logged"

    # usage: the web process counts, and writes it into the database every second
    def recorded():
        rows = system.cli_json("ctl", "usage", "--key", "gw-usage")
        total = {}
        for row in rows:
            for field in ("requests", "prompt_tokens", "completion_tokens"):
                total.setdefault(row["model"], {}).setdefault(field, 0)
                total[row["model"]][field] += row[field]
        return total if total.get(gw.model, {}).get("requests") == 5 else None

    total = wait_for(recorded, 10, interval=0.5, what="usage rows for gw-usage")
    assert total == {gw.model: {"requests": 5, "prompt_tokens": 4 * 3 + 2, "completion_tokens": 4 * 5}}
    keys = {k["name"]: k for k in system.cli_json("ctl", "keys", "list")}
    assert keys["gw-usage"]["last_used_at"] and keys["gw-usage"]["prefix"] == prefix
