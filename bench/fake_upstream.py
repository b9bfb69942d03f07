#!/usr/bin/env python
"""A fast fake OpenAI-compatible engine for benchmarks: answers at once, never thinks.

    python bench/fake_upstream.py --port 9100 --key lek_... [--chunks 20] [--host 127.0.0.1]
    python bench/fake_upstream.py --port 9100 --key lek_... --chunks 128 --slots 64 --step-ms 10   # a GPU's pace

A raw asyncio HTTP/1.1 server (uvloop when it imports), keep-alive, no framework, stdlib only, so it costs the
benchmark as little as possible. It honours `Authorization: Bearer <key>` (401 OpenAI-shaped otherwise; with no
--key, any bearer key passes; `x-api-key: <key>` passes too, as Anthropic's clients send it) and answers:

- `POST /v1/chat/completions`, `POST /v1/completions`: a completion with `usage`; with `"stream": true`, the
  role chunk, `--chunks` content chunks, the finish chunk, the usage chunk (when `stream_options.include_usage`
  asks for it, as OpenAI does) and `data: [DONE]`, each event its own HTTP chunk and its own write;
- `POST /v1/messages` (Anthropic Messages): a message with `usage.input_tokens/output_tokens`; with `"stream":
  true`, llama.cpp's events (`event: X\ndata: {...}\n\n`): message_start (its `message.usage.input_tokens`),
  content_block_start, `--chunks` content_block_delta `text_delta`s, content_block_stop, message_delta (its
  `usage.output_tokens`) and message_stop, and no `[DONE]`, as llama.cpp's server streams them;
- `POST /v1/responses` (OpenAI Responses): a response with `output` and `usage.input_tokens/output_tokens`;
  with `"stream": true`, llama.cpp's events: response.created, response.in_progress, response.output_item.added,
  response.content_part.added, `--chunks` response.output_text.delta, response.output_text.done,
  response.content_part.done, response.output_item.done and response.completed with the response and its
  `usage`, and no `[DONE]`;
- `POST /v1/embeddings`: one small vector per input, with `usage`;
- `GET /v1/models`, `GET /health`.

With `--slots N` it keeps a GPU engine's pace instead of answering at once (chat and completions; the other
endpoints answer at once): at most N requests generate together, as an engine's N slots (llama.cpp's
`--parallel`, vLLM's `--max-num-seqs`); one more waits inside the engine, first come first served, for a slot to
free. Every `--step-ms` the engine takes one step, as continuous batching does: a request given a slot spends
`--prefill-steps` steps on its prompt, then its stream's headers and role chunk go out with its first token, and
each later step gives every generating slot its next token; its `--chunks`th token ends it (finish, usage and
`[DONE]` in that step). A client that hangs up frees its slot (or its place in line) at once. A whole answer
comes when its last token would have. At 64 slots and 10 ms a step, a 128-token answer takes about 1.3 s and a
slot turns over every 20 ms: the pace of a small model on a datacenter GPU.

Prints `READY <port>` on stdout once it listens. Stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import deque

MAX_HEAD = 64 * 1024
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}


def _error(status: int, code: str, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()


class Engine:
    """What the fake engine says; the parts of every answer that do not change are built once."""

    def __init__(self, key: str | None, chunks: int, word: str = "hello"):
        self.auth = f"Bearer {key}".encode() if key else None
        self.api_key = key.encode() if key else None
        self.chunks = chunks
        self.word = word
        self.counter = 0
        self.created = int(time.time())

    def next_id(self) -> str:
        self.counter += 1
        return f"{self.counter:x}"

    def usage(self, prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chat(self, body: dict) -> bytes:
        model = body.get("model", "fake")
        prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or [] if isinstance(m, dict))
        return json.dumps(
            {
                "id": "chatcmpl-" + self.next_id(),
                "object": "chat.completion",
                "created": self.created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": " ".join([self.word] * self.chunks)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": self.usage(prompt or 1, self.chunks),
            }
        ).encode()

    def completion(self, body: dict) -> bytes:
        model = body.get("model", "fake")
        return json.dumps(
            {
                "id": "cmpl-" + self.next_id(),
                "object": "text_completion",
                "created": self.created,
                "model": model,
                "choices": [{"index": 0, "text": " ".join([self.word] * self.chunks), "finish_reason": "stop"}],
                "usage": self.usage(len(str(body.get("prompt", "")).split()) or 1, self.chunks),
            }
        ).encode()

    def embeddings(self, body: dict) -> bytes:
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [{"object": "embedding", "index": i, "embedding": [0.0, 0.5, 1.0, 0.25]} for i in range(len(inputs))]
        return json.dumps(
            {"object": "list", "data": data, "model": body.get("model", "fake"),
             "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}}
        ).encode()

    def events(self, body: dict, chat: bool) -> list[bytes]:
        """The SSE events of one streamed answer, each `data: ...\\n\\n`."""
        model = body.get("model", "fake")
        rid = ("chatcmpl-" if chat else "cmpl-") + self.next_id()
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        head = {"id": rid, "object": kind, "created": self.created, "model": model}
        out = []

        def event(choices, **extra) -> None:
            out.append(b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n")

        if chat:
            event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            delta = {"index": 0, "delta": {"content": " " + self.word}, "finish_reason": None}
            piece = json.dumps({**head, "choices": [delta]}).encode()
            out.extend([b"data: " + piece + b"\n\n"] * self.chunks)
            event([{"index": 0, "delta": {}, "finish_reason": "stop"}])
        else:
            piece = json.dumps({**head, "choices": [{"index": 0, "text": " " + self.word, "finish_reason": None}]}).encode()
            out.extend([b"data: " + piece + b"\n\n"] * self.chunks)
            event([{"index": 0, "text": "", "finish_reason": "stop"}])
        if include_usage:
            event([], usage=self.usage(self._prompt(body, "messages" if chat else "prompt"), self.chunks))
        out.append(b"data: [DONE]\n\n")
        return out

    def _prompt(self, body: dict, field: str) -> int:
        items = body.get(field)
        if isinstance(items, str):
            return len(items.split()) or 1
        return sum(len(str(m.get("content", "")).split()) for m in items or [] if isinstance(m, dict)) or 1

    def message(self, body: dict) -> bytes:
        """A whole Anthropic message, as llama.cpp's server answers `/v1/messages`."""
        return json.dumps(
            {
                "id": "chatcmpl-" + self.next_id(),
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": " ".join([self.word] * self.chunks)}],
                "model": body.get("model", "fake"),
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"cache_read_input_tokens": 0, "input_tokens": self._prompt(body, "messages"),
                          "output_tokens": self.chunks},
            }
        ).encode()

    def _response(self, body: dict, rid: str, mid: str) -> dict:
        prompt = self._prompt(body, "input")
        return {
            "id": rid, "object": "response", "created_at": self.created, "status": "completed",
            "model": body.get("model", "fake"),
            "output": [{"type": "message", "status": "completed", "id": mid, "role": "assistant",
                        "content": [{"type": "output_text", "annotations": [], "logprobs": [],
                                     "text": " ".join([self.word] * self.chunks)}]}],
            "usage": {"input_tokens": prompt, "output_tokens": self.chunks, "total_tokens": prompt + self.chunks,
                      "input_tokens_details": {"cached_tokens": 0}},
        }

    def response(self, body: dict) -> bytes:
        """A whole Responses answer, as llama.cpp's server answers `/v1/responses`."""
        n = self.next_id()
        return json.dumps(self._response(body, "resp_" + n, "msg_" + n)).encode()

    @staticmethod
    def _sse(kind: str, data: dict) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps({"type": kind, **data}).encode() + b"\n\n"

    def message_events(self, body: dict) -> list[bytes]:
        """A streamed Anthropic message, event by event, as llama.cpp's server streams one (no [DONE])."""
        sse = self._sse
        usage = {"cache_read_input_tokens": 0, "input_tokens": self._prompt(body, "messages"), "output_tokens": 0}
        start = {"id": "chatcmpl-" + self.next_id(), "type": "message", "role": "assistant", "content": [],
                 "model": body.get("model", "fake"), "stop_reason": None, "stop_sequence": None, "usage": usage}
        piece = sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " " + self.word}})
        return [
            sse("message_start", {"message": start}),
            sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            *[piece] * self.chunks,
            sse("content_block_stop", {"index": 0}),
            sse("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": self.chunks}}),
            sse("message_stop", {}),
        ]

    def response_events(self, body: dict) -> list[bytes]:
        """A streamed Responses answer, event by event, as llama.cpp's server streams one (no [DONE])."""
        sse = self._sse
        n = self.next_id()
        rid, mid = "resp_" + n, "msg_" + n
        whole = self._response(body, rid, mid)
        part = whole["output"][0]["content"][0]
        head = {"id": rid, "object": "response", "status": "in_progress"}
        piece = sse("response.output_text.delta", {"item_id": mid, "delta": " " + self.word})
        return [
            sse("response.created", {"response": head}),
            sse("response.in_progress", {"response": head}),
            sse("response.output_item.added", {"item": {"content": [], "id": mid, "role": "assistant",
                                                        "status": "in_progress", "type": "message"}}),
            sse("response.content_part.added", {"item_id": mid, "part": {"type": "output_text", "text": ""}}),
            *[piece] * self.chunks,
            sse("response.output_text.done", {"item_id": mid, "text": part["text"]}),
            sse("response.content_part.done", {"item_id": mid, "part": part}),
            sse("response.output_item.done", {"item": whole["output"][0]}),
            sse("response.completed", {"response": whole}),
        ]


