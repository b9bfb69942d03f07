"""Answers that outlive their engine (gateway/resume.py): a model of two replicas, each a tests/engine.py process
streaming one word every 20 ms; the one answering is killed (SIGKILL), stopped (SIGSTOP: a silent engine) or
leaves the fleet (its replica failed) mid-answer, and the official SDKs, reading through the gateway's own ASGI
application, get the whole answer: every word once, in order, the finish it would have had, and usage that
counts what they received."""

import asyncio
import json
import secrets

import pytest
from asgiref.sync import sync_to_async

from cluster import notify
from cluster.models import Event, Replica
from gateway.models import RequestRecord, Usage
from gateway.runtime import runtime
from tests.factories import make_model
from tests.gateway.views.harness import Engine, add_key, events, key_client, post, read, ready_replica
from tests.gateway.views.test_sdk_streams import anthropic_client, openai_client

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

WORDS = [f"w{i}" for i in range(40)]
ANSWER = " ".join(WORDS)
SAY = [{"role": "user", "content": "count"}]


class Pair:
    """Model `twice` ready on two engines, the first of them to stream `after` tokens of an answer failing then
    (`how`: exits, or stalls), once; `broke()` is the replica that did."""

    def __init__(self, tmp_path, cluster, after: int, how: str, *args: str, **model_fields):
        self.marker = tmp_path / f"broke-{secrets.token_hex(4)}"
        self.engines = [Engine(tmp_path, "--answer", ANSWER, "--delay-ms", "20", "--break-after", str(after),
                               "--break-how", how, "--break-marker", str(self.marker), *args) for _ in range(2)]
        self.model = make_model("twice", **model_fields)
        self.replicas = [ready_replica(self.model, cluster.node, e.port) for e in self.engines]

    async def broke(self) -> Replica:
        for _ in range(500):
            if self.marker.exists() and (port := self.marker.read_text()):
                return next(r for r, e in zip(self.replicas, self.engines, strict=True) if str(e.port) == port)
            await asyncio.sleep(0.01)
        raise AssertionError("no engine broke off")

    def close(self) -> None:
        for e in self.engines:
            if e.process.poll() is None:
                e.process.kill()
                e.process.wait(5)


@pytest.fixture
def pair(cluster, tmp_path):
    made: list[Pair] = []

    def make(after: int = 10, how: str = "exit", *args: str, **model_fields) -> Pair:
        made.append(Pair(tmp_path, cluster, after, how, *args, **model_fields))
        return made[-1]

    yield make
    for p in made:
        p.close()


async def _new_pair(pair, *args, **fields) -> Pair:
    return await sync_to_async(pair)(*args, **fields)


async def _record(answer_id: str) -> RequestRecord:
    await runtime().books()  # what the process writes every second anyway
    return await sync_to_async(RequestRecord.objects.get)(request_id=answer_id)


async def test_a_chat_stream_whose_engine_dies_goes_on_at_the_other_replica(cluster, pair):
    p = await _new_pair(pair)
    raw = await openai_client(cluster.secret).chat.completions.with_raw_response.create(
        model="twice", messages=SAY, stream=True, stream_options={"include_usage": True}, seed=7)
    text, ids, finish, usage = "", set(), None, None
    async for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.choices:
            assert not chunk.choices[0].delta.role or not text, "the role once, at the start"
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == ANSWER and finish == "stop" and len(ids) == 1
    assert usage.completion_tokens == len(WORDS)
    assert usage.prompt_tokens == 1  # the client's prompt ("count"), not the continuation's
    # its record, its key's usage and the Event of the replica that broke off, once the books are written
    broken = await p.broke()
    record = await _record(raw.headers["x-request-id"])
    (broke, went_on) = record.tries
    assert record.resumes == 1 and record.resumed_prompt_tokens > 1 and record.completion_tokens == len(WORDS)
    assert broke[0] == broken.name and broke[3].startswith("broke off after 10 tokens: "), broke
    assert broke[3].endswith("; resumed") and went_on[3] == "answered 200" and went_on[0] != broken.name
    usage_row = await sync_to_async(Usage.objects.get)(model="twice")
    assert (usage_row.prompt_tokens, usage_row.completion_tokens) == (1, len(WORDS))  # the key's: as it received
    assert usage_row.resumed_prompt_tokens == record.resumed_prompt_tokens  # the fleet's
    event = await sync_to_async(Event.objects.get)(kind="replica.broke_off")
    assert event.subject == broken.name and "1 answer" in event.message, event.message


@pytest.mark.parametrize("sparse", [False, True])
async def test_a_messages_stream_survives_its_engine_through_the_anthropic_sdk(cluster, pair, sparse):
    p = await _new_pair(pair, 12, "exit", *(["--sparse"] if sparse else []))
    async with anthropic_client(cluster.secret).messages.stream(model="twice", max_tokens=64, messages=SAY) as s:
        text = "".join([piece async for piece in s.text_stream])
        final = await s.get_final_message()
    assert text == ANSWER and [b.text for b in final.content] == [ANSWER]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(WORDS)
    await p.broke()
    assert (await _record(s.response.headers["x-request-id"])).resumes == 1


