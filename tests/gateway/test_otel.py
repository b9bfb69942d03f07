"""A request's record made into its spans (gateway/otel.py), given to the SDK's in-memory exporter: the ids the
engine was told, the client's span its parent, the queue and each attempt its children, the GenAI attributes.
(tests/gateway/views/test_otel.py exports them through the gateway to an OTLP receiver.)"""

import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway import otel
from gateway.records import Row, Try, Why

TRACE, SPAN, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "a3ce929d0e0e4736", "00f067aa0ba902b7"


def row(**changed) -> Row:
    made = Row(
        request_id="req-1", trace_id=TRACE, at=1_800_000_000.25, key_id=7, model="smollm2", asked="small",
        surface="chat/completions", streamed=True, status=200, error="", priority="interactive", waited_ms=40.0,
        replica="local/smollm2/1", attempts=2, ttft_ms=120.0, total_ms=500.0, prompt_tokens=11, completion_tokens=5,
        client="127.0.0.1", span_id=SPAN, parent_id=PARENT, position=3,
        route=Why("prefix", "prefix", "local/smollm2/1 (0 in flight)", ()),
        tries=(Try("local/smollm2/0", 40.0, 60.0, "connect failed: refused"),
               Try("local/smollm2/1", 61.0, 499.0, "answered 200")),
        cached_tokens=4, prompt_ms=30.0, generation_ms=300.0, request_body="", response_body="")
    return made._replace(**changed)


@pytest.fixture
def exported():
    memory = InMemorySpanExporter()
    spans = otel.Spans(SimpleSpanProcessor(memory))

    def made(*rows: Row) -> dict:
        for each in rows:
            spans.add(each)
        spans.close()
        return {span.name: span for span in memory.get_finished_spans()}

    return made


def test_a_request_is_a_server_span_with_the_ids_the_engine_was_told_and_the_clients_span_its_parent(exported):
    spans = exported(row())
    request = spans["chat smollm2"]
    assert request.kind is SpanKind.SERVER
    assert f"{request.context.trace_id:032x}" == TRACE and f"{request.context.span_id:016x}" == SPAN
    assert request.parent is not None and request.parent.is_remote and f"{request.parent.span_id:016x}" == PARENT
    assert request.start_time == int(1_800_000_000.25 * 1e9)
    assert request.end_time - request.start_time == pytest.approx(500e6, abs=1e3)
    assert request.status.status_code is StatusCode.UNSET
    assert request.resource.attributes["service.name"] == "llmgw"
    assert dict(request.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "small", "gen_ai.response.model": "smollm2",
        "gen_ai.request.stream": True, "gen_ai.usage.input_tokens": 11, "gen_ai.usage.output_tokens": 5,
        "gen_ai.usage.cache_read.input_tokens": 4, "gen_ai.response.time_to_first_chunk": 0.12,
        "http.response.status_code": 200, "client.address": "127.0.0.1", "llmgw.request_id": "req-1",
        "llmgw.key_id": 7, "llmgw.priority": "interactive", "llmgw.attempts": 2, "llmgw.replica": "local/smollm2/1",
        "llmgw.route.policy": "prefix", "llmgw.route.hit": "prefix",
        "llmgw.route.chosen": "local/smollm2/1 (0 in flight)", "llmgw.queue.position": 3,
        "llmgw.queue.waited_ms": 40.0, "llmgw.prompt_ms": 30.0, "llmgw.generation_ms": 300.0}


def test_the_queue_and_each_attempt_are_its_children(exported):
    spans = exported(row())
    request, queue = spans["chat smollm2"], spans["queue"]
    failed, answered = spans["attempt local/smollm2/0"], spans["attempt local/smollm2/1"]
    for child in (queue, failed, answered):
        assert child.parent.span_id == request.context.span_id and child.context.trace_id == request.context.trace_id
        assert child.context.span_id != request.context.span_id
    start = request.start_time
    assert (queue.start_time - start, queue.end_time - start) == pytest.approx((0, 40e6), abs=1e3)
    assert queue.attributes["llmgw.queue.position"] == 3
    assert (failed.start_time - start, failed.end_time - start) == pytest.approx((40e6, 60e6), abs=1e3)
    assert failed.kind is SpanKind.CLIENT and failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["llmgw.attempt.outcome"] == "connect failed: refused"
    assert "http.response.status_code" not in failed.attributes
    assert answered.status.status_code is StatusCode.UNSET and answered.attributes["http.response.status_code"] == 200


def test_a_request_that_began_its_trace_has_no_parent_and_one_that_failed_says_why(exported):
    spans = exported(row(parent_id="", status=503, error="no_replica", waited_ms=None, position=None,
                         tries=(Try("local/smollm2/1", 0.5, 9.0, "answered 503"),), prompt_tokens=0,
                         completion_tokens=0, cached_tokens=0, ttft_ms=None, surface="completions"))
    request = spans["text_completion smollm2"]
    assert request.parent is None and f"{request.context.trace_id:032x}" == TRACE
    assert f"{request.context.span_id:016x}" == SPAN
    assert request.status.status_code is StatusCode.ERROR and request.attributes["error.type"] == "no_replica"
    assert "queue" not in spans and "gen_ai.usage.input_tokens" not in request.attributes
    assert spans["attempt local/smollm2/1"].status.status_code is StatusCode.ERROR


def test_a_refusal_before_any_model_is_named_by_its_operation_alone_and_a_4xx_is_no_error(exported):
    spans = exported(row(model="", asked="", status=401, error="invalid_api_key", key_id=None, route=None,
                         replica="", tries=(), waited_ms=None, position=None, trace_id="", span_id="", parent_id=""))
    request = spans["chat"]
    assert request.status.status_code is StatusCode.UNSET and request.attributes["error.type"] == "invalid_api_key"
    assert request.context.trace_id and request.context.span_id  # new ones where the request had none
    assert "llmgw.key_id" not in request.attributes and "gen_ai.response.model" not in request.attributes


def test_each_row_is_made_on_the_thread_not_by_the_request_that_hands_it_over():
    memory = InMemorySpanExporter()
    spans = otel.Spans(SimpleSpanProcessor(memory))
    try:
        spans.add(row())  # a deque's append: the thread makes its spans at its next turn
        deadline = time.monotonic() + 5
        while len(memory.get_finished_spans()) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(memory.get_finished_spans()) == 4  # the request, its queue, its two attempts
    finally:
        spans.close()


def test_nothing_is_made_without_an_otlp_endpoint(monkeypatch):
    for name in otel.ENDPOINTS:
        monkeypatch.delenv(name, raising=False)
    assert otel.start() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    spans = otel.start()
    assert spans is not None
    spans.close()
