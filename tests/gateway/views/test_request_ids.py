"""Every request through /v1/ has an id and a trace (gateway/tracing.py): the client's sane `X-Request-Id` kept,
else a new one; on every answer, errors included, and in every error body; on to the engine, with a W3C
`traceparent` that continues the client's trace (or begins one). tests/engine.py echoes the headers it got."""

import json
import re

import anthropic
import httpx
import httpx2
import openai
import pytest

from tests.gateway.views.harness import MESSAGES, Client, openai_error, post, read

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

NEW_ID = re.compile(r"req_[0-9a-f]{24}")
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def echoed(cluster, **headers) -> tuple[dict, dict]:
    """The gateway's answer's headers and what the engine got (its echo)."""
    response = await post(Client(Authorization=f"Bearer {cluster.secret}"), "chat/completions",
                          {"model": "qwen", "messages": MESSAGES}, **headers)
    assert response.status_code == 200, response.content
    return response.headers, json.loads(response.content)["echo"]["headers"]


async def test_a_request_without_an_id_gets_one_and_begins_a_trace_the_engine_continues(cluster):
    answered, engine = await echoed(cluster)
    assert NEW_ID.fullmatch(answered["x-request-id"])
    assert engine["x-request-id"] == answered["x-request-id"]
    trace = TRACEPARENT.fullmatch(engine["traceparent"])
    assert trace is not None and trace[3] == "01" and set(trace[1]) != {"0"} and set(trace[2]) != {"0"}
    again, engine_again = await echoed(cluster)
    assert again["x-request-id"] != answered["x-request-id"]  # one per request
    assert TRACEPARENT.fullmatch(engine_again["traceparent"])[1] != trace[1]


async def test_the_clients_id_and_trace_are_kept_and_the_gateway_is_the_engines_parent(cluster):
    sent = "agent-42:turn/7@host.example"
    answered, engine = await echoed(cluster, **{"X-Request-Id": sent,
                                                "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})
    assert answered["x-request-id"] == engine["x-request-id"] == sent
    trace = TRACEPARENT.fullmatch(engine["traceparent"])
    assert trace is not None and trace[1] == CLIENT_TRACE and trace[3] == "00"  # the client's trace and flags
    assert trace[2] != CLIENT_SPAN  # the gateway's own span in between


@pytest.mark.parametrize("sent", ["has space", "x" * 129, "-leading-dash", "naïve", "a;b", ""])
async def test_an_id_that_is_not_sane_is_replaced(cluster, sent):
    answered, engine = await echoed(cluster, **{"X-Request-Id": sent})
    assert NEW_ID.fullmatch(answered["x-request-id"]) and engine["x-request-id"] == answered["x-request-id"]


@pytest.mark.parametrize("sent", [f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01", f"00-{'0' * 32}-{CLIENT_SPAN}-01",
                                  f"00-{CLIENT_TRACE}-{'0' * 16}-01", f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01",
                                  f"00-{CLIENT_TRACE}-{CLIENT_SPAN}", "garbage"])
async def test_a_traceparent_w3c_refuses_begins_a_new_trace(cluster, sent):
    _, engine = await echoed(cluster, traceparent=sent)
    trace = TRACEPARENT.fullmatch(engine["traceparent"])
    assert trace is not None and trace[1] != CLIENT_TRACE.lower() and trace[3] == "01"


async def test_every_error_names_its_request_in_its_header_and_body(cluster):
    nobody = Client()
    refused = await post(nobody, "chat/completions", {"model": "qwen", "messages": MESSAGES}, **{"X-Request-Id": "r1"})
    assert openai_error(refused, 401, "invalid_api_key") and refused["X-Request-Id"] == "r1"
    keyed = Client(Authorization=f"Bearer {cluster.secret}")
    missing = await post(keyed, "chat/completions", {"model": "nope", "messages": MESSAGES})
    assert NEW_ID.fullmatch(json.loads(missing.content)["request_id"])
    openai_error(missing, 404, "model_not_found")  # the id in its body is the one in its header
    lost = await keyed.get("/v1/nowhere", headers={"X-Request-Id": "r2"})
    assert openai_error(lost, 404, "not_found") and lost["X-Request-Id"] == "r2"
    anthropic_shape = await post(keyed, "messages", {"model": "nope", "max_tokens": 8, "messages": MESSAGES},
                                 **{"X-Request-Id": "r3"})
    body = json.loads(anthropic_shape.content)
    assert anthropic_shape.status_code == 404 and body["type"] == "error" and body["request_id"] == "r3"
    assert anthropic_shape["X-Request-Id"] == "r3"


def gateway_app():
    from gateway.urls import application

    return application()


async def test_the_official_clients_read_the_id_of_an_answer_and_of_an_error(cluster):
    client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=cluster.secret, max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway_app())))
    raw = await client.chat.completions.with_raw_response.create(model="qwen", messages=MESSAGES,
                                                                 extra_headers={"X-Request-Id": "sdk-1"})
    assert raw.headers["x-request-id"] == "sdk-1" and raw.parse().choices[0].message.content
    with pytest.raises(openai.NotFoundError) as failed:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert NEW_ID.fullmatch(failed.value.request_id or "")
    claude = anthropic.AsyncAnthropic(base_url="http://testserver", api_key=cluster.secret, max_retries=0,
                                      http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gateway_app())))
    with pytest.raises(anthropic.NotFoundError) as refused:
        await claude.messages.create(model="nope", max_tokens=8, messages=MESSAGES,
                                     extra_headers={"X-Request-Id": "sdk-2"})
    assert refused.value.request_id == "sdk-2"