class Generation:
    """One request in a paced engine: what it sends, step by step."""

    __slots__ = ("conn", "events", "whole", "close", "steps_left", "sent")

    def __init__(self, conn: Connection, events: list[bytes] | None, whole: bytes | None, close: bool, prefill: int):
        self.conn, self.events, self.whole, self.close = conn, events, whole, close
        self.steps_left = prefill  # steps of prefill still to go
        self.sent = 0  # events sent so far (streams)


class Pacer:
    """A GPU engine's pace: `slots` requests generate together, one token each per `step` seconds."""

    def __init__(self, slots: int, step: float, prefill: int, chunks: int):
        self.slots, self.step, self.prefill, self.chunks = slots, step, prefill, chunks
        self.waiting: deque[Generation] = deque()
        self.active: list[Generation] = []
        self.task: asyncio.Task | None = None

    def add(self, gen: Generation) -> None:
        self.waiting.append(gen)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    def drop(self, conn: Connection) -> None:
        """The client hung up: its slot, or its place in line, is free at once."""
        self.active = [g for g in self.active if g.conn is not conn]
        if any(g.conn is conn for g in self.waiting):
            self.waiting = deque(g for g in self.waiting if g.conn is not conn)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time()
        while self.active or self.waiting:
            while self.waiting and len(self.active) < self.slots:
                self.active.append(self.waiting.popleft())
            still: list[Generation] = []
            for gen in self.active:
                if gen.conn.transport is None:
                    continue
                if gen.steps_left > 0:
                    gen.steps_left -= 1
                    still.append(gen)
                    continue
                if self._advance(gen):
                    still.append(gen)
            self.active = still
            at += self.step
            await asyncio.sleep(max(0.0, at - loop.time()))

    def _advance(self, gen: Generation) -> bool:
        """One step of one slot: its next token (True), or its last (False: the slot is free)."""
        conn = gen.conn
        if gen.events is None:  # a whole answer: it comes when its last token would have
            gen.sent += 1
            if gen.sent < self.chunks:
                return True
            assert gen.whole is not None  # a Generation without events carries its whole answer
            conn.reply(200, gen.whole, gen.close)
            conn.resume()
            return False
        if gen.sent == 0:  # headers, the role chunk and the first token together
            conn.stream_head(gen.close)
            n = 2 if len(gen.events) > 2 else 1
        elif len(gen.events) - gen.sent <= len(gen.events) - self.chunks:  # the last token: finish, usage, [DONE]
            n = len(gen.events) - gen.sent
        else:
            n = 1
        transport = conn.transport
        assert transport is not None  # _run skips the connections gone
        write = transport.write
        for event in gen.events[gen.sent:gen.sent + n]:
            write(b"%x\r\n%s\r\n" % (len(event), event))
        gen.sent += n
        if gen.sent < len(gen.events):
            return True
        write(b"0\r\n\r\n")
        if gen.close:
            transport.close()
        conn.resume()
        return False


