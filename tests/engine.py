"""A tiny OpenAI-compatible engine for tests: stdlib only, stands in for llama.cpp's server.

    LLMGW_ENGINE_KEY=k python tests/engine.py --port N [--host H] [--load-seconds S] [--fail-after S]
        [--exit-code C] [--ignore-sigterm] [--answer TEXT] [--model-path P] [--model-name M] [--delay-ms MS]
        [--no-auth] [--echo-body] [--sparse] [--break-after N [--break-how exit|stall] [--break-marker FILE]]

Every endpoint but /health needs `Authorization: Bearer <LLMGW_ENGINE_KEY>`. While loading (the first
--load-seconds) /health and /v1/models answer 503, like llama-server. Answers are the words of --answer, one word
per token; `max_tokens` cuts them short with finish_reason "length". Responses carry `X-Test-Engine: <port>` so
a test can tell replicas apart. With --echo-body, a non-streamed answer carries `"echo": {"body": <the JSON
received>, "headers": <the request headers>}`, and a body with `"test_engine_status": N` is answered with status N
and an OpenAI-shaped error (a test's way to make an engine fail one request); `"test_engine_error": {"status": N,
...}` is answered with status N and `{"error": {...}}` of the rest, as a real engine words its refusals.

It answers Anthropic's Messages (/v1/messages) and OpenAI's Responses (/v1/responses) too, streamed with every
event and field their APIs define; with --sparse, streamed as an engine that leaves out what llama.cpp's server
leaves out, and more: no `event:` lines, no `sequence_number`, `output_index`, `content_index`, `logprobs` nor
`item_id` in a Responses stream, no `message_start`, `content_block_start` nor `index` in a Messages stream.

With --break-after N it fails mid-answer, as an engine that crashes or hangs: once it has streamed N tokens of an
answer (a whole answer: before it is sent), it exits at once (`--break-how exit`: its connections close; `cut`: a
whole answer's head and half its body sent first) or sends nothing more (`stall`); with --break-marker FILE, only
while FILE does not exist, which it then writes with its port (of two engines given the same file, the first to
get that far fails, once).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY_ENV = "LLMGW_ENGINE_KEY"


class Engine:
    def __init__(self, args: argparse.Namespace, key: str):
        self.args = args
        self.key = key
        self.ready_at = time.monotonic() + args.load_seconds
        self.model = args.model_name or (os.path.basename(args.model_path) if args.model_path else "test-model")
        self.generating = 0  # requests at once (--parallel: at most that many)
        self.lock = threading.Lock()
        self.last_prompt = ""  # llama-server's cache, roughly: the prompt it saw last

    def timings(self, prompt: str, prompt_tokens: int, completion_tokens: int) -> dict:
        """What llama-server says of its cache and time: the same prompt again is served from its cache but for its
        last token; 0.1 ms per prompt token, and --delay-ms per token generated."""
        with self.lock:
            cached = max(0, prompt_tokens - 1) if prompt == self.last_prompt else 0
            self.last_prompt = prompt
        return {"cache_n": cached, "prompt_n": prompt_tokens - cached, "prompt_ms": (prompt_tokens - cached) * 0.1,
                "predicted_n": completion_tokens, "predicted_ms": completion_tokens * float(self.args.delay_ms)}

    @property
    def loading(self) -> bool:
        return time.monotonic() < self.ready_at

    def words(self, max_tokens, prefill: str = "") -> tuple[list[str], str]:
        """The answer's words from where a prefill (a final assistant message, or a completion's prompt) leaves
        off, as llama.cpp's server continues one: a prefill that ends with the answer's first words is followed by
        the rest of them."""
        words = self.args.answer.split()
        for k in range(len(words), 0, -1):
            if prefill.endswith(" ".join(words[:k])):
                words = words[k:]
                break
        if isinstance(max_tokens, int) and 0 <= max_tokens < len(words):
            return words[:max_tokens], "length"
        return words, "stop"


def _count(value) -> int:
    """Prompt tokens, roughly: words in every string of the value."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_count(v) for v in value)
    if isinstance(value, dict):
        return sum(_count(v) for k, v in value.items() if k in ("content", "text"))
    return 0