async def test_each_request_leaves_its_record_with_its_id_trace_and_what_became_of_it(cluster):
    from asgiref.sync import sync_to_async

    from gateway.models import RequestRecord
    from gateway.runtime import runtime

    _, engine = await echoed(cluster, **{"X-Request-Id": "rec-1"})
    await echoed(cluster, **{"X-Request-Id": "rec-again"})  # the same prompt: the engine's cache serves it
    streamed = await post(Client(Authorization=f"Bearer {cluster.secret}"), "chat/completions",
                          {"model": "qwen", "messages": MESSAGES, "stream": True}, **{"X-Request-Id": "rec-stream"})
    await read(streamed)  # its usage (and the engine's timings) asked for by the gateway, the client not told
    refused = await post(Client(Authorization=f"Bearer {cluster.secret}"), "chat/completions",
                         {"model": "nope", "messages": MESSAGES}, **{"X-Request-Id": "rec-2"})
    assert refused.status_code == 404
    nul = await post(Client(Authorization=f"Bearer {cluster.secret}"), "chat/completions",
                     {"model": "no\u0000pe", "messages": MESSAGES}, **{"X-Request-Id": "rec-nul"})
    assert nul.status_code == 404  # and its record is written, on PostgreSQL too (its text holds no NUL)
    await runtime().books()  # what the process wrote every second anyway

    def kept(rid):
        return RequestRecord.objects.filter(request_id=rid).values(
            "key__name", "model", "asked", "surface", "streamed", "status", "error", "priority", "replica",
            "attempts", "prompt_tokens", "completion_tokens", "client", "trace_id", "total_ms", "waited_ms").get()

    served, lost = await sync_to_async(kept)("rec-1"), await sync_to_async(kept)("rec-2")
    assert (await sync_to_async(kept)("rec-nul"))["asked"] == "no\ufffdpe"
    assert served["trace_id"] == TRACEPARENT.fullmatch(engine["traceparent"])[1]
    assert served["replica"] and served["total_ms"] > 0 and served["waited_ms"] is not None
    assert {k: served[k] for k in ("key__name", "model", "asked", "surface", "streamed", "status", "error",
                                   "priority", "attempts", "prompt_tokens", "completion_tokens", "client")} == {
        "key__name": "ci", "model": "qwen", "asked": "qwen", "surface": "chat/completions", "streamed": False,
        "status": 200, "error": "", "priority": "standard", "attempts": 1, "prompt_tokens": 3,
        "completion_tokens": 5, "client": "127.0.0.1"}
    assert (lost["status"], lost["error"], lost["model"], lost["asked"], lost["replica"], lost["attempts"]) == (
        404, "model_not_found", "nope", "nope", "", 0)
    # what the engine said of its cache and time (llama.cpp's `timings`, as tests/engine.py says them), its spans
    again = await sync_to_async(RequestRecord.objects.get)(request_id="rec-again")
    assert (again.cached_tokens, again.prompt_ms, again.generation_ms) == (2, 0.1, 0.0)
    stream = await sync_to_async(RequestRecord.objects.get)(request_id="rec-stream")
    assert (stream.streamed, stream.cached_tokens, stream.prompt_ms, stream.completion_tokens) == (True, 2, 0.1, 5)
    first = await sync_to_async(RequestRecord.objects.get)(request_id="rec-1")
    assert first.span_id == TRACEPARENT.fullmatch(engine["traceparent"])[2] and first.parent_id == ""
    assert first.position is None and [t[0] for t in first.tries] == [served["replica"]] and first.tries[0][3] == (
        "answered 200")
    assert first.route == {"policy": "prefix", "hit": "prefix", "chosen": f"{served['replica']} (0 in flight)",
                           "passed": []}


