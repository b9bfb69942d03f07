"""The gateway benchmark's load generator: a raw asyncio HTTP/1.1 client with keep-alive connections (one per
concurrent request), and a cell of measurements (one target, one concurrency, one mode) with its percentiles."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import time
from dataclasses import dataclass, field

MODEL = "bench"


# --- the load generator ---------------------------------------------------------------------------------


class ClientConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time; parses Content-Length, chunked and
    until-close bodies, and notes when the first body byte came."""

    HEAD, LENGTH, CHUNKED, UNTIL_CLOSE = range(4)

    def __init__(self):
        self.transport = None
        self.future: asyncio.Future | None = None
        self.closed = False
        self.state = self.HEAD

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        future = self.future
        if future is not None and not future.done():
            if self.state == self.UNTIL_CLOSE:
                self._finish(time.perf_counter(), close=True)
            else:
                future.set_exception(ConnectionError(f"connection closed mid-answer ({exc or 'EOF'})"))

    def request(self, data: bytes) -> asyncio.Future:
        self.future = asyncio.get_running_loop().create_future()
        self.buffer = bytearray()
        self.body = bytearray()
        self.state = self.HEAD
        self.first: float | None = None
        self.status = 0
        self.close_after = False
        self.pos = 0
        self.transport.write(data)
        return self.future

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        future = self.future
        if future is None or future.done():
            return
        self.buffer += data
        if self.state == self.HEAD:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            del self.buffer[: end + 4]
            try:
                self.status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                future.set_exception(ConnectionError(f"bad status line {lines[0][:80]!r}"))
                self.transport.close()
                return
            if 100 <= self.status < 200:  # an interim answer: the real one follows
                self.state = self.HEAD
                return self.data_received(b"") if self.buffer else None
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip().lower()
            self.close_after = headers.get(b"connection") == b"close"
            if b"chunked" in headers.get(b"transfer-encoding", b""):
                self.state = self.CHUNKED
            elif b"content-length" in headers:
                self.state = self.LENGTH
                self.length = int(headers[b"content-length"])
            else:
                self.state = self.UNTIL_CLOSE
                self.close_after = True
        if self.first is None and self.buffer:
            self.first = now
        if self.state == self.LENGTH:
            if len(self.buffer) >= self.length:
                self.body = self.buffer[: self.length]
                self._finish(now)
        elif self.state == self.CHUNKED:
            buffer = self.buffer
            while True:
                eol = buffer.find(b"\r\n", self.pos)
                if eol < 0:
                    return
                size = int(bytes(buffer[self.pos : eol]).split(b";")[0], 16)
                if size == 0:
                    if buffer.find(b"\r\n\r\n", self.pos) < 0:
                        return
                    self._finish(now)
                    return
                if len(buffer) < eol + 2 + size + 2:
                    return
                self.body += buffer[eol + 2 : eol + 2 + size]
                self.pos = eol + 2 + size + 2
        elif self.state == self.UNTIL_CLOSE:
            self.body = self.buffer

    def _finish(self, now: float, close: bool = False) -> None:
        self.future.set_result((self.status, self.first or now, now, bytes(self.body), self.close_after or close))


@dataclass
class Cell:
    target: str
    server: str
    concurrency: int
    mode: str
    api: str = "chat"
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    timed_out: bool = False
    cpu: float = 0.0  # CPU seconds the target's processes used while measured
    rounds: list[float] = field(default_factory=list)  # req/s of every round of this cell, in order
    # what the gateway counted in this cell (llmgw_tokens_total and its 200s, from /metrics; None: not read)
    counted: tuple[int, int, int] | None = None  # (answers 200, prompt tokens, completion tokens)

    @property
    def cpu_ms(self) -> float:
        return self.cpu / self.ok * 1000 if self.ok and self.cpu else math.nan

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def p(self, q: float, samples: list[float] | None = None) -> float:
        samples = self.latencies if samples is None else samples
        if not samples:
            return math.nan
        ordered = sorted(samples)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000

    def summary(self) -> dict:
        return {
            "target": self.target, "server": self.server, "concurrency": self.concurrency, "mode": self.mode,
            "api": self.api,
            "ok": self.ok, "errors": self.errors, "first_error": self.first_error, "seconds": round(self.seconds, 3),
            "rps": round(self.rps, 1), "p50_ms": round(self.p(0.5), 3), "p99_ms": round(self.p(0.99), 3),
            "ttfc_p50_ms": round(self.p(0.5, self.firsts), 3) if self.mode == "stream" else None,
            "timed_out": self.timed_out, "cpu_ms_per_request": round(self.cpu_ms, 3),
            "rounds_rps": [round(r, 1) for r in self.rounds],
            "counted_200_prompt_completion": self.counted,
        }