class Connection(asyncio.Protocol):
    def __init__(self, engine: Engine, pacer: Pacer | None = None):
        self.engine = engine
        self.pacer = pacer
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False  # a paced request is under way: the next one on this connection waits for it

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.transport = None
        if self.pacer is not None:
            self.pacer.drop(self)

    def resume(self) -> None:
        """A paced answer is done: the next request already sent on this connection, if any."""
        self.busy = False
        if self.buffer and self.transport is not None:
            self.data_received(b"")

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.busy:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    self.transport.close()
                return
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            try:
                method, target, version = lines[0].split(b" ", 2)
            except ValueError:
                self.transport.close()
                return
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            start = end + 4
            if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                parsed = _dechunk(self.buffer, start)
                if parsed is None:
                    return
                body, used = parsed
                del self.buffer[:used]
            else:
                length = int(headers.get(b"content-length", b"0") or 0)
                if len(self.buffer) < start + length:
                    return
                body = bytes(self.buffer[start : start + length])
                del self.buffer[: start + length]
            connection = headers.get(b"connection", b"").lower()
            close = connection == b"close" or (version == b"HTTP/1.0" and connection != b"keep-alive")
            self.handle(method, target.split(b"?", 1)[0], headers, body, close)

    def handle(self, method: bytes, path: bytes, headers: dict, body: bytes, close: bool) -> None:
        engine = self.engine
        if path == b"/health":
            return self.reply(200, b'{"status":"ok"}', close)
        if engine.auth is not None and headers.get(b"authorization") != engine.auth \
                and headers.get(b"x-api-key") != engine.api_key:
            return self.reply(*_error(401, "invalid_api_key", "wrong or missing engine key"), close)
        if path == b"/v1/models":
            if method != b"GET":
                return self.reply(*_error(405, "method_not_allowed", "GET only"), close)
            models = b'{"object":"list","data":[{"id":"fake","object":"model","created":0,"owned_by":"bench"}]}'
            return self.reply(200, models, close)
        endpoint = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions", b"/v1/embeddings": "embeddings",
                    b"/v1/messages": "messages", b"/v1/responses": "responses"}.get(path)
        if endpoint is None:
            return self.reply(*_error(404, "not_found", f"no such endpoint {path.decode(errors='replace')}"), close)
        if method != b"POST":
            return self.reply(*_error(405, "method_not_allowed", "POST only"), close)
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return self.reply(*_error(400, "invalid_request", f"bad JSON: {exc}"), close)
        if endpoint == "embeddings":
            return self.reply(200, engine.embeddings(data), close)
        if endpoint in ("messages", "responses"):
            make_whole, make_events = (engine.message, engine.message_events) if endpoint == "messages" else (
                engine.response, engine.response_events)
            if data.get("stream"):
                return self.stream(make_events(data), close)
            return self.reply(200, make_whole(data), close)
        chat = endpoint == "chat"
        if self.pacer is not None:  # at a GPU's pace: it waits for a slot, then a token a step
            self.busy = True
            events = engine.events(data, chat) if data.get("stream") else None
            whole = None if events else (engine.chat(data) if chat else engine.completion(data))
            return self.pacer.add(Generation(self, events, whole, close, self.pacer.prefill))
        if data.get("stream"):
            return self.stream(engine.events(data, chat), close)
        return self.reply(200, engine.chat(data) if chat else engine.completion(data), close)

    def reply(self, status: int, payload: bytes, close: bool) -> None:
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n{'connection: close' if close else 'connection: keep-alive'}\r\n\r\n"
        ).encode()
        transport = self.transport
        assert transport is not None  # answers go out on open connections only (data_received, Pacer._run)
        transport.write(head + payload)
        if close:
            transport.close()

    def stream_head(self, close: bool) -> None:
        assert self.transport is not None  # as in reply
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n" + (b"connection: close" if close else b"connection: keep-alive") + b"\r\n\r\n"
        )

    def stream(self, events: list[bytes], close: bool) -> None:
        transport = self.transport
        assert transport is not None  # as in reply
        write = transport.write
        self.stream_head(close)
        for event in events:  # one write per event, as an engine sends token by token
            write(b"%x\r\n%s\r\n" % (len(event), event))
        write(b"0\r\n\r\n")
        if close:
            transport.close()


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked request body starting at `start`: (body, bytes used) or None while incomplete."""
    body = bytearray()
    pos = start
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buffer[pos:eol]).split(b";")[0], 16)
        if size == 0:
            trailer_end = buffer.find(b"\r\n\r\n", eol)
            if trailer_end < 0:
                return None
            return bytes(body), trailer_end + 4
        if len(buffer) < eol + 2 + size + 2:
            return None
        body += buffer[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2


async def serve(host: str, port: int, engine: Engine, pacer: Pacer | None = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(engine, pacer), host, port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--key", default="", help="the engine key clients must send as a bearer token")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per streamed answer")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--slots", type=int, default=0,
                        help="keep a GPU engine's pace: this many requests generate at once (0: answer at once)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="with --slots: milliseconds per step (a token)")
    parser.add_argument("--prefill-steps", type=int, default=1, help="with --slots: steps a prompt takes")
    o = parser.parse_args(argv)
    engine = Engine(o.key or None, o.chunks)
    pacer = Pacer(o.slots, o.step_ms / 1000, o.prefill_steps, o.chunks) if o.slots > 0 else None
    run = asyncio.run
    if o.loop != "asyncio":
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            if o.loop == "uvloop":
                sys.exit("uvloop is not installed")
    run(serve(o.host, o.port, engine, pacer))


if __name__ == "__main__":
    main()
