#!/usr/bin/env python
"""Issue 38's fault benchmark: streams in flight when one replica's engine dies, on a real llmgw.

    . .venv/bin/activate
    python bench/resume.py --engine fake                  # tests/engine.py, 32 streams of 200 tokens at 5 ms a token
    python bench/resume.py --engine smollm2               # xllamacpp serving the SmolLM2 GGUF, 4 streams of 96 tokens
    python bench/resume.py --engine fake --fault kill,stop

A llmgw of its own (bench/instance.py: `llmgw up --no-demo`), one model of 2 replicas, least-inflight routing, each
replica with a slot for every stream (so a continuation never waits for admission: what is measured is the resume,
not a full engine). For each fault: N streamed chat completions through the official `openai` client (temperature
0, a seed, each its own question), first unbroken, then again with the fault: once every stream has shown K
tokens, the engine process of the replica serving the most streams gets SIGKILL (`kill`), or SIGSTOP with the
model's stream idle timeout at --idle (`stop`; SIGCONT once the streams are read), and every stream is read to
its end. Then, with the fleet whole again and nothing else running, a cold prefill of each broken stream's
conversation: a fresh request whose last message is the text the client had at the fault, as the continuation
is, timed to its first token. On smollm2 every request says `cache_prompt: false`, so neither a continuation nor
the cold prefill finds its text in an engine's cache from the unbroken run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

from instance import ROOT, Instance, gguf_path
from openai import AsyncOpenAI

ENGINE = ROOT / "tests" / "engine.py"
MODEL = "resumed"
QUESTIONS = ["Explain why the sky is blue.", "Describe how a bicycle works.", "Tell me about the moon.",
             "What is a volcano?", "How do bees make honey?", "Why do leaves change colour?",
             "Describe a thunderstorm.", "How does a compass work?"]


@dataclass
class Stream:
    """One client's stream: which replica answered, each content chunk with when it came, how it ended."""

    index: int
    replica: str = "-"
    chunks: list[tuple[float, str]] = field(default_factory=list)
    finish: str | None = None
    error: str = ""
    before: str | None = None  # the text it had when the fault came (a stream on the faulted engine only)
    cold: str = ""  # what a cold prefill of its text at the seam went on with (8 tokens)

    @property
    def text(self) -> str:
        return "".join(c for _, c in self.chunks)

    def whole(self) -> bool:
        return (not self.error and self.finish is not None and bool(self.text)
                and (self.before is None or self.text.startswith(self.before)))

    def seam(self) -> tuple[float, str] | None:
        """The longest gap the client saw between two chunks, and the text it had before it: the seam, for a stream
        on the faulted engine (not the gap after the fault in the client's time: a client behind its stream still
        reads what was on its way before the gap comes)."""
        if len(self.chunks) < 2:
            return None
        n = max(range(1, len(self.chunks)), key=lambda k: self.chunks[k][0] - self.chunks[k - 1][0])
        return self.chunks[n][0] - self.chunks[n - 1][0], "".join(c for _, c in self.chunks[:n])

    def rate(self) -> float | None:
        """Tokens (content chunks) a second, first chunk to last."""
        if len(self.chunks) < 2:
            return None
        return (len(self.chunks) - 1) / (self.chunks[-1][0] - self.chunks[0][0])


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (reader {i})"}]


