"""An engine's answer on its way to the client: a whole one held and sent at once (or passed on as it comes when
large), a stream passed on event by event, never buffered; what it used read off it (its API's usage fields, or
what was passed when a stream is cut short); and the request's end, once, however it ended."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from gateway import metrics
from gateway.call import Call, Used
from gateway.engines_http import EngineAnswer, Lost, ReadTimeout, Silent, UpstreamError
from gateway.errors import GatewayError
from gateway.http import Answer, Streamed
from gateway.resume import CLOSED, JSON, LOST, SILENT, Seam
from gateway.runtime import Gateway
from gateway.sending import broke, describe, done, refused, send
from gateway.surfaces import Surface
from gateway.table import Upstream

log = logging.getLogger("llmgw.gateway")


async def once(gw: Gateway, call: Call, used: Used, surface: Surface, payload: bytes) -> Answer | Streamed:
    """A whole answer: held and sent as one when it is small (ONCE_BYTES), else passed on as it comes, with no more
    of it in memory than the engine connection's buffer (an answer of many embeddings or log-probabilities). One
    whose engine breaks off before it is all there is sent again, to another replica (nothing of it reached the
    client), up to its model's resume limit."""
    upstream, response = await send(gw, call, call.way, surface, payload)
    if call.request_body is not None:
        used.body = bytearray()
    passing, held = False, True
    try:
        while True:
            try:
                content, whole = await response.read_upto(ONCE_BYTES if response.status == 200 else ERROR_BYTES)
                break
            except ReadTimeout:
                raise GatewayError(504, "upstream_timeout", f"replica {upstream.replica} did not finish in time") from None
            except UpstreamError as exc:
                said, reason = describe(exc), LOST if isinstance(exc, Lost) else CLOSED
                if used.resumes >= _resume_limit(gw, call) or response.status != 200:
                    raise GatewayError(502, "upstream_error", f"replica {upstream.replica} broke off: {said}") from None
            # sent again from its start: what the engine had done is lost, and the fleet's cost, not the key's
            held = False
            _resumed(gw, call, used, upstream, response, reason, f"broke off: {said}; resumed")
            used.resumed_prompt += call.prompt_about
            upstream, response = await send(gw, call, call.way, surface, payload, avoid=upstream.replica)
            held = True
        status = response.status
        if status >= 400:
            raise refused(call, surface, upstream, status, content)
        if not whole:
            passing = True
            return _pass_on(gw, call, used, upstream, response, content)
        if status == 200:
            _take_usage(used, surface, content)  # before its slot goes back: the key's service counts it
            if used.body is not None:
                used.keep(content, gw.body_bytes)
    finally:
        if not passing and held:
            response.release()  # read to the end: back to the pool; else closed
            done(gw, call, call.way, upstream)
    if status == 200:
        gw.ledger.add(call.key_id, call.model, used.prompt, used.completion, resumed=used.resumed_prompt)
        await call.settle()  # before the answer: the key's next request sees what this one used
    call.finish(status)
    return Answer(content, status, response.content_type)


def _resume_limit(gw: Gateway, call: Call) -> int:
    """Times one answer of the request's model may go on at another replica (its `resume_limit`)."""
    route = gw.table.find(call.model) if gw.table is not None else None
    return route.resume_limit if route is not None else 0


def _resumed(gw: Gateway, call: Call, used: Used, upstream: Upstream, response: EngineAnswer, reason: str,
             outcome: str) -> None:
    """The replica broke off the request's answer, which goes on elsewhere: let it go, and count the resume."""
    response.close()
    done(gw, call, call.way, upstream)
    broke(call, call.way, outcome)
    used.resumes += 1
    metrics.of(call.model).resumes(reason).inc()
    log.warning("replica %s broke off an answer to %s (%s); resuming it elsewhere", upstream.replica, call.model,
                outcome)


ONCE_BYTES = 1 << 20  # a whole answer larger than this is passed on as it comes instead of held
ERROR_BYTES = 64 << 10  # of an engine's error answer, read for its words; the rest is not wanted
USAGE_TAIL = 64 << 10  # of a passed-on answer, kept to find its usage in (the engines put it near the end)
_USAGE_FIELD = re.compile(rb'[{,]\s*"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)')
# what the engine says of its cache and its time: llama.cpp's `timings`, OpenAI's, Anthropic's cached tokens
_ENGINE_FIELD = re.compile(rb'[{,]\s*"(cache_n|cached_tokens|cache_read_input_tokens|prompt_ms|predicted_ms)"\s*:'
                           rb'\s*([0-9]{1,12}(?:\.[0-9]{1,9})?)[,}\s]')


