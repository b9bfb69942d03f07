"""Models on demand and autoscaled, end to end: web, worker, beat, an agent and test engines as real processes, the
official openai client as the load. A model idle goes to zero and a request brings it back; two on-demand models
that do not fit together take turns under continuous demand with nothing failed; a fixed model is never evicted;
a load step scales a model up and, after the delay, down, with nothing failed, and a control plane restarted in
the middle carries on from the autoscaler's state in the database."""

import signal
import sys
import threading
import time

import openai
import pytest

from tests.integration.harness import (
    TEST_ENGINE,
    add_test_engine,
    holds_for,
    make_model_file,
    start_system,
    wait_for,
)

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def od(tmp_path_factory):
    """One node offering 1 GiB: one 600 MiB model at a time. The autoscaler's window is 4 s and the minimum
    residency 3 s, so that what takes minutes in a fleet takes seconds here."""
    s = start_system(tmp_path_factory.mktemp("llmgw-od"), extra_env={"LLMGW_AUTOSCALE_WINDOW": "4"}, redis_db=5)
    try:
        add_test_engine(s)
        s.cli("ctl", "engine", "add", "slowengine", "--kind", "command", "--command",
              f"{{python}} {TEST_ENGINE} --host {{host}} --port {{port}} --model-path {{model_path}} "
              "--load-seconds 1 --delay-ms 100")
        s.sha = make_model_file(s)
        s.add_agent("od1", memory="1GiB")
        s.wait_nodes_connected(["od1"])
        s.cli("ctl", "settings", "--min-resident", "3")
        s.secret = s.cli("ctl", "keys", "create", "od").stdout.split()[-1]
        yield s
    except BaseException:
        print(s.diagnostics())
        raise
    finally:
        s.stop()


def client(system, timeout=90):
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key=system.secret, max_retries=0, timeout=timeout)


def ask(system, model: str, stream: bool = False) -> str:
    c = client(system)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in
                       c.chat.completions.create(model=model, messages=MESSAGES, stream=True) if chunk.choices)
    return c.chat.completions.create(model=model, messages=MESSAGES).choices[0].message.content


def remove(system, *models: str) -> None:
    for name in models:
        system.cli("ctl", "model", "remove", name)
    wait_for(lambda: not [m for m in system.cli_json("ctl", "models") if m["name"] in models], 60,
             what=f"{models} removed")


def events(system, kind: str) -> list[dict]:
    response = system.api_retrying("GET", "/api/v1/events/", params={"kind": kind, "limit": 1000})
    return response.json()["results"]


class Load:
    """Clients that never pause, each asking for its model again as soon as it has its answer."""

    def __init__(self, system, models: list[str], stream: bool = False):
        self.system, self.stream = system, stream
        self.outcomes: list[tuple[str, str]] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(m,)) for m in models]

    def _run(self, model: str) -> None:
        while not self.done.is_set():
            try:
                ask(self.system, model, self.stream)
                self.outcomes.append((model, "ok"))
            except Exception as exc:  # every failure counts
                self.outcomes.append((model, repr(exc)[:300]))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        for t in self.threads:
            t.join(120)

    def failed(self) -> list:
        return [o for o in self.outcomes if o[1] != "ok"]

    def served(self, model: str) -> int:
        return sum(1 for m, o in self.outcomes if m == model and o == "ok")


def test_an_idle_model_goes_to_zero_and_a_request_brings_it_back(od):
    od.cli("ctl", "model", "add", "lazy", "--file", od.sha, "--engine", "testengine", "--memory", "600MiB",
           "--min-replicas", "0", "--max-replicas", "1", "--idle-after", "3s", "--wait", "60")
    holds_for(lambda: not od.replicas("lazy"), 2, what="nothing loaded before it is asked for")
    started = time.monotonic()
    assert ask(od, "lazy")  # waits for the replica it woke
    print(f"cold start through the gateway (test engine loading 1 s): {time.monotonic() - started:.2f} s")
    woken = [e for e in events(od, "model.scaled") if e["subject"] == "lazy"]
    assert woken and "woken: 1 request(s) waiting" in woken[-1]["message"]

    wait_for(lambda: not od.replicas("lazy"), 60, what="the idle model to go to zero")
    said = [e["message"] for e in events(od, "model.scaled") if e["subject"] == "lazy"]
    assert any("1 -> 0 replica(s): idle: no request for" in m for m in said), said
    shown = [m for m in od.cli_json("ctl", "models") if m["name"] == "lazy"][0]
    assert (shown["scaling"]["mode"], shown["scaling"]["wanted"]) == ("on-demand", 0)

    assert ask(od, "lazy", stream=True)  # and back again, streamed
    remove(od, "lazy")


