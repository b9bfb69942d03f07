"""One request through /v1/, as the gateway keeps it: who asked (its key and class), what (its model and surface),
what it holds (its slot, its key's slot, its budget and rate reservations), where it went (replicas, attempts),
and what it used (tokens, first chunk); and its end, once: the reservations settled, the slots given back, the
metrics, the access log line and the traffic counted.

`Call` is the request's one record, made and owned by the views (gateway/views.py): they alone write its own
fields (`key`, `model`, `rank`, the reservations). What a later step adds has a record of its own inside it, which
that step is handed by name: `Way`, where the request went, to choosing and sending (gateway/sending.py,
gateway/slots.py: `send(gw, call, way, ...)`), and `Used`, what it used, to the answer (gateway/answers.py). Every
other step reads. tests/gateway/test_call.py holds the gateway to it: nothing writes a `Call`'s fields outside the
views, and a `Way` or a `Used` is written only by the step whose signature names it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway import admission, metrics
from gateway.records import Row, Try, Why
from gateway.spend import Hold
from gateway.table import KeyInfo
from gateway.tracing import Trace

if TYPE_CHECKING:
    from gateway.runtime import Gateway

access = logging.getLogger("llmgw.access")


@dataclass(slots=True, eq=False)
class Way:
    """Where a request went: written by choosing and sending (gateway/sending.py, gateway/slots.py)."""

    replica: str = "-"
    attempts: int = 0  # replicas it was sent to
    waited: float | None = None  # seconds it waited for a ready replica, once it looked for one
    asked_until: float = 0.0  # an autoscaled model found without room: until when the request waits for news
    lease_asked: bool = False  # it waited in its model's queue for a replica on its way (once)
    lease: admission.Lease | None = None  # the slot it holds (gateway/admission.py)
    position: int | None = None  # where it entered its model's queue, when it waited in it (1: first in line)
    why: Why | None = None  # why its last replica (gateway/explain.py)
    tries: list[Try] = field(default_factory=list)  # each replica it was sent to, and what became of it


@dataclass(slots=True, eq=False)
class Used:
    """What a request used: written by its answer (gateway/answers.py)."""

    first_chunk: float | None = None
    prompt: int = 0
    completion: int = 0
    passed: int = 0  # tokens of a streamed answer passed on to the client, as counted by its chunks
    usage_known: bool = False  # the engine said what the request used
    cached: int = 0  # prompt tokens the engine's cache served (llama.cpp's timings.cache_n, OpenAI's cached_tokens)
    prompt_ms: float | None = None  # the engine's time on the prompt, as it said (llama.cpp's timings)
    generation_ms: float | None = None  # the engine's time generating, as it said
    resumes: int = 0  # times its answer went on at another replica after its engine failed (gateway/resume.py)
    resumed_prompt: int = 0  # prompt tokens those continuations cost the fleet (not its key)
    body: bytearray | None = None  # what the client was answered, when its key logs bodies (as far as it is kept)
    body_cut: bool = False  # there was more of it than is kept

    def keep(self, part: bytes, limit: int) -> None:
        """Part of the answer as the client gets it, kept for the record up to `limit` bytes."""
        assert self.body is not None  # keeping: its key logs bodies
        room = limit - len(self.body)
        if len(part) > room:
            self.body_cut = True
        if room > 0:
            self.body += part[:room]

    def count_cut_short(self, prompt_about: int) -> None:
        """A stream that ended before the engine said what it used (the client closed it, say) still used what the
        engine produced: the tokens passed on, and its prompt as estimated when anything was passed."""
        if not self.usage_known and self.passed:
            self.prompt, self.completion = self.prompt or prompt_about, max(self.completion, self.passed)


@dataclass(slots=True, eq=False)
class Call:
    """One request's record on its way through the gateway (the module's docstring says who writes what)."""

    started: float = field(default_factory=time.monotonic)
    request_id: str = ""  # its id (gateway/tracing.py: the client's or a new one)
    trace: Trace | None = None  # its trace, the client's continued or a new one
    engine_headers: str = ""  # what the engine is told of both: `traceparent` and `X-Request-Id` header lines
    surface: str = ""  # its API (gateway/surfaces.py: its path under /v1/)
    client: str = ""  # its client's address
    asked: str = ""  # the model as the client named it (an alias, say)
    streamed: bool = False
    error: str = ""  # the code of the error it was answered with, when it was refused
    gw: Gateway | None = None  # the process's gateway runtime, once the request reached it (views)
    # who and what (views)
    key: KeyInfo | None = None
    model: str = "-"  # as asked, then the model's own name (an alias resolved)
    known: bool = False  # `model` names a model llmgw serves: only such names become metric labels
    rank: int = admission.RANK[admission.DEFAULT_CLASS]  # its class when it waits for a slot
    admits: bool = True  # it takes a slot of an engine (counting tokens takes none)
    affinity: int | None = None  # its key on the model's ring, when the model routes by prefix
    session: bool = False  # that key is its session's (a header named it), not its prompt's prefix
    prompt_about: int = 0  # its prompt's tokens as estimated (gateway.prompt), until the engine says
    estimated: int = 0  # the same, before its model's learned overhead (Gateway.prompt_overhead)
    # what it holds of its key (views)
    reserved: int = 0  # tokens reserved against its key's tpm limit when it was admitted
    reserved_minute: int | None = None  # the minute they were reserved in (None: no tpm limit)
    key_slot: str | None = None  # one of its key's requests at once (max_concurrency)
    budget: Hold | None = None  # what it reserved of its key's budget
    way: Way = field(default_factory=Way)  # where it went (choosing and sending)
    used: Used = field(default_factory=Used)  # what it used (its answer)
    status: int = 0
    # its key logs bodies (views): what the client sent, and the error it was answered with, if it was refused
    request_body: bytes | None = None
    error_body: bytes = b""

    @property
    def label(self) -> str:
        """The model as a metric label: a model llmgw serves, else the one `unknown` bucket (any client could
        otherwise grow the series, and the web process with them, a name at a time)."""
        return self.model if self.known else metrics.UNKNOWN_MODEL

    @property
    def key_id(self) -> int:
        """Its key's id, once the views checked its key (a request without one goes no further than them)."""
        assert self.key is not None
        return self.key.id

    async def settle(self) -> None:
        """Count what it used against its key's tpm limit in place of what it reserved (never raises: an answer
        given is never replaced for it)."""
        if self.reserved_minute is not None:
            assert self.gw is not None and self.key is not None  # a key's reservation, made in the gateway
            minute, self.reserved_minute = self.reserved_minute, None
            await self.gw.limits.settle(self.key, self.used.prompt + self.used.completion, self.reserved, minute)

    def record(self, status: int, ended: float) -> Row:
        """Its record (gateway/records.py), as it ended (`ended`: time.monotonic() then)."""
        way, used = self.way, self.used
        return Row(
            self.request_id, self.trace.trace_id if self.trace else "", time.time() - (ended - self.started),
            self.key.id if self.key else None, _clean(self.model[:128]), _clean(self.asked[:128]), self.surface,
            self.streamed, status, self.error, admission.CLASSES[self.rank], None if way.waited is None else way.waited * 1000,
            way.replica if way.replica != "-" else "", way.attempts,
            None if used.first_chunk is None else (used.first_chunk - self.started) * 1000,
            (ended - self.started) * 1000, used.prompt, used.completion, self.client[:64],
            self.trace.span_id if self.trace else "", self.trace.parent_id if self.trace else "", way.position,
            way.why, tuple(way.tries), used.cached, used.prompt_ms, used.generation_ms, *self._bodies(),
            resumes=used.resumes, resumed_prompt_tokens=used.resumed_prompt)

    def _bodies(self) -> tuple[str, str]:
        """What the client sent and was answered, for the record, as far as kept (nothing: its key keeps none)."""
        if self.request_body is None or self.gw is None:
            return "", ""
        limit = self.gw.body_bytes
        answered, cut = (bytes(self.used.body), self.used.body_cut) if self.used.body is not None else (
            self.error_body[:limit], len(self.error_body) > limit)
        return _text(self.request_body[:limit], len(self.request_body) > limit, limit), _text(answered, cut, limit)

    def finish(self, status: int) -> None:
        self.status = status
        way, used = self.way, self.used
        ended = time.monotonic()
        if used.usage_known and self.gw is not None:
            self.gw.learn_prompt(self.model, self.estimated, used.prompt)
        if self.reserved_minute is not None and self.gw is not None:
            self.gw.spawn(self.settle())
        if self.gw is not None:
            if self.key_slot is not None:
                slot, self.key_slot = self.key_slot, None
                self.gw.spawn(self.gw.admission.keys.let_go(slot))
            if self.budget is not None:
                budget, self.budget = self.budget, None
                self.gw.budgets.settle(budget, used.prompt + used.completion)
        seconds = ended - self.started
        series = metrics.of(self.label)
        series.requests(status).inc()
        series.latency.observe(seconds)
        if way.attempts:
            series.attempts.observe(way.attempts)
        if way.waited is not None:
            series.waited.observe(way.waited)
        if used.prompt or used.completion:
            series.prompt.inc(used.prompt)
            series.completion.inc(used.completion)
        if used.resumed_prompt:
            series.resumed_prompt.inc(used.resumed_prompt)
        if self.gw is not None:
            first = used.first_chunk - self.started if used.first_chunk is not None else None
            self.gw.ledger.count(status, used.prompt + used.completion, first_chunk=first)
            if self.gw.records is not None or self.gw.spans is not None:
                row = self.record(status, ended)
                if self.gw.records is not None:
                    self.gw.records.add(row)
                if self.gw.spans is not None:
                    self.gw.spans.add(row)
        access.info(
            "request=%s key=%s model=%s replica=%s status=%s duration_ms=%.1f prompt_tokens=%d completion_tokens=%d",
            self.request_id or "-",
            self.key.prefix if self.key else "-",
            self.model if self.known or self.model == "-" else f"unknown({self.model[:64]!r})",
            way.replica,
            status,
            seconds * 1000,
            used.prompt,
            used.completion,
        )


def _text(body: bytes, cut: bool, limit: int) -> str:
    """A body as the record keeps it: UTF-8 (what is not, replaced), said where it was cut."""
    text = _clean(body.decode(errors="replace"))
    return f"{text}\n[… cut at {limit} bytes]" if cut else text


def _clean(name: str) -> str:
    """A name as the client sent it, as a database keeps text: PostgreSQL's holds no NUL."""
    return name.replace("\x00", "\ufffd") if "\x00" in name else name