def _prefill(messages) -> str:
    """The text of a final assistant message (a prefill the answer continues), or ""."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _spaced(words: list[str], prefill: str) -> list[str]:
    """The words as deltas: a space before each but the first of an answer begun afresh."""
    return [w if i == 0 and not prefill else " " + w for i, w in enumerate(words)]


def embedding(text: str, dims: int = 8) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 255.0 * 2 - 1, 6) for b in digest[:dims]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small SSE chunks go out at once
    server_version = "llmgw-test-engine/1"
    engine: Engine
    _tokens, _cut, _streaming = 0, False, False  # of the request being answered (--break-after)

    # Plumbing

    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        if self.engine.args.echo_body and status == 200 and self.command == "POST":
            body = {**body, "echo": {"body": self._received, "headers": {k.lower(): v for k, v in self.headers.items()}}}
        data = json.dumps(body).encode()
        self._give_slot()
        length = len(data)
        if self._cut:
            data = data[:length // 2]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(length))
        self.send_header("X-Test-Engine", str(self.engine.args.port))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        if self._cut:
            self.wfile.flush()
            self._break()

    def _error(self, status: int, message: str, kind: str, code: str) -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "code": code}})

    def _authorized(self) -> bool:
        if self.engine.args.no_auth or self.headers.get("Authorization", "") == f"Bearer {self.engine.key}":
            return True
        self._error(401, "Invalid API key", "authentication_error", "invalid_api_key")
        return False

    def _loaded(self) -> bool:
        if not self.engine.loading:
            return True
        self._error(503, "Loading model", "unavailable_error", "loading")
        return False

    def _body(self, raw: bytes) -> dict | None:
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._error(400, "the body must be a JSON object", "invalid_request_error", "invalid_request")
            return None
        return body

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Test-Engine", str(self.engine.args.port))
        self.end_headers()

    def _event(self, data, kind: str = "") -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        payload = ((f"event: {kind}\n" if kind else "") + f"data: {text}\n\n").encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def _end_stream(self) -> None:
        self._give_slot()
        self._event("[DONE]")
        if self.engine.args.linger_ms:  # an engine that ends its stream a moment after the last event
            time.sleep(self.engine.args.linger_ms / 1000.0)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _pause(self) -> None:
        """The time a token takes; a client that hangs up meanwhile is noticed, and its slot freed, at once (as an
        engine's server frees the slot of a request whose connection closed). --break-after: it fails here."""
        self._tokens = getattr(self, "_tokens", 0) + 1
        if self.engine.args.break_after is not None and self._tokens > self.engine.args.break_after:
            if self.engine.args.break_how == "cut" and not self._streaming:
                self._cut = self._claim()  # a whole answer: its head and half its body sent, then the exit
            elif self._claim():
                self._break()
        if not self.engine.args.delay_ms:
            return
        readable, _, _ = select.select([self.connection], [], [], self.engine.args.delay_ms / 1000.0)
        if readable:
            try:
                gone = self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                self._give_slot()
                raise ConnectionResetError("the client hung up")

    def _claim(self) -> bool:
        """--break-after: this engine fails now, unless another given the same marker failed first."""
        args = self.engine.args
        if not args.break_marker:
            return True
        try:
            with open(args.break_marker, "x") as marker:
                marker.write(str(args.port))
        except FileExistsError:
            return False
        return True

    def _break(self) -> None:
        args = self.engine.args
        print(f"test engine: breaking off ({args.break_how}) after {args.break_after} tokens", file=sys.stderr,
              flush=True)
        if args.break_how == "stall":
            while True:
                time.sleep(3600)
        os._exit(1)

    # Endpoints

    def do_GET(self):
        if self.path == "/health":
            if self.engine.loading:
                self._error(503, "Loading model", "unavailable_error", "loading")
            else:
                self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            if self._authorized() and self._loaded():
                model = {"id": self.engine.model, "object": "model", "created": int(time.time()), "owned_by": "test"}
                self._send_json(200, {"object": "list", "data": [model]})
        else:
            self._error(404, f"no route GET {self.path}", "invalid_request_error", "not_found")

    def do_POST(self):
        routes = {
            "/v1/chat/completions": self.chat,
            "/v1/completions": self.completions,
            "/v1/embeddings": self.embeddings,
            "/v1/messages": self.anthropic_messages,
            "/v1/responses": self.openai_responses,
        }
        # Read the whole body first: the connection is kept alive, so none of it may be left for the next request.
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            self._received = json.loads(raw) if self.engine.args.echo_body and raw else None
        except ValueError:
            self._received = None
        route = routes.get(self.path)
        if route is None:
            self._error(404, f"no route POST {self.path}", "invalid_request_error", "not_found")
            return
        if not self._authorized() or not self._loaded():
            return
        body = self._body(raw)
        if body is None:
            return
        if self.engine.args.echo_body and isinstance(body.get("test_engine_status"), int):
            status = body["test_engine_status"]
            self._error(status, f"failing with {status} on purpose", "server_error", "test_engine_status")
            return
        if self.engine.args.echo_body and isinstance(body.get("test_engine_error"), dict):
            error = dict(body["test_engine_error"])
            self._send_json(int(error.pop("status", 500)), {"error": error})
            return
        if self.engine.args.fail_status:
            status = self.engine.args.fail_status
            self._error(status, f"failing every request with {status}", "server_error", "test_engine_failing")
            return
        if self.engine.args.first_token_ms:  # a slow prefill: every answer's first token this much later
            time.sleep(self.engine.args.first_token_ms / 1000.0)
        if not self._take_slot():
            return
        self._tokens, self._cut, self._streaming = 0, False, bool(body.get("stream"))
        try:
            route(body)
        except (ConnectionResetError, BrokenPipeError) as exc:  # the client hung up: nothing more to say to it
            print(f"test engine: the client hung up ({type(exc).__name__})", file=sys.stderr, flush=True)
            self.close_connection = True
        finally:
            self._give_slot()

    def _take_slot(self) -> bool:
        """--parallel N: a slot of N, or a 500 that fails the request: the gateway's admission lets no more than N
        requests into an engine at once, and a test under load sees it if it ever does."""
        self._slot = False
        if not self.engine.args.parallel:
            return True
        with self.engine.lock:
            if self.engine.generating >= self.engine.args.parallel:
                full = True
            else:
                full, self._slot = False, True
                self.engine.generating += 1
        if full:
            self._error(500, f"test engine: more requests at once than its {self.engine.args.parallel} slot(s)",
                        "server_error", "over_slots")
        return not full

    def _give_slot(self) -> None:
        """The slot free once the last token is out (before the end of the answer, as an engine frees it)."""
        if getattr(self, "_slot", False):
            self._slot = False
            with self.engine.lock:
                self.engine.generating -= 1

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _generate(self, body: dict, chat: bool) -> None:
        if chat and not isinstance(body.get("messages"), list):
            self._error(400, "'messages' must be a list", "invalid_request_error", "invalid_request")
            return
        prompt = body.get("prompt")
        prefill = _prefill(body.get("messages")) if chat else prompt if isinstance(prompt, str) else ""
        words, finish = self.engine.words(body.get("max_tokens", body.get("max_completion_tokens")), prefill)
        if not chat and words == self.engine.args.answer.split()[:len(words)]:
            prefill = ""  # a prompt the answer does not continue
        prompt_tokens = _count(body.get("messages") if chat else body.get("prompt"))
        usage = self._usage(prompt_tokens, len(words))
        timings = self.engine.timings(json.dumps(body.get("messages") if chat else body.get("prompt")), prompt_tokens,
                                      len(words))
        kind = "chat.completion" if chat else "text_completion"
        base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "created": int(time.time()),
            "model": body.get("model") or self.engine.model,
        }
        if not body.get("stream"):
            self._pause()
            text = "".join(_spaced(words, prefill))
            if chat:
                text = prefill + text  # as llama.cpp's server answers a prefill: repeated before what follows it
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            self._send_json(200, {**base, "object": kind, "choices": [choice], "usage": usage, "timings": timings})
            return
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(content: str | None, finish_reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish_reason}
            return {**base, "object": chunk_kind, "choices": [choice]}

        self._start_stream()
        if chat:
            self._event(chunk(None, None, role=True))
        for word in _spaced(words, prefill):
            self._pause()
            self._event(chunk(word, None))
        if self.engine.args.break_after is not None and self._tokens >= self.engine.args.break_after and self._claim():
            self._break()  # its last token out, its finish not
        self._event(chunk(None, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            self._event({**base, "object": chunk_kind, "choices": [], "usage": usage, "timings": timings})
        self._end_stream()

    def chat(self, body: dict) -> None:
        self._generate(body, chat=True)

    def completions(self, body: dict) -> None:
        self._generate(body, chat=False)

    def _typed(self, kind: str, data: dict, sparse: tuple[str, ...] = ()) -> None:
        """One event of a Messages or Responses stream: its `event:` line and every field, or with --sparse
        neither the line nor the fields named."""
        data = {"type": kind, **data}
        if kind in ("message_stop", "response.completed"):  # the last token is out
            self._give_slot()
        if self.engine.args.sparse:
            self._event({k: v for k, v in data.items() if k not in sparse})
        else:
            self._event(data, kind)

    def _end_typed_stream(self) -> None:  # no [DONE]: their last event says it
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def anthropic_messages(self, body: dict) -> None:
        """Anthropic's Messages, one word per token."""
        prefill = _prefill(body.get("messages"))
        words, finish = self.engine.words(body.get("max_tokens"), prefill)
        usage = {"input_tokens": _count(body.get("messages")), "output_tokens": len(words)}
        stop = "max_tokens" if finish == "length" else "end_turn"
        message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                   "model": body.get("model") or self.engine.model, "stop_sequence": None}
        if not body.get("stream"):
            self._pause()
            text = {"type": "text", "text": prefill + "".join(_spaced(words, prefill))}
            self._send_json(200, {**message, "content": [text], "stop_reason": stop, "usage": usage})
            return
        self._start_stream()
        if not self.engine.args.sparse:
            start: dict[str, object] = {**message, "content": [], "stop_reason": None,
                                        "usage": {**usage, "output_tokens": 0}}
            self._typed("message_start", {"message": start})
            self._typed("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        for word in _spaced(words, prefill):
            self._pause()
            delta = {"type": "text_delta", "text": word}
            self._typed("content_block_delta", {"index": 0, "delta": delta}, ("index",))
        self._typed("content_block_stop", {"index": 0}, ("index",))
        self._typed("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": len(words)}})
        self._typed("message_stop", {})
        self._end_typed_stream()

    def openai_responses(self, body: dict) -> None:  # (BaseHTTPRequestHandler has `responses`)
        """OpenAI's Responses, one word per token."""
        prefill = _prefill(body.get("input"))
        words, _ = self.engine.words(body.get("max_output_tokens"), prefill)
        prompt = _count(body.get("input")) + _count(body.get("instructions"))
        rid, mid = "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24]
        deltas = _spaced(words, prefill)
        text = prefill + "".join(deltas)  # its `done` events' text is the whole, as llama.cpp's server says it
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {"id": mid, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        usage = {"input_tokens": prompt, "output_tokens": len(words), "total_tokens": prompt + len(words)}
        response = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "completed",
                    "model": body.get("model") or self.engine.model, "output": [item], "usage": usage}
        if not body.get("stream"):
            self._pause()
            self._send_json(200, response)
            return
        self._start_stream()
        sequence = iter(range(1 << 30))
        in_item = {"output_index": 0, "content_index": 0, "item_id": mid}  # where a part's event is

        def event(kind: str, **data) -> None:
            self._typed(kind, {**data, "sequence_number": next(sequence)},
                        ("sequence_number", "output_index", "content_index", "item_id", "logprobs"))

        begun = {**response, "status": "in_progress", "output": [], "usage": None}
        event("response.created", response=begun)
        event("response.in_progress", response=begun)
        event("response.output_item.added", output_index=0, item={**item, "status": "in_progress", "content": []})
        event("response.content_part.added", **in_item, part={**part, "text": ""})
        for word in deltas:
            self._pause()
            event("response.output_text.delta", **in_item, delta=word, logprobs=[])
        event("response.output_text.done", **in_item, text=text, logprobs=[])
        event("response.content_part.done", **in_item, part=part)
        event("response.output_item.done", output_index=0, item=item)
        event("response.completed", response=response)
        self._end_typed_stream()

    def embeddings(self, body: dict) -> None:
        self._pause()
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            message = "'input' must be a string or a list of strings"
            self._error(400, message, "invalid_request_error", "invalid_request")
            return
        data = [{"object": "embedding", "index": i, "embedding": embedding(text)} for i, text in enumerate(inputs)]
        tokens = _count(inputs)
        self._send_json(
            200,
            {
                "object": "list",
                "data": data,
                "model": body.get("model") or self.engine.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    def log_message(self, format, *args):
        sys.stderr.write(f"test engine: {self.address_string()} {format % args}\n")
        sys.stderr.flush()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="A tiny OpenAI-compatible test engine.")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--load-seconds", type=float, default=0.0, help="answer 503 this long after start")
    p.add_argument("--fail-after", type=float, help="exit with --exit-code after this many seconds")
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--answer", default="Hello from the test engine.")
    p.add_argument("--model-path", default="", help="a model file that must exist")
    p.add_argument("--model-name", default="", help="the id /v1/models shows")
    p.add_argument("--delay-ms", type=float, default=0.0, help="pause before each streamed token")
    p.add_argument("--first-token-ms", type=float, default=0.0, help="pause before each answer (a slow prefill)")
    p.add_argument("--fail-status", type=int, default=0, help="answer every completion with this status")
    p.add_argument("--linger-ms", type=float, default=0.0, help="pause after [DONE] before a stream's end")
    p.add_argument("--no-auth", action="store_true", help="answer without the key (an engine the agent must refuse)")
    p.add_argument("--echo-body", action="store_true", help="echo the request in answers; obey test_engine_status")
    p.add_argument("--parallel", type=lambda v: int(v) if v else 0, default=0,
                   help="at most this many requests at once; one more fails with a 500 (0 or empty: no bound)")
    p.add_argument("--sparse", action="store_true", help="stream Messages and Responses leaving fields out")
    p.add_argument("--break-after", type=int, help="fail once this many tokens of an answer are out")
    p.add_argument("--break-how", choices=("exit", "stall", "cut"), default="exit",
                   help="cut: a whole answer's head and half its body sent before the exit")
    p.add_argument("--break-marker", default="", help="fail only while this file does not exist, then write it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    key = os.environ.get(KEY_ENV, "")
    if not key:
        print(f"test engine: {KEY_ENV} is not set; refusing to serve without an engine key", file=sys.stderr)
        return 2
    if args.model_path and not os.path.isfile(args.model_path):
        print(f"test engine: model file {args.model_path} does not exist", file=sys.stderr)
        return 2
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: (print("test engine: SIGTERM, exiting", file=sys.stderr), os._exit(0)))
    if args.fail_after is not None:

        def fail():
            print(f"test engine: failing on purpose with exit code {args.exit_code}", file=sys.stderr, flush=True)
            os._exit(args.exit_code)

        threading.Timer(args.fail_after, fail).start()
    Handler.engine = Engine(args, key)
    ThreadingHTTPServer.request_queue_size = 128  # many clients connecting at once must not be reset
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    args.port = server.server_address[1]
    print(f"test engine: listening on {args.host}:{server.server_address[1]}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