async def test_a_key_that_logs_bodies_has_them_kept_cut_at_the_limit_and_never_a_header(cluster):
    from asgiref.sync import sync_to_async

    from cluster import notify
    from gateway.models import ApiKey, RequestRecord
    from gateway.runtime import runtime
    from tests.gateway.views.harness import add_key

    logged = await sync_to_async(add_key)("logged")
    await sync_to_async(lambda: ApiKey.objects.filter(name="logged").update(log_bodies=True))()
    await sync_to_async(notify.routing_changed)()
    keyed, unlogged = Client(Authorization=f"Bearer {logged}"), Client(Authorization=f"Bearer {cluster.secret}")
    sent = {"model": "qwen", "messages": MESSAGES}
    assert (await post(keyed, "chat/completions", sent, **{"X-Request-Id": "b-once"})).status_code == 200
    streamed = await post(keyed, "chat/completions", {**sent, "stream": True}, **{"X-Request-Id": "b-stream"})
    passed = await read(streamed)
    await post(keyed, "chat/completions", {**sent, "model": "nope"}, **{"X-Request-Id": "b-refused"})
    await post(unlogged, "chat/completions", sent, **{"X-Request-Id": "b-not"})
    runtime().body_bytes = 40  # as LLMGW_REQUEST_LOG_BODY_BYTES=40 would
    await post(keyed, "chat/completions", sent, **{"X-Request-Id": "b-cut"})
    await runtime().books()

    def bodies(rid):
        return RequestRecord.objects.values_list("request_body", "response_body").get(request_id=rid)

    once_sent, once_answered = await sync_to_async(bodies)("b-once")
    assert json.loads(once_sent) == sent and json.loads(once_answered)["choices"][0]["message"]["content"]
    stream_sent, stream_answered = await sync_to_async(bodies)("b-stream")
    assert json.loads(stream_sent)["stream"] is True and stream_answered == passed.decode()  # as the client got it
    refused_sent, refused_answered = await sync_to_async(bodies)("b-refused")
    assert json.loads(refused_answered)["error"]["code"] == "model_not_found"
    assert await sync_to_async(bodies)("b-not") == ("", "")  # its key keeps none
    cut_sent, cut_answered = await sync_to_async(bodies)("b-cut")
    assert cut_sent == json.dumps(sent)[:40] + "\n[… cut at 40 bytes]" and cut_answered.endswith("\n[… cut at 40 bytes]")
    every = "".join(await sync_to_async(lambda: [a + b for a, b in RequestRecord.objects.values_list(
        "request_body", "response_body")])())
    # never a header: the client's key is in none (the test engine's echo shows the engine's own key it was sent)
    assert logged not in every and cluster.secret not in every and "sk-llmgw" not in every