def _pass_on(gw: Gateway, call: Call, used: Used, upstream: Upstream, response: EngineAnswer, head: bytes
             ) -> Streamed:
    """A large whole answer, passed on as it comes; its usage read off its tail."""
    state = {"settled": False}

    def settle(status: int) -> None:
        if state["settled"]:
            return
        state["settled"] = True
        if response.complete:
            response.release()
        else:
            response.close()
        if status != 200 and not used.completion:  # cut short: the engine had generated it all; its usage never came
            used.prompt = call.prompt_about
            used.completion = max(0, call.reserved - call.prompt_about)  # with a tpm limit: what it may have used
        done(gw, call, call.way, upstream)
        gw.ledger.add(call.key_id, call.model, used.prompt, used.completion)
        call.finish(status)

    async def chunks() -> AsyncGenerator[bytes, None]:
        tail = head[-USAGE_TAIL:]
        status = 499
        try:
            yield head
            async for chunk in response.chunks():
                tail = (tail + chunk)[-USAGE_TAIL:]
                yield chunk
            status = 200
            for name, value in _USAGE_FIELD.findall(tail):  # the last of each: the answer's own usage
                if name in (b"prompt_tokens", b"input_tokens"):
                    used.prompt = int(value)
                else:
                    used.completion = int(value)
            engine_said(used, {name.decode(): float(value) for name, value in _ENGINE_FIELD.findall(tail)})
        except (ReadTimeout, UpstreamError) as exc:  # the status went out: all that is left is to stop
            log.warning("replica %s broke off a large answer: %s", upstream.replica, describe(exc))
            status = 502
        finally:
            settle(status)

    return Streamed(_kept(chunks(), used, gw.body_bytes), settle, response.content_type)


def _take_usage(used: Used, surface: Surface, content: bytes) -> None:
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return
    usage = surface.usage(body) if isinstance(body, dict) else None
    if usage is not None:
        used.prompt, used.completion, used.usage_known = usage.prompt, usage.completion, True
    if isinstance(body, dict):
        engine_said(used, _engine_fields(body))


def _engine_fields(data: dict[str, object]) -> dict[str, object]:
    """What an answer (or a stream's event) says of the engine's cache and time, by the names engine_said reads:
    llama.cpp's `timings`, and the cached tokens OpenAI's, the Responses API's and Anthropic's usage name."""
    said: dict[str, object] = {}
    timings = data.get("timings")
    if isinstance(timings, dict):
        said.update((k, timings.get(k)) for k in ("cache_n", "prompt_ms", "predicted_ms"))
    usage = data.get("usage")
    if not isinstance(usage, dict) and isinstance(response := data.get("response"), dict):
        usage = response.get("usage")  # the Responses API's stream: its last event's response
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        said["cached_tokens"] = details.get("cached_tokens") if isinstance(details, dict) else None
        said["cache_read_input_tokens"] = usage.get("cache_read_input_tokens")
    return said