@pytest.mark.parametrize("sparse", [False, True])
async def test_a_responses_stream_survives_its_engine_through_the_openai_sdk(cluster, pair, sparse):
    p = await _new_pair(pair, 15, "exit", *(["--sparse"] if sparse else []))
    async with openai_client(cluster.secret).responses.stream(model="twice", input="count") as s:
        got = [event async for event in s]
        final = await s.get_final_response()
    assert final.output_text == ANSWER and len(final.output) == 1
    assert [e.sequence_number for e in got] == list(range(len(got)))
    deltas = [e for e in got if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == ANSWER
    assert {(e.output_index, e.content_index, e.item_id) for e in deltas} == {(0, 0, final.output[0].id)}
    assert len({e.response.id for e in got if e.type in ("response.created", "response.completed")}) == 1
    assert [e.type for e in got].count("response.output_item.added") == 1
    assert final.usage.output_tokens == len(WORDS)
    await p.broke()


async def test_a_completion_stream_goes_on_with_what_it_had_at_the_end_of_its_prompt(cluster, pair):
    p = await _new_pair(pair, 5)
    stream = await openai_client(cluster.secret).completions.create(model="twice", prompt="count:", stream=True,
                                                                    max_tokens=30)
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert text == " ".join(WORDS[:30]) and finish == "length"  # only the tokens still owed were asked for
    await p.broke()


async def test_an_answer_that_had_all_it_was_owed_is_ended_by_the_gateway(cluster, pair):
    """Its engine failed after the last token it was asked for, before its finish: nothing more to ask for."""
    p = await _new_pair(pair, 6)
    answer = await post(key_client(cluster.secret), "chat/completions",
                        {"model": "twice", "messages": SAY, "stream": True, "max_tokens": 6,
                         "stream_options": {"include_usage": True}})
    got = events(await read(answer))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in got[:-1] if isinstance(e, dict)
                   and e["choices"]) == " ".join(WORDS[:6])
    assert [e["choices"][0]["finish_reason"] for e in got[:-2] if e["choices"]][-1] == "length"
    assert got[-2]["usage"]["completion_tokens"] == 6 and got[-1] == "[DONE]"
    await p.broke()


async def test_a_silent_engine_is_left_after_the_stream_idle_timeout(cluster, pair):
    p = await _new_pair(pair, 8, "stall", stream_idle_timeout_seconds=1)
    answer = await post(key_client(cluster.secret), "messages",
                        {"model": "twice", "messages": SAY, "stream": True, "max_tokens": 64})
    got = events(await read(answer))
    assert "".join(e["delta"]["text"] for e in got if e.get("type") == "content_block_delta") == ANSWER
    broken = await p.broke()
    record = await _record(answer["x-request-id"])
    assert record.tries[0][0] == broken.name and record.tries[0][3] == "went silent for 1s after 8 tokens; resumed"


async def test_a_stream_whose_replica_leaves_the_fleet_goes_on_at_once(cluster, pair):
    """Its engine still there but silent (a node cut off, say: the connection may never say so), and no idle
    timeout to notice: its replica failed, as the reconciler finds a lost node's, is enough."""
    p = await _new_pair(pair, 8, "stall", stream_idle_timeout_seconds=600)
    answer = await post(key_client(cluster.secret), "responses",
                        {"model": "twice", "input": "count", "stream": True})
    reading = asyncio.ensure_future(read(answer))
    broken = await p.broke()
    await sync_to_async(_failed)(broken)
    got = events(await asyncio.wait_for(reading, 30))
    assert "".join(e["delta"] for e in got if e.get("type") == "response.output_text.delta") == ANSWER
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == ANSWER
    record = await _record(answer["x-request-id"])
    assert "left the fleet" in record.tries[0][3]


def _failed(replica: Replica) -> None:
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.FAILED)
    notify.routing_changed()


async def test_a_whole_answer_cut_off_half_way_is_asked_again_of_the_other(cluster, pair):
    p = await _new_pair(pair, 0, "cut")
    answer = await post(key_client(cluster.secret), "chat/completions", {"model": "twice", "messages": SAY})
    assert answer.status_code == 200, answer.content
    assert json.loads(answer.content)["choices"][0]["message"]["content"] == ANSWER
    broken = await p.broke()
    record = await _record(answer["x-request-id"])
    assert record.resumes == 1 and record.tries[0][0] == broken.name, record.tries
    assert record.tries[0][3].startswith("broke off: ") and record.tries[0][3].endswith("; resumed")


@pytest.mark.parametrize("endpoint", ["chat/completions", "embeddings"])
async def test_a_whole_answer_whose_engine_dies_before_it_is_sent_again_to_the_other(cluster, pair, endpoint):
    """Its engine exits before a byte of the answer: failover, as before an answer (and embeddings alike)."""
    p = await _new_pair(pair, 0, "exit", profile="embeds")
    body = {"model": "twice", "messages": SAY} if endpoint == "chat/completions" else {"model": "twice", "input": "x"}
    answer = await post(key_client(cluster.secret), endpoint, body)
    assert answer.status_code == 200, answer.content
    broken = await p.broke()
    record = await _record(answer["x-request-id"])
    assert record.attempts == 2 and record.tries[0][0] == broken.name and record.tries[0][3].startswith("failed: ")