# The APIs a cell can speak: chat completions (OpenAI), Messages (Anthropic), Responses (OpenAI), each as its
# clients send it: the path, the body, and how the key goes (the Anthropic SDK and Claude Code send x-api-key).
APIS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
PROMPT = "Say hello, briefly."


def build_request(port: int, key: str, stream: bool, api: str = "chat") -> bytes:
    if api == "messages":
        body = {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": PROMPT}]}
        auth = f"x-api-key: {key}\r\nanthropic-version: 2023-06-01"
    elif api == "responses":
        body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 32}
        auth = f"Authorization: Bearer {key}"
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32}
        auth = f"Authorization: Bearer {key}"
    if stream:
        body["stream"] = True
        if api == "chat":  # Messages and Responses streams carry their usage of their own
            body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body).encode()
    head = (
        f"POST {PATHS[api]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}\r\n"
        f"Content-Type: application/json\r\nAccept: */*\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


# What a right answer must hold, whole and streamed, per API: its text and its usage (and a stream's last event).
WHOLE = {
    "chat": (b'"choices"', b'"usage"'),
    "messages": (b'"type": "message"', b'"text"', b'"output_tokens"'),
    "responses": (b'"output_text"', b'"input_tokens"', b'"output_tokens"'),
}
STREAMED = {
    "chat": (b'"content"', b'"usage"', b"data: [DONE]"),
    "messages": (b"event: message_start", b'"input_tokens"', b'"text_delta"', b"event: message_delta",
                 b'"output_tokens"', b"event: message_stop"),
    "responses": (b"event: response.output_text.delta", b"event: response.completed", b'"input_tokens"',
                  b'"output_tokens"'),
}


def answer_ok(status: int, body: bytes, stream: bool, api: str = "chat") -> str:
    """'' when the answer is a right one, else why not."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    missing = [n for n in (STREAMED if stream else WHOLE)[api] if n not in body]
    if not missing:
        return ""
    where = body[-300:] if stream else body[:300]
    return f"{api} {'stream' if stream else 'answer'} without {', '.join(m.decode() for m in missing)}: {where!r}"


async def run_cell(cell: Cell, port: int, request: bytes, count: int, warmup: int, limit: float, cpu=None) -> Cell:
    loop = asyncio.get_running_loop()
    stream = cell.mode == "stream"
    conns: list[ClientConnection | None] = [None] * cell.concurrency

    async def connect() -> ClientConnection:
        _, conn = await loop.create_connection(ClientConnection, "127.0.0.1", port)
        return conn

    async def phase(n: int, record: bool, deadline: float) -> None:
        left = [n]

        async def worker(slot: int) -> None:
            while left[0] > 0 and time.perf_counter() < deadline:
                left[0] -= 1
                conn = conns[slot]
                try:
                    if conn is None or conn.closed:
                        conn = conns[slot] = await connect()
                    t0 = time.perf_counter()
                    status, first, end, body, close = await conn.request(request)
                except (OSError, ConnectionError) as exc:
                    if record:
                        cell.errors += 1
                        cell.first_error = cell.first_error or f"{type(exc).__name__}: {exc}"
                    if conns[slot] is not None:
                        conns[slot].transport.close()
                    conns[slot] = None
                    await asyncio.sleep(0.01)
                    continue
                if close:
                    conn.transport.close()
                    conns[slot] = None
                if not record:
                    continue
                why = answer_ok(status, body, stream, cell.api)
                if why:
                    cell.errors += 1
                    cell.first_error = cell.first_error or why
                else:
                    cell.ok += 1
                    cell.latencies.append(end - t0)
                    cell.firsts.append(first - t0)

        tasks = [loop.create_task(worker(i)) for i in range(cell.concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()) + 30)
        for task in pending:
            task.cancel()
        if pending:
            cell.timed_out = True
            await asyncio.wait(pending)
        if record and left[0] > 0:
            cell.timed_out = True

    gc.collect()
    gc.disable()
    try:
        await phase(warmup, False, time.perf_counter() + limit)
        cpu0 = cpu() if cpu else 0.0
        t0 = time.perf_counter()
        await phase(count, True, t0 + limit)
        cell.seconds += time.perf_counter() - t0
        cell.cpu += (cpu() - cpu0) if cpu else 0.0
    finally:
        gc.enable()
        for conn in conns:
            if conn is not None and conn.transport is not None:
                conn.transport.close()
    return cell


def requests_for(concurrency: int, scale: float) -> int:
    base = 300 if concurrency <= 1 else 1000 if concurrency <= 16 else 2000
    return max(concurrency * 4, int(base * scale))