def engine_said(used: Used, said: dict[str, object]) -> None:
    """The engine's figures for the record: prompt tokens its cache served, its time on the prompt and generating
    (nothing it did not say, nor what is not a number)."""
    def number(name: str) -> float | None:
        value = said.get(name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None

    cached = next((n for n in map(number, ("cache_n", "cached_tokens", "cache_read_input_tokens")) if n is not None),
                  None)
    if cached is not None:
        used.cached = int(cached)
    if (prompt_ms := number("prompt_ms")) is not None:
        used.prompt_ms = prompt_ms
    if (generation_ms := number("predicted_ms")) is not None:
        used.generation_ms = generation_ms


async def stream(gw: Gateway, call: Call, used: Used, surface: Surface, payload: bytes, wants_usage: bool,
                 body: JSON) -> Answer | Streamed:
    """A stream passed on event by event. Should its engine fail once it began (close the connection, fall silent
    for its model's stream idle timeout, or leave the fleet), it goes on at another replica as the same answer,
    up to the model's resume limit (gateway/resume.py)."""
    upstream, response = await send(gw, call, call.way, surface, payload)
    if call.request_body is not None:
        used.body = bytearray()
    if response.status != 200:
        try:
            content = await response.read()
        except UpstreamError:
            content = b""
        finally:
            response.release()
            done(gw, call, call.way, upstream)
        if response.status >= 400:
            raise refused(call, surface, upstream, response.status, content)
        call.finish(response.status)
        return Answer(content, response.status, response.content_type)

    route = gw.table.find(call.model) if gw.table is not None else None
    limit = route.resume_limit if route is not None else 0
    idle = route.stream_idle_timeout if route is not None and limit else None
    transcript = surface.resumer(body, call.prompt_about, route.grammar) \
        if surface.resumer is not None and route is not None and limit else None
    current = _Answering(upstream, response)  # the replica answering now, and its answer
    state = {"finished": False, "settled": False, "done_sent": False, "released": False}
    complete = surface.completer(call.model, call.prompt_about) if surface.completer is not None else None

    def release() -> None:
        """The replica is done with the request: once, when the engine's [DONE] arrives (before the client has it:
        a conversation's next turn may follow at once, through another web process, and must not find the
        replica still counted busy with this one), or however else the stream ended."""
        if not state["released"]:
            state["released"] = True
            done(gw, call, call.way, current.upstream)

    def settle(status: int) -> None:
        """Let the upstream go and count the request, once, however the stream ended."""
        if state["settled"]:
            return
        state["settled"] = True
        if state["finished"]:
            current.response.release()  # read to the end: the connection goes back to the pool
        else:
            current.response.close()  # cut short: the engine sees its client go and stops generating
        release()
        used.count_cut_short(call.prompt_about)
        if used.completion and not used.prompt:  # its prompt's count never came (a Messages stream without its start)
            used.prompt = call.prompt_about
        if transcript is not None:
            used.resumed_prompt = transcript.fleet_prompt
        gw.ledger.add(call.key_id, call.model, used.prompt, used.completion, resumed=used.resumed_prompt)
        call.finish(status)

    def passing(events: list[bytes], seam: Seam | None) -> list[bytes]:
        """The events as the client gets them: a continuation's made the answer's, the usage read off them (and
        dropped where not asked for), completed for the SDKs, and kept for a resume."""
        out = []
        for event in events:
            for each in seam.splice(event) if seam is not None else (event,):
                if _keep_event(used, surface, each, wants_usage):
                    each = complete(each) if complete is not None else each
                    if transcript is not None:
                        transcript.add(each)
                    out.append(each + b"\n\n")
        return out

    async def events() -> AsyncGenerator[bytes, None]:
        status = 499  # unless it ends otherwise: the client went away, and closing the upstream cancels the work
        seam: Seam | None = None
        try:
            while True:
                buffer = b""
                answer = current.response
                assert isinstance(answer, EngineAnswer)  # being read: another replica's, after a resume
                try:
                    async for chunk in answer.chunks():
                        if idle is not None and answer.idle is None and _TOKEN.search(chunk):
                            answer.idle = idle  # silent from here on: it failed (not before its first token)
                        if used.first_chunk is None:
                            used.first_chunk = time.monotonic()
                            metrics.of(call.model).first_token.observe(used.first_chunk - call.started)
                        buffer += chunk
                        if b"\n\n" not in buffer:
                            continue
                        *whole, buffer = buffer.split(b"\n\n")
                        out = passing(whole, seam)
                        if out:
                            last = any(e.startswith(surface.done_event) for e in out)
                            if last:
                                release()
                            yield b"".join(out)
                            # asked for more: the [DONE] went out. A client that hangs up now got the whole stream
                            state["done_sent"] = state["done_sent"] or last
                    if buffer.strip() and (out := passing([buffer.rstrip(b"\n")], seam)):
                        yield b"".join(out)
                    state["finished"], status = True, 200
                    return
                except UpstreamError as exc:
                    failure: UpstreamError = exc
                if state["done_sent"]:  # the client has the whole answer: an engine that closes late broke nothing
                    status = 200
                    return
                said = describe(failure)
                reason = SILENT if isinstance(failure, ReadTimeout) else LOST if isinstance(failure, Lost) else CLOSED
                why_not = "its model's resume limit is 0" if transcript is None else (
                    f"resumed {used.resumes} times already" if used.resumes >= limit else transcript.why_not())
                tokens = transcript.tokens if transcript is not None else used.passed
                if isinstance(failure, Silent):
                    went = f"went silent for {idle:g}s after {tokens} tokens"
                elif reason == SILENT:
                    went = f"went silent after {tokens} tokens: {said}"
                else:
                    went = f"broke off after {tokens} tokens: {said}"
                if why_not:
                    log.warning("replica %s %s; not resumed: %s", current.upstream.replica, went, why_not)
                    status = 504 if isinstance(failure, ReadTimeout) else 502
                    code = "upstream_timeout" if status == 504 else "upstream_error"
                    what = "stopped sending" if status == 504 else f"broke off: {said}"
                    yield _ending(surface, complete, GatewayError(status, code, f"replica {current.upstream.replica} {what}"))
                    return
                assert transcript is not None  # why_not said it can go on
                state["released"] = True  # _resumed lets the replica go
                _resumed(gw, call, used, current.upstream, answer, reason, f"{went}; resumed")
                if transcript.owed() == 0:  # it had its last token: only its end is missing
                    out = passing(transcript.ending(), None)
                    if out:
                        yield b"".join(out)
                    state["finished"], status = True, 200
                    current.response = _Ended()
                    return
                try:
                    current.upstream, fresh = await send(gw, call, call.way, surface,
                                                     json.dumps(transcript.continuation()).encode(),
                                                     avoid=current.upstream.replica)
                except GatewayError as exc:
                    status = exc.status
                    current.response = _Ended()
                    yield _ending(surface, complete, exc)
                    return
                current.response, state["released"] = fresh, False
                if fresh.status != 200:
                    refusal = refused(call, surface, current.upstream, fresh.status, await _read_refusal(fresh))
                    status = refusal.status
                    yield _ending(surface, complete, refusal)
                    return
                seam = transcript.seam()
        finally:
            settle(200 if status == 499 and state["done_sent"] else status)

    return Streamed(_kept(events(), used, gw.body_bytes), settle)


class _Ended:
    """In place of an answer no longer read (a stream ended without another replica's)."""

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _Answering:
    """The replica a stream's answer comes from now, and its answer (another's, after a resume)."""

    upstream: Upstream
    response: EngineAnswer | _Ended


async def _read_refusal(response: EngineAnswer) -> bytes:
    try:
        content, _ = await response.read_upto(ERROR_BYTES)
    except UpstreamError:
        content = b""
    response.close()
    return content


def _kept(chunks: AsyncGenerator[bytes, None], used: Used, limit: int) -> AsyncGenerator[bytes, None]:
    """The answer's chunks, kept for its record as they pass when its key logs bodies (else as they are)."""
    if used.body is None:
        return chunks

    async def keeping() -> AsyncGenerator[bytes, None]:
        async with aclosing(chunks):
            async for chunk in chunks:
                used.keep(chunk, limit)
                yield chunk

    return keeping()


def _ending(surface: Surface, complete: Callable[[bytes], bytes] | None, exc: GatewayError) -> bytes:
    """The error that ends a stream the engine broke off, completed as the stream's other events were."""
    event = surface.error_event(exc)
    return complete(event[:-2]) + b"\n\n" if complete is not None else event


# a chunk with a token in it: a text of an answer's, not empty (the events before an answer's first token have none)
_TOKEN = re.compile(rb'"(?:content|text|delta|reasoning_content)"\s*:\s*"[^"]')
# a chunk that carries a token: OpenAI's and Anthropic's deltas, and the Responses API's text deltas
_GENERATED = re.compile(rb'"(?:content|text|reasoning_content)"\s*:\s*"|"type"\s*:\s*"response\.output_text\.delta"')


def _keep_event(used: Used, surface: Surface, event: bytes, wants_usage: bool) -> bool:
    """Read the usage off the stream; drop the usage-only chunk the client did not ask for. Count the chunks that
    carry generated text (one token each, as the engines stream), for a stream cut short before its usage."""
    if b'"usage"' not in event:
        if _GENERATED.search(event):
            used.passed += 1
        return True
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            data = json.loads(line[5:])
        except (ValueError, RecursionError):
            return True
        said = surface.event_usage(data, used.prompt, used.completion) if isinstance(data, dict) else None
        if said is None:
            continue
        engine_said(used, _engine_fields(data))
        used.prompt, used.completion, whole = said
        used.usage_known = used.usage_known or whole
        if not wants_usage and not data.get("choices"):
            return False
    return True
