"""Each request through /v1/ as an OpenTelemetry span, exported over OTLP/HTTP (protobuf) where
OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set when the web process's gateway starts;
with neither, nothing here is made and a request pays nothing. The SDK reads the other standard OTEL_* variables
itself (headers, timeout, batch delay, sampler, resource); the service is `llmgw` unless they name another.

A request hands its record (gateway/records.py's Row) over as it ends: one append to a deque, whether the records
are written or not. A thread of the process turns the rows into spans a few times a second, and the SDK's batch
processor exports them from a thread of its own: no client waits on either.

A request's span (kind SERVER, named as the GenAI conventions name an operation: `chat smollm2`) keeps the trace
and the span id the engine was told in its `traceparent` (gateway/tracing.py), with the client's span, when it
sent one, its parent. Its children: `queue` (waiting for a replica and a slot) and one `attempt REPLICA` per
replica it was sent to. The client's sampled flag is not kept in the record: every request's span is exported,
unless OTEL_TRACES_SAMPLER says otherwise."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import TYPE_CHECKING, cast

from gateway.records import KEPT, Row

if TYPE_CHECKING:  # the SDK's tracing and exporter are imported only where spans are made
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.util.types import AttributeValue

log = logging.getLogger("llmgw.gateway")
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
TURN = 0.2  # seconds between two passes of the thread that makes the spans
# the GenAI conventions' operation for each API (gateway/surfaces.py's paths); the others keep their own name
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "messages": "chat", "responses": "chat", "messages/count_tokens": "count_tokens"}


def wanted() -> bool:
    """Whether this process exports spans: an OTLP endpoint is set (the SDK's own variables)."""
    return any(os.environ.get(name) for name in ENDPOINTS)


def start() -> Spans | None:
    """This process's spans, exported over OTLP/HTTP, where an endpoint is set; else None (nothing made)."""
    if not wanted():
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return Spans(BatchSpanProcessor(OTLPSpanExporter()))


class _Given:
    """The SDK's IdGenerator: the ids a request already has (the engine was told its span as its parent) for the
    span made next; random ones for the rest (its children)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self.trace_id = self.span_id = 0
        self._random = RandomIdGenerator()

    def is_trace_id_random(self) -> bool:
        return True  # asked only of a trace llmgw began, whose id is random (gateway/tracing.py)

    def generate_trace_id(self) -> int:
        given, self.trace_id = self.trace_id, 0
        return given or self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        given, self.span_id = self.span_id, 0
        return given or self._random.generate_span_id()


def _ns(at: float, ms: float = 0.0) -> int:
    return int((at + ms / 1000) * 1e9)


def _hex(value: str) -> int:
    try:
        return int(value, 16)
    except ValueError:
        return 0


def attributes(row: Row) -> dict[str, AttributeValue]:
    """A request's span's attributes: the GenAI and HTTP conventions' where they fit, llmgw's own for the rest."""
    found: dict[str, AttributeValue] = {
        "gen_ai.operation.name": OPERATIONS.get(row.surface, row.surface),
        "gen_ai.request.model": row.asked,
        "gen_ai.request.stream": row.streamed,
        "http.response.status_code": row.status,
        "llmgw.request_id": row.request_id,
        "llmgw.priority": row.priority,
        "llmgw.attempts": row.attempts,
    }
    if row.model and row.model != "-":
        found["gen_ai.response.model"] = row.model
    if row.prompt_tokens or row.completion_tokens:
        found["gen_ai.usage.input_tokens"] = row.prompt_tokens
        found["gen_ai.usage.output_tokens"] = row.completion_tokens
    if row.cached_tokens:
        found["gen_ai.usage.cache_read.input_tokens"] = row.cached_tokens
    if row.ttft_ms is not None:
        found["gen_ai.response.time_to_first_chunk"] = row.ttft_ms / 1000
    if row.error or row.status >= 500:
        found["error.type"] = row.error or str(row.status)
    if row.client:
        found["client.address"] = row.client
    if row.key_id is not None:
        found["llmgw.key_id"] = row.key_id
    if row.replica:
        found["llmgw.replica"] = row.replica
    if row.route is not None:
        found["llmgw.route.policy"] = row.route.policy
        found["llmgw.route.hit"] = row.route.hit
        found["llmgw.route.chosen"] = row.route.chosen
    if row.position is not None:
        found["llmgw.queue.position"] = row.position
    if row.waited_ms is not None:
        found["llmgw.queue.waited_ms"] = row.waited_ms
    if row.prompt_ms is not None:
        found["llmgw.prompt_ms"] = row.prompt_ms
    if row.generation_ms is not None:
        found["llmgw.generation_ms"] = row.generation_ms
    return found


def _answered(outcome: str) -> int | None:
    """The status an attempt's engine answered with ("answered 503": 503), None where it did not answer."""
    said = outcome.removeprefix("answered ")
    return int(said) if said != outcome and said.isdigit() else None


class Spans:
    """This process's requests as spans: rows handed over as requests end (`add`), made into spans on a thread of
    their own, given to `processor` (the SDK's batch processor in front of the OTLP exporter)."""

    def __init__(self, processor: SpanProcessor) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider

        self.ids = _Given()
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "llmgw"}))
        self.provider = TracerProvider(resource=resource, id_generator=cast("IdGenerator", self.ids),
                                       shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("llmgw.gateway")
        self.waiting: deque[Row] = deque(maxlen=KEPT)  # past KEPT (an exporter stuck), the oldest are dropped
        self.add = self.waiting.append  # what a request's end does: nothing more
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="llmgw-spans", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(TURN):
            self.make_waiting()

    def make_waiting(self) -> None:
        while self.waiting:
            row = self.waiting.popleft()
            try:
                self.make(row)
            except Exception:  # one odd row costs its own span, never the thread
                if not self._failed:
                    self._failed = True
                    log.exception("could not make the span of request %s", row.request_id)

    def make(self, row: Row) -> None:
        """The request's span and its children, ended at the times its record says."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        parent = None
        if row.parent_id and (trace_id := _hex(row.trace_id)) and (parent_id := _hex(row.parent_id)):
            remote = SpanContext(trace_id, parent_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        self.ids.trace_id, self.ids.span_id = _hex(row.trace_id), _hex(row.span_id)
        operation = OPERATIONS.get(row.surface, row.surface)
        model = row.model if row.model and row.model != "-" else row.asked
        span = self.tracer.start_span(f"{operation} {model}" if model else operation, context=parent,
                                      kind=SpanKind.SERVER, attributes=attributes(row), start_time=_ns(row.at))
        self.ids.trace_id = self.ids.span_id = 0
        within = trace.set_span_in_context(span)
        if row.waited_ms:
            queued = {} if row.position is None else {"llmgw.queue.position": row.position}
            self.tracer.start_span("queue", context=within, attributes=queued,
                                   start_time=_ns(row.at)).end(_ns(row.at, row.waited_ms))
        for attempt in row.tries:
            status = _answered(attempt.outcome)
            said: dict[str, AttributeValue] = {"llmgw.replica": attempt.replica,
                                               "llmgw.attempt.outcome": attempt.outcome}
            if status is not None:
                said["http.response.status_code"] = status
            child = self.tracer.start_span(f"attempt {attempt.replica}", context=within, kind=SpanKind.CLIENT,
                                           attributes=said, start_time=_ns(row.at, attempt.started_ms))
            if status is None or status >= 400:
                child.set_status(Status(StatusCode.ERROR, attempt.outcome))
            child.end(_ns(row.at, attempt.ended_ms))
        if row.status >= 500:
            span.set_status(Status(StatusCode.ERROR, row.error or None))
        span.end(_ns(row.at, row.total_ms))

    def close(self) -> None:
        """The thread stopped, what is waiting made into spans, and every span exported (the process stopping)."""
        self._stop.set()
        self._thread.join()
        self.make_waiting()
        self.provider.shutdown()