async def test_a_whole_answer_waiting_on_a_replica_that_leaves_the_fleet_goes_to_the_other(cluster, pair):
    p = await _new_pair(pair, 0, "stall")
    asking = asyncio.ensure_future(post(key_client(cluster.secret), "chat/completions",
                                        {"model": "twice", "messages": SAY}))
    await sync_to_async(_failed)(await p.broke())
    answer = await asyncio.wait_for(asking, 30)
    assert answer.status_code == 200 and json.loads(answer.content)["choices"][0]["message"]["content"] == ANSWER
    record = await _record(answer["x-request-id"])
    assert "left the fleet" in record.tries[0][3]


async def test_a_model_that_resumes_nothing_ends_the_stream_with_its_error_as_before(cluster, pair):
    await _new_pair(pair, resume_limit=0)
    answer = await post(key_client(cluster.secret), "chat/completions",
                        {"model": "twice", "messages": SAY, "stream": True})
    got = events(await read(answer))
    assert got[-1] == "[DONE]" and "broke off" in got[-2]["error"]["message"]


async def test_an_answer_resumed_as_often_as_its_limit_allows_then_ends_with_the_error(cluster, tmp_path):
    """Two engines that each fail after 10 tokens, a limit of one resume."""
    engines = [Engine(tmp_path, "--answer", ANSWER, "--delay-ms", "5", "--break-after", "10") for _ in range(2)]
    try:
        model = await sync_to_async(make_model)("twice", resume_limit=1)
        for e in engines:
            await sync_to_async(ready_replica)(model, cluster.node, e.port)
        answer = await post(key_client(cluster.secret), "chat/completions",
                            {"model": "twice", "messages": SAY, "stream": True})
        got = events(await read(answer))
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in got[:-2] if e.get("choices")) == \
            " ".join(WORDS[:20])
        assert got[-1] == "[DONE]" and "broke off" in got[-2]["error"]["message"]
    finally:
        for e in engines:
            e.stop()


@pytest.mark.parametrize("surface", ["responses", "messages"])
async def test_an_answer_resumed_twice_is_still_one_answer(cluster, tmp_path, surface):
    """Three engines leaving fields out as llama.cpp's server does, each failing after 15 tokens: the answer goes
    on twice, its third part from the third engine, and the SDK's own accumulation builds it whole."""
    engines = [Engine(tmp_path, "--answer", ANSWER, "--delay-ms", "5", "--break-after", "15", "--sparse")
               for _ in range(3)]
    try:
        model = await sync_to_async(make_model)("twice", resume_limit=2)
        for e in engines:
            await sync_to_async(ready_replica)(model, cluster.node, e.port)
        if surface == "responses":
            async with openai_client(cluster.secret).responses.stream(model="twice", input="count") as s:
                got = [event async for event in s]
                final = await s.get_final_response()
            assert final.output_text == ANSWER and final.usage.output_tokens == len(WORDS)
            assert [e.sequence_number for e in got] == list(range(len(got)))
        else:
            async with anthropic_client(cluster.secret).messages.stream(model="twice", max_tokens=64,
                                                                        messages=SAY) as s:
                text = "".join([piece async for piece in s.text_stream])
                final = await s.get_final_message()
            assert text == ANSWER and [b.text for b in final.content] == [ANSWER]
        await runtime().books()
        record = await sync_to_async(RequestRecord.objects.get)(model="twice")
        outcomes = [t[3] for t in record.tries]  # the first engine, dead, tried again before the table heard of it
        assert record.resumes == 2 and sum(o.endswith("; resumed") for o in outcomes) == 2, outcomes
        assert outcomes[-1] == "answered 200" and all(o.startswith(("broke off", "failed")) for o in outcomes[:-1])
    finally:
        for e in engines:
            e.stop()


async def test_a_keys_budget_and_rate_count_what_it_received_not_what_the_resume_cost(cluster, pair):
    """The continuation's prompt (the conversation and the 20 words already sent) is the fleet's cost: the key's
    budget and tokens per minute settle to its prompt and the 40 words it got."""
    from tests.gateway.views.test_budgets import count_of, held, settled

    p = await _new_pair(pair, 20)
    secret = await sync_to_async(add_key)("resumed", budget_tokens=1000, budget_period="day", tpm=1000)
    answer = await post(key_client(secret), "chat/completions", {
        "model": "twice", "messages": SAY, "stream": True, "max_tokens": 64, "stream_options": {"include_usage": True}})
    got = events(await read(answer))
    assert answer.status_code == 200 and got[-2]["usage"]["completion_tokens"] == 40, (answer.content, got[-3:])
    await p.broke()
    await settled()
    assert held(await sync_to_async(count_of)("resumed", "day")) == 41
    record = await _record(answer["x-request-id"])
    assert record.resumes == 1 and record.resumed_prompt_tokens == 1 + 20  # the prompt and the 20 words, prefilled
