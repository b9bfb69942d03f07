"""Prefix routing end to end, with the official openai client against two real web processes and three replicas
of the test engine on three agents: a conversation stays on one replica whichever gateway it goes through, moves
once when its replica's node is drained with nothing failing, and a burst of one opening is spread within the
load bound."""

import math
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from gateway.affinity import LOAD_FACTOR
from tests.integration.harness import add_test_engine, start_web, wait_for

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are the assistant of a bank. Answer in one sentence. " * 20}


def conversation(document: str):
    """Yields each turn's messages, the history growing with the answers given."""
    messages = [SYSTEM, {"role": "user", "content": f"Here is a letter from a customer: {document}. Summarise it."}]
    answer = yield list(messages)
    for i in range(100):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And point {i}?"}]
        answer = yield list(messages)


def ask(client: openai.OpenAI, model: str, messages, stream: bool = False) -> tuple[str, str]:
    """The answer's text and the replica that gave it (X-Llmgw-Replica)."""
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, stream=stream)
    replica = raw.headers["x-llmgw-replica"]
    parsed = raw.parse()
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in parsed if c.choices), replica
    return parsed.choices[0].message.content, replica


@pytest.fixture(scope="module")
def trio(system):
    add_test_engine(system, name="rt-engine")
    add_test_engine(system, name="rt-slow", args="--delay-ms 150 --answer 'one two three four five six'")
    for name, engine in (("rt-trio", "rt-engine"), ("rt-slow", "rt-slow")):
        system.cli("ctl", "model", "add", name, "--file", system.sha, "--engine", engine, "--replicas", "3",
                   "--memory", "100MiB")
    key = system.cli("ctl", "keys", "create", "rt-key").stdout.split()[-1]
    system.wait_ready("rt-trio", 3)
    system.wait_ready("rt-slow", 3)
    url2 = start_web(system, "rt-web2")

    def both_see_three():  # each web process's own routing table, which reloads a moment after a change
        for url in (system.url, url2):
            for model in ("rt-trio", "rt-slow"):
                shown = httpx.get(f"{url}/v1/models/{model}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
                if shown.json().get("replicas_ready") != 3:
                    return False
        return True

    wait_for(both_see_three, 30, what="both gateways to route to the three replicas")
    yield SimpleNamespace(key=key, one=openai.OpenAI(base_url=system.url + "/v1", api_key=key, max_retries=0),
                          two=openai.OpenAI(base_url=url2 + "/v1", api_key=key, max_retries=0))
    system.procs.pop("rt-web2").stop()
    for name in ("rt-trio", "rt-slow"):
        system.cli("ctl", "model", "remove", name, check=False)
    wait_for(lambda: not {"rt-trio", "rt-slow"} & {m["name"] for m in system.cli_json("ctl", "models")}, 60,
             what="the routing test's models removed")


def test_prefix_is_the_default_and_every_turn_stays_on_one_replica_through_either_gateway(system, trio) -> None:
    shown = {m["name"]: m for m in system.cli_json("ctl", "models")}
    assert shown["rt-trio"]["routing"] == "prefix"
    assert "prefix" in system.cli("ctl", "models").stdout
    went: dict[int, set[str]] = {}
    for c in range(9):
        turns = conversation(f"letter number {c} about a lost card")
        messages = next(turns)
        for t in range(4):
            gateway = trio.one if t % 2 == 0 else trio.two  # turn by turn, the two web processes in turn
            answer, replica = ask(gateway, "rt-trio", messages, stream=t == 3)
            went.setdefault(c, set()).add(replica)
            messages = turns.send(answer)
    assert all(len(replicas) == 1 for replicas in went.values()), went
    assert len(set().union(*went.values())) >= 2, went  # nine openings spread over the replicas


def test_a_drained_replica_moves_its_conversation_once_and_nothing_fails(system, trio):
    turns = conversation("a letter about a mortgage")
    messages = next(turns)
    answer, first = ask(trio.one, "rt-trio", messages)
    node = next(r["node"] for r in system.replicas("rt-trio") if r["name"] == first)
    system.cli("ctl", "drain", node)
    try:
        seen = [first]
        deadline = time.monotonic() + 90
        while True:  # a turn every 0.2 s until the drained replica is gone and three are ready again
            messages = turns.send(answer)
            answer, replica = ask(trio.one, "rt-trio", messages)  # any failure raises
            seen.append(replica)
            ready = [r["name"] for r in system.replicas("rt-trio") if r["state"] == "ready"]
            if first not in ready and len(ready) == 3:
                break
            assert time.monotonic() < deadline, f"the drain did not finish: {system.replicas('rt-trio')}"
            time.sleep(0.2)
        for _ in range(5):
            messages = turns.send(answer)
            answer, replica = ask(trio.one, "rt-trio", messages)
            seen.append(replica)
        moves = sum(1 for a, b in zip(seen, seen[1:]) if a != b)
        assert moves == 1 and seen[-1] != first, seen
    finally:
        system.cli("ctl", "undrain", node)


def test_a_burst_with_one_opening_is_spread_within_the_load_bound(system, trio):
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]  # every conversation opens the same way
    n = 12
    with ThreadPoolExecutor(n) as pool:
        went = list(pool.map(lambda _: ask(trio.one, "rt-slow", messages, stream=True)[1], range(n)))
    counts = {replica: went.count(replica) for replica in set(went)}
    assert max(counts.values()) <= math.ceil(LOAD_FACTOR * n / 3), counts
    assert len(counts) >= 2, counts