def test_two_on_demand_models_that_do_not_fit_together_take_turns(od):
    for name in ("a", "b"):
        od.cli("ctl", "model", "add", name, "--file", od.sha, "--engine", "testengine", "--memory", "600MiB",
               "--min-replicas", "0", "--max-replicas", "1", "--wait", "60")
    seconds = 24
    with Load(od, ["a", "a", "b", "b"]) as load:
        time.sleep(seconds)
    assert not load.failed(), load.failed()[:5]
    served = {m: load.served(m) for m in ("a", "b")}
    assert min(served.values()) >= 5, served  # neither starves
    swaps = [e for e in events(od, "replica.evicted") if e["data"]["model"] in ("a", "b")]
    # each swap waits for the resident one's minimum residency (3 s) and for the other's load (1 s)
    assert 1 <= len(swaps) <= seconds / 3 + 2, [e["message"] for e in swaps]
    print(f"swap storm: {served} answered, 0 failed, {len(swaps)} swaps in {seconds} s")
    remove(od, "a", "b")


def test_a_fixed_model_is_never_evicted(od):
    od.cli("ctl", "model", "add", "fixed", "--file", od.sha, "--engine", "testengine", "--memory", "600MiB")
    [kept] = od.wait_ready("fixed", 1)
    od.cli("ctl", "model", "add", "wanted", "--file", od.sha, "--engine", "testengine", "--memory", "600MiB",
           "--min-replicas", "0", "--max-replicas", "1", "--wait", "60")
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        ask(od, "wanted")
    assert refused.value.status_code == 503 and refused.value.code == "no_replica_ready"
    assert "model fixed is not autoscaled" in refused.value.message, refused.value.message
    assert refused.value.response.headers["Retry-After"]
    assert time.monotonic() - started < 15  # answered, not left to wait its minute
    said = [e["message"] for e in events(od, "replica.unplaceable") if e["subject"].startswith("wanted-")]
    assert said and "nothing to evict (model fixed is not autoscaled)" in said[-1]
    [still] = od.wait_ready("fixed", 1)
    assert (still["name"], still["pid"]) == (kept["name"], kept["pid"])
    remove(od, "fixed", "wanted")


def test_a_load_step_scales_up_then_down_and_a_restart_keeps_the_state(od):
    od.cli("ctl", "model", "add", "step", "--file", od.sha, "--engine", "slowengine", "--memory", "400MiB",
           "--min-replicas", "1", "--max-replicas", "2", "--target-inflight", "1", "--scale-down-delay", "3s",
           "--wait", "60")
    od.wait_ready("step", 1)

    def wanted():
        return [m for m in od.cli_json("ctl", "models") if m["name"] == "step"][0]["scaling"]["wanted"]

    with Load(od, ["step"] * 4, stream=True) as load:
        stepped = time.monotonic()
        od.wait_ready("step", 2, timeout=60)
        print(f"load step: the second replica serving {time.monotonic() - stepped:.1f} s after the step")
        up = [e for e in events(od, "model.scaled") if e["subject"] == "step" and e["data"]["after"] == 2]
        # decided the moment the window's average passed the target; the Event keeps it rounded to 0.01 (a CI
        # run's 1.004 was written 1.0)
        assert up and up[-1]["data"]["per_replica"] >= 1 and up[-1]["data"]["target"] == 1

        # the control plane's worker and beat die and come back: the autoscaler carries on where it was
        for name in ("worker", "beat"):
            od.procs[name].stop(signal.SIGKILL, 5)
        holds_for(lambda: len([r for r in od.replicas("step") if r["state"] == "ready"]) == 2, 3,
                  what="both replicas serving while no reconciler runs")
        py = sys.executable
        od.spawn("worker", [py, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "-c", "1",
                            "--without-gossip", "--without-mingle", "-n", f"it-od-{od.port}@%h"])
        od.spawn("beat", [py, "-m", "celery", "-A", "llmgw", "beat", "-l", "info",
                          "-s", str(od.home / "celerybeat-schedule-2")])
        holds_for(lambda: wanted() == 2, 6, what="the autoscaler's two replicas after the restart")
    assert not load.failed(), load.failed()[:5]

    wait_for(lambda: wanted() == 1, 60, what="one replica fewer after the delay")
    od.wait_ready("step", 1, timeout=60)
    down = [e for e in events(od, "model.scaled") if e["subject"] == "step" and e["data"]["after"] == 1]
    assert down and "hold the target of 1" in down[-1]["message"]
    assert ask(od, "step")
    remove(od, "step")