def p99(values: list[float]) -> float:
    ranked = sorted(values)
    return ranked[max(0, -(-99 * len(ranked) // 100) - 1)]  # nearest rank


class Run(Instance):
    def __init__(self, o: argparse.Namespace):
        super().__init__("resume", agent_memory="2GiB")
        self.o = o
        self.cli("ctl", "settings", "--reconcile-interval", "1")
        self.cli("ctl", "profile", "add", "wide", "--context-size", str(o.context), "--parallel", str(o.streams),
                 "--threads", "1")
        engine = "xllamacpp"
        if o.engine == "fake":
            engine = "fake"
            answer = " ".join(f"w{n}" for n in range(o.tokens))
            self.cli("ctl", "engine", "add", engine, "--kind", "command", "--command",
                     f"{{python}} {ENGINE} --host {{host}} --port {{port}} --model-path {{model_path}} "
                     f"--delay-ms {o.delay_ms:g} --answer {shlex.quote(answer)}")
        self.cli("ctl", "model", "add", MODEL, "--file", str(gguf_path()), "--engine", engine, "--profile", "wide",
                 "--memory", "300MiB", "--replicas", "2", "--routing", "least-inflight", "--wait", "120")
        self.key = self.cli("ctl", "keys", "create", "resume-bench").stdout.split()[-1]
        self.whole_fleet()
        self.client = AsyncOpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=300)
        self.extra = {"cache_prompt": False} if o.engine == "smollm2" else {}

    def whole_fleet(self) -> None:
        self.wait(lambda: len(self.ready(MODEL)) == 2, 300, f"2 ready replicas of {MODEL}", interval=0.5)

    async def read(self, s: Stream) -> None:
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages(s.index), max_tokens=self.o.tokens, temperature=0, seed=38,
                stream=True, extra_body=self.extra)
            s.replica = raw.headers.get("x-llmgw-replica", "-")
            async for chunk in raw.parse():
                now = time.monotonic()
                for choice in chunk.choices:
                    if choice.delta.content:
                        s.chunks.append((now, choice.delta.content))
                    if choice.finish_reason:
                        s.finish = choice.finish_reason
        except Exception as exc:  # whatever the client met is the finding
            s.error = f"{type(exc).__name__}: {exc}"

    async def load(self, fault: str | None) -> tuple[list[Stream], str]:
        """N streams; once each has K tokens, the fault if any; returns them and the replica faulted."""
        pids = {r["name"]: r["pid"] for r in self.replicas(MODEL) if r["state"] == "ready"}
        streams = [Stream(i) for i in range(self.o.streams)]
        tasks = [asyncio.create_task(self.read(s)) for s in streams]
        deadline = time.monotonic() + 120
        while not all(len(s.chunks) >= self.o.after or s.finish or s.error for s in streams):
            if time.monotonic() > deadline:
                raise SystemExit("the streams never all reached --after tokens")
            await asyncio.sleep(0.002)
        victim = ""
        if fault:
            counts = {name: sum(s.replica == name for s in streams) for name in pids}
            victim = max(counts, key=lambda name: counts[name])
            os.kill(pids[victim], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            for s in streams:
                if s.replica == victim:
                    s.before = s.text
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        finally:
            if fault == "stop":
                try:
                    os.kill(pids[victim], signal.SIGCONT)
                except ProcessLookupError:
                    pass
        return streams, victim

    async def cold(self, s: Stream, text: str) -> tuple[float, str]:
        """Time to the first token of the stream's conversation with the text it had at the seam as a prefill."""
        began = time.monotonic()
        raw = await self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[*messages(s.index), {"role": "assistant", "content": text}], max_tokens=8,
            temperature=0, seed=38, stream=True, extra_body=self.extra)
        first, said = None, ""
        async for chunk in raw.parse():
            if first is None and any(c.delta.content for c in chunk.choices):
                first = time.monotonic() - began
            said += "".join(c.delta.content or "" for c in chunk.choices)
        s.cold = said
        return (first if first is not None else float("nan")), raw.headers.get("x-llmgw-replica", "-")

    async def measure_all(self, faults: list[str]) -> list[dict]:
        return [await self.measure(fault) for fault in faults]

    async def measure(self, fault: str) -> dict:
        if fault == "stop":
            self.cli("ctl", "model", "set", MODEL, "--stream-idle-timeout", f"{self.o.idle:g}s")
        self.whole_fleet()
        unbroken, _ = await self.load(None)
        self.whole_fleet()
        broken, victim = await self.load(fault)
        say(f"{fault}: {victim} faulted with {sum(s.before is not None for s in broken)} streams on it")
        self.whole_fleet()
        hit = [s for s in broken if s.before is not None]
        seamed = [(s, seam) for s in hit if (seam := s.seam()) is not None]
        seams = [gap for _, (gap, _) in seamed]
        colds = [await self.cold(s, text) for s, (_, text) in seamed]
        survivors = [s for s in broken if s.before is None]
        rates = [(r, u) for s in survivors if (r := s.rate()) is not None and (u := unbroken[s.index].rate()) is not None]
        for s in broken:
            if not s.whole() or s.text != unbroken[s.index].text:
                show(s, unbroken[s.index])
        if fault == "stop":
            self.cli("ctl", "model", "set", MODEL, "--stream-idle-timeout", "30s")
        return {"fault": fault, "hit": len(hit), "whole": sum(s.whole() for s in broken), "n": len(broken),
                "same": sum(s.text == unbroken[s.index].text for s in broken),
                "unbroken_whole": sum(s.whole() for s in unbroken),
                "seams": seams, "cold": [c for c, _ in colds], "cold_on": sorted({r for _, r in colds}),
                "fault_rate": statistics.median([r for r, _ in rates]) if rates else None,
                "unbroken_rate": statistics.median([u for _, u in rates]) if rates else None,
                "survivors": len(survivors)}


def show(s: Stream, unbroken: Stream) -> None:
    say(f"stream {s.index} on {s.replica}: whole={s.whole()} finish={s.finish} error={s.error or '-'}")
    say(f"  before the fault: {s.before!r}")
    say(f"  the client's text: {s.text!r}")
    say(f"  unbroken:          {unbroken.text!r}")
    apart = next((n for n, (a, b) in enumerate(zip(s.text, unbroken.text, strict=False)) if a != b),
                 min(len(s.text), len(unbroken.text)))
    if s.text != unbroken.text:
        seam = s.seam()
        at = len(seam[1]) if seam else 0
        say(f"  apart from unbroken from character {apart}; the seam at character {at}; after the seam the client got "
            f"{s.text[at:at + 40]!r}, a cold prefill of the text at the seam {s.cold!r}")


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def table(engine: str, rows: list[dict]) -> None:
    def ms(values: list[float], f) -> str:
        return f"{f(values) * 1000:.0f}" if values else "-"

    print("| engine | fault | streams on the faulted engine | ended whole | text as unbroken | seam p50 ms "
          "| seam p99 ms | cold prefill p50 ms | seam ÷ cold | survivors tok/s: fault | unbroken | ÷ |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = (f"{statistics.median(r['seams']) / statistics.median(r['cold']):.1f}"
                 if r["seams"] and r["cold"] else "-")
        fr, ur = r["fault_rate"], r["unbroken_rate"]
        print(f"| {engine} | {r['fault']} | {r['hit']} of {r['n']} | {r['whole']}/{r['n']} | {r['same']}/{r['n']} "
              f"| {ms(r['seams'], statistics.median)} | {ms(r['seams'], p99)} | {ms(r['cold'], statistics.median)} "
              f"| {ratio} | {fr or 0:.0f} | {ur or 0:.0f} | {fr / ur if fr and ur else 0:.2f} |")
    for r in rows:
        print(f"{r['fault']}: unbroken run {r['unbroken_whole']}/{r['n']} whole; {len(r['seams'])} seams; "
              f"{r['survivors']} survivors; seams (ms) {sorted(round(g * 1000) for g in r['seams'])}; "
              f"cold prefills answered by {', '.join(r['cold_on']) or '-'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("fake", "smollm2"), default="fake")
    p.add_argument("--fault", default="kill", help="kill, stop or both (kill,stop)")
    p.add_argument("--streams", type=int, help="streams at once (fake 32, smollm2 4)")
    p.add_argument("--tokens", type=int, help="max_tokens of each (fake 200, smollm2 96)")
    p.add_argument("--after", type=int, help="tokens every stream shows before the fault (fake 50, smollm2 24)")
    p.add_argument("--delay-ms", type=float, default=5.0, help="the fake engine's milliseconds per token")
    p.add_argument("--idle", type=float, default=2.0, help="the stream idle timeout for --fault stop, seconds")
    p.add_argument("--context", type=int, help="the profile's context size (fake 4096, smollm2 2048)")
    o = p.parse_args()
    fake = o.engine == "fake"
    o.streams = o.streams or (32 if fake else 4)
    o.tokens = o.tokens or (200 if fake else 96)
    o.after = o.after or (50 if fake else 24)
    o.context = o.context or (4096 if fake else 2048)
    faults = o.fault.split(",")
    if not set(faults) <= {"kill", "stop"}:
        p.error("--fault: kill, stop or kill,stop")
    began = time.monotonic()
    run = Run(o)
    say(f"llmgw up in {run.home} (its logs: {run.home / 'up.log'}, {run.home / 'log'})")
    try:
        rows = asyncio.run(run.measure_all(faults))
    finally:
        run.stop()
    print(f"\n`python bench/resume.py --engine {o.engine} --fault {o.fault}`: {o.streams} streams of {o.tokens} tokens,"
          f" the fault after {o.after}; {time.monotonic() - began:.0f} s, load average {os.getloadavg()[0]:.1f}\n")
    table(f"fake, {o.delay_ms:g} ms a token" if fake else o.engine, rows)
    return 0 if all(r["whole"] == r["n"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
