"""With OTEL_EXPORTER_OTLP_ENDPOINT set, each request through the gateway is a span exported over OTLP/HTTP
(gateway/otel.py): here to a real OTLP receiver the test starts (POST /v1/traces, protobuf, read with
opentelemetry-proto's own messages), the requests made with the official `openai` client through the gateway's
handler to tests/engine.py, which echoes the `traceparent` it got."""

import asyncio
import gzip
import json
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.gateway.views.harness import MESSAGES

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP receiver on loopback: every span of every export it is sent, with its resource's attributes."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[dict, Span]] = []
        self.paths: set[str] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        encoding = self.headers.get("Content-Encoding", "")
        body = gzip.decompress(body) if encoding == "gzip" else zlib.decompress(body) if encoding == "deflate" else body
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(404 if self.path != "/v1/traces" else 415)
            return
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            self.server.paths.add(self.path)
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans.extend((resource, span) for span in scope_spans.spans)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def attributes(pairs) -> dict:
    found = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        found[pair.key] = getattr(pair.value, kind) if kind else None
    return found


@pytest.fixture
def receiver(monkeypatch):
    started = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{started.server_address[1]}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: exported at once, not every 5 s
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    yield started
    started.shutdown()
    started.server_close()


def gateway_app():
    from gateway.urls import application

    return application()


async def test_each_request_is_exported_as_a_span_with_the_trace_the_engine_continues(cluster, receiver):
    client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=cluster.secret, max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway_app())))

    async def sent(request_id: str, **headers) -> dict:
        raw = await client.chat.completions.with_raw_response.create(
            model="qwen", messages=MESSAGES, extra_headers={"X-Request-Id": request_id, **headers})
        assert raw.parse().choices[0].message.content
        return json.loads(raw.http_response.content)["echo"]["headers"]

    continued = await sent("otel-1", traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    begun = await sent("otel-2")

    for engine, parent in ((continued, CLIENT_SPAN), (begun, "")):
        _, trace_id, span_id, _ = engine["traceparent"].split("-")
        resource, span = await exported(receiver, engine["x-request-id"])
        assert span.trace_id.hex() == trace_id and span.span_id.hex() == span_id  # the engine's parent
        assert span.parent_span_id.hex() == parent
        assert span.kind == Span.SPAN_KIND_SERVER and span.name == "chat qwen"
        assert resource["service.name"] == "llmgw"
        said = attributes(span.attributes)
        assert said["gen_ai.operation.name"] == "chat" and said["gen_ai.request.model"] == "qwen"
        assert said["gen_ai.response.model"] == "qwen" and said["http.response.status_code"] == 200
        assert said["gen_ai.usage.output_tokens"] == 5 and said["gen_ai.usage.input_tokens"] > 0
        assert said["llmgw.replica"] and said["llmgw.route.policy"]
        assert span.status.code != Status.STATUS_CODE_ERROR
        children = {child.name: child for _, child in receiver.spans if child.parent_span_id == span.span_id}
        attempt = children[f"attempt {said['llmgw.replica']}"]
        assert attempt.trace_id == span.trace_id and attempt.kind == Span.SPAN_KIND_CLIENT
        assert attributes(attempt.attributes)["llmgw.attempt.outcome"] == "answered 200"
        assert span.start_time_unix_nano <= attempt.start_time_unix_nano <= attempt.end_time_unix_nano
        assert attempt.end_time_unix_nano <= span.end_time_unix_nano
        queue = children["queue"]  # the wait for a replica and a slot, however short
        assert queue.start_time_unix_nano == span.start_time_unix_nano
        waited = (queue.end_time_unix_nano - queue.start_time_unix_nano) / 1e6
        assert waited == pytest.approx(said["llmgw.queue.waited_ms"], abs=0.01)
    assert receiver.paths == {"/v1/traces"}


async def test_spans_are_exported_with_the_request_records_off(cluster, receiver, settings):
    settings.LLMGW_REQUEST_LOG = False
    client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=cluster.secret, max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway_app())))
    await client.chat.completions.create(model="qwen", messages=MESSAGES, extra_headers={"X-Request-Id": "otel-3"})
    from gateway.runtime import runtime

    assert runtime().records is None
    _, span = await exported(receiver, "otel-3")
    assert span.name == "chat qwen" and attributes(span.attributes)["http.response.status_code"] == 200


async def exported(receiver: Receiver, request_id: str, timeout: float = 10.0) -> tuple[dict, Span]:
    """The span of the request with this id, once the receiver has it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with receiver.lock:
            found = [(resource, span) for resource, span in receiver.spans
                     if attributes(span.attributes).get("llmgw.request_id") == request_id]
        if found:
            return found[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"the receiver got no span of {request_id}: {[s.name for _, s in receiver.spans]}")
