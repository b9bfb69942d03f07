"""The questions every front door asks, answered once: the CLI, the REST API, the dashboard and placement agree."""

import io
import json
import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from cluster import planner, queries, reconciler
from cluster.models import GIB, Event, Replica
from tests.factories import make_model, make_node, make_replica, session_for

S = Replica.State
GPUS = [{"index": 0, "name": "L4", "memory_bytes": 24 * GIB}, {"index": 1, "name": "L4", "memory_bytes": 24 * GIB}]


def a_busy_node():
    node = make_node("n1", memory_bytes=16 * GIB, facts={"gpus": GPUS, "engines": {"llama.cpp": "", "vllm": ""}})
    cpu, gpu = make_model("cpu"), make_model("gpu", engine="llama.cpp-gpu")
    make_replica(cpu, node, S.READY, memory_bytes=2 * GIB)
    make_replica(cpu, node, S.DRAINING, memory_bytes=1 * GIB)
    make_replica(cpu, node, S.STOPPING, memory_bytes=1 * GIB)  # still holds it until its engine has stopped
    make_replica(cpu, node, S.STOPPED, memory_bytes=8 * GIB)  # over: holds nothing
    make_replica(cpu, node, S.FAILED, memory_bytes=8 * GIB)
    make_replica(gpu, node, S.STARTING, memory_bytes=6 * GIB, gpu_index=1)  # GPU memory, not RAM
    return node


def test_memory_in_use_counts_what_placement_counts(db, operator):
    node = a_busy_node()
    used = queries.memory_in_use()
    assert (used.ram(node.pk), used.gpus(node.pk, 2)) == (4 * GIB, [0, 6 * GIB])

    # placement sees the same: a model needing one byte more than what is left does not fit
    snapshot = reconciler.take_snapshot()
    left = 16 * GIB - 4 * GIB
    too_big = planner.ModelView(id=999, name="big", replicas=1, memory_bytes=left + 1, engine_kind="llama.cpp",
                                uses_gpu=False)
    actions = planner.plan(planner.Snapshot(**{**snapshot.__dict__, "models": (too_big,)}))
    assert "the most free is 12.0 GiB on n1" in actions[0].reason

    # the REST API
    shown = operator.get(f"/api/v1/nodes/{node.name}/").json()
    assert (shown["memory_used_bytes"], shown["gpu_memory_used_bytes"]) == (4 * GIB, [0, 6 * GIB])
    listed = operator.get("/api/v1/nodes/").json()["results"][0]
    assert (listed["memory_used_bytes"], listed["gpu_memory_used_bytes"]) == (4 * GIB, [0, 6 * GIB])

    # the CLI
    out = io.StringIO()
    call_command("llmgw", "ctl", "nodes", "--json", stdout=out)
    row = json.loads(out.getvalue())[0]
    assert row["memory_used_bytes"] == 4 * GIB
    assert row["gpu_memory_used_bytes"] == [0, 6 * GIB]  # the API's own representation
    out = io.StringIO()
    call_command("llmgw", "ctl", "nodes", stdout=out)
    assert "4.0 GiB / 16.0 GiB" in out.getvalue() and "6.0 GiB / 24.0 GiB" in out.getvalue()

    # the dashboard
    page = session_for("viewer").get("/nodes/").content.decode()
    assert "4.0 GiB used" in page and "6.0 GiB used" in page
    assert re.search(r"GPU 0 L4.*?0 B used", page, re.S)


def test_the_current_replicas_are_the_same_list_everywhere(db, viewer):
    node, model = make_node("n1"), make_model("m")
    ready = make_replica(model, node, S.READY)
    failed_now = make_replica(model, node, S.FAILED)
    failed_long_ago = make_replica(model, node, S.FAILED)
    stopped = make_replica(model, node, S.STOPPED)
    Replica.objects.filter(pk=failed_long_ago.pk).update(state_changed_at=timezone.now() - timedelta(minutes=11))
    current = {ready.name, failed_now.name}
    everything = current | {failed_long_ago.name, stopped.name}

    assert {r.name for r in queries.replicas_listed()} == current
    assert {r.name for r in queries.replicas_listed(include_over=True)} == everything
    api = {r["name"] for r in viewer.get("/api/v1/replicas/?current=true").json()["results"]}
    assert api == current
    assert {r["name"] for r in viewer.get("/api/v1/replicas/").json()["results"]} == everything
    assert viewer.get("/api/v1/replicas/?current=maybe").status_code == 400
    out = io.StringIO()
    call_command("llmgw", "ctl", "replicas", "--json", stdout=out)
    assert {r["name"] for r in json.loads(out.getvalue())} == current
    out = io.StringIO()
    call_command("llmgw", "ctl", "replicas", "--all", "--json", stdout=out)
    assert {r["name"] for r in json.loads(out.getvalue())} == everything
    page = session_for("viewer").get("/replicas/").content.decode()
    assert all(name in page for name in current) and not any(n in page for n in everything - current)
    page = session_for("viewer").get("/replicas/?over=1").content.decode()
    assert all(name in page for name in everything)


def test_settings_are_shown_the_same_by_the_cli_and_the_api(db, viewer):
    out = io.StringIO()
    call_command("llmgw", "ctl", "settings", "--json", stdout=out)
    assert json.loads(out.getvalue()) == viewer.get("/api/v1/settings/").json() == queries.cluster_settings_shown()


def test_what_a_model_serves_is_the_same_everywhere(db, viewer):
    """The engine's driver reads the profile: llama.cpp embeds with --embeddings and takes images with a
    projector, a vLLM pooling model only embeds, a command engine is taken at its word."""
    from cluster.models import Profile

    Profile.objects.create(name="embeds", extra_args=["--embeddings", "--pooling", "mean"])
    Profile.objects.create(name="sees", extra_args=["--mmproj", "/models/proj.gguf"])
    Profile.objects.create(name="pooling", extra_args=["--task=embed"])
    Profile.objects.create(name="ranks", extra_args=["--embeddings", "--pooling", "rank"])
    generates = ["chat", "completions", "messages", "responses"]
    expected = {
        "plain": (make_model("plain"), generates),
        "embeds": (make_model("embeds", engine="xllamacpp", profile="embeds"),
                   ["chat", "completions", "embeddings", "messages", "responses"]),
        "ranks": (make_model("ranks", profile="ranks"), ["chat", "completions", "embeddings", "messages", "responses",
                                                         "rerank"]),
        "sees": (make_model("sees", profile="sees"), [*generates, "images", "audio"]),
        "pooled": (make_model("pooled", engine="vllm", profile="pooling"), ["embeddings", "rerank"]),
    }
    for name, (model, serves) in expected.items():
        assert list(model.capabilities()) == serves, name
        shown = viewer.get(f"/api/v1/models/{name}/").json()
        assert shown["capabilities"] == serves
        assert shown["serves"] == [s for s in serves if s not in ("images", "audio")]
    out = io.StringIO()
    call_command("llmgw", "ctl", "models", "--json", stdout=out)
    assert {m["name"]: m["capabilities"] for m in json.loads(out.getvalue())} == {n: s for n, (_, s) in expected.items()}
    out = io.StringIO()
    call_command("llmgw", "ctl", "models", stdout=out)
    assert re.search(r"^pooled .* embeddings,rerank ", out.getvalue(), re.M)
    assert "chat,completions,messages,responses,images,audio" in out.getvalue()
    page = session_for("viewer").get("/models/").content.decode()
    assert "serves chat, completions, embeddings, messages, responses" in page and "serves embeddings, rerank<" in page


def cli(*args: str) -> str:
    """A CLI command in this process, as an operator types it: what it printed."""
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


def test_a_completions_cap_on_tokens_is_set_the_same_way_everywhere(db, operator):
    """The model's cap (4096 unless set; none: no cap) and a key's, by the CLI, the REST API and the dashboard,
    bad values refused alike and changing nothing."""
    from django.core.management.base import CommandError

    from cluster.models import Model
    from gateway.models import ApiKey
    from tests.factories import make_file, row_counts

    f = make_file(name="tiny.gguf")
    page = session_for("operator")

    cli("ctl", "model", "add", "by-cli", "--file", f.sha256, "--engine", "llama.cpp")
    cli("ctl", "model", "add", "by-cli-512", "--file", f.sha256, "--engine", "llama.cpp", "--max-tokens", "512")
    assert operator.post("/api/v1/models/", {"name": "by-api", "file": f.sha256, "engine": "llama.cpp"},
                         format="json").json()["max_tokens"] == 4096
    page.post("/models/add/", {"name": "by-page", "file": f.sha256, "engine": "llama.cpp", "max_tokens": "none"})
    assert dict(Model.objects.values_list("name", "max_tokens")) == {
        "by-cli": 4096, "by-cli-512": 512, "by-api": 4096, "by-page": None}

    cli("ctl", "model", "set", "by-cli", "--max-tokens", "none")
    assert operator.patch("/api/v1/models/by-api/", {"max_tokens": 64}, format="json").json()["max_tokens"] == 64
    page.post("/models/by-page/set/", {"max_tokens": "128"})
    assert dict(Model.objects.values_list("name", "max_tokens")) == {
        "by-cli": None, "by-cli-512": 512, "by-api": 64, "by-page": 128}
    shown = {m["name"]: m["max_tokens"] for m in json.loads(cli("ctl", "models", "--json"))}
    assert shown == {"by-cli": None, "by-cli-512": 512, "by-api": 64, "by-page": 128}
    assert "at most 128 tokens per completion" in page.get("/models/").content.decode()

    cli("ctl", "keys", "create", "k-cli", "--max-tokens", "100")
    assert operator.post("/api/v1/keys/", {"name": "k-api", "max_tokens": 200}, format="json").json()["max_tokens"] == 200
    page.post("/keys/create/", {"name": "k-page", "max_tokens": "300"})
    assert dict(ApiKey.objects.values_list("name", "max_tokens")) == {"k-cli": 100, "k-api": 200, "k-page": 300}
    assert [k["max_tokens"] for k in json.loads(cli("ctl", "keys", "list", "--json"))] == [200, 100, 300]

    before = row_counts()
    for bad in ("0", "-5", "lots"):
        with pytest.raises(CommandError, match="--max-tokens"):
            cli("ctl", "model", "set", "by-api", "--max-tokens", bad)
        with pytest.raises(CommandError, match="--max-tokens"):
            cli("ctl", "keys", "create", "k-bad", "--max-tokens", bad)
    for bad in (0, -5, "lots", 2**31):
        assert operator.patch("/api/v1/models/by-api/", {"max_tokens": bad}, format="json").status_code == 400
        assert operator.post("/api/v1/keys/", {"name": "k-bad", "max_tokens": bad}, format="json").status_code == 400
    said = page.post("/models/by-api/set/", {"max_tokens": "lots"}, HTTP_HX_REQUEST="true").content.decode()
    assert "max tokens: &#x27;lots&#x27; is not a whole number" in said
    said = page.post("/models/by-api/set/", {"max_tokens": "0"}, HTTP_HX_REQUEST="true").content.decode()
    assert "max tokens must be a whole number from 1" in said
    assert row_counts() == before


def test_a_models_caps_on_an_answer_are_set_the_same_way_everywhere(db, operator):
    """max_logprobs (20 unless set; 0: none at all) and max_choices (8; none: no cap), by the CLI, the REST API
    and the dashboard, shown by each; bad values refused alike (one line, a DRF 400, a form message), changing
    nothing."""
    from django.core.management.base import CommandError

    from cluster.models import Model
    from tests.factories import make_file, row_counts

    f = make_file(name="tiny.gguf")
    page = session_for("operator")

    def caps():
        return {name: (logprobs, choices) for name, logprobs, choices in
                Model.objects.values_list("name", "max_logprobs", "max_choices")}

    cli("ctl", "model", "add", "by-cli", "--file", f.sha256, "--engine", "llama.cpp")
    cli("ctl", "model", "add", "by-cli-0", "--file", f.sha256, "--engine", "llama.cpp", "--max-logprobs", "0",
        "--max-choices", "none")
    made = operator.post("/api/v1/models/", {"name": "by-api", "file": f.sha256, "engine": "llama.cpp"},
                         format="json").json()
    assert (made["max_logprobs"], made["max_choices"]) == (20, 8)
    page.post("/models/add/", {"name": "by-page", "file": f.sha256, "engine": "llama.cpp", "max_logprobs": "none",
                               "max_choices": "2"})
    assert caps() == {"by-cli": (20, 8), "by-cli-0": (0, None), "by-api": (20, 8), "by-page": (None, 2)}

    cli("ctl", "model", "set", "by-cli", "--max-logprobs", "none")  # the other cap left as it is
    cli("ctl", "model", "set", "by-cli-0", "--max-choices", "3", "--max-logprobs", "5")
    changed = operator.patch("/api/v1/models/by-api/", {"max_logprobs": 0, "max_choices": None}, format="json").json()
    assert (changed["max_logprobs"], changed["max_choices"]) == (0, None)
    page.post("/models/by-page/set/", {"max_logprobs": "7", "max_choices": "none"})
    expected = {"by-cli": (None, 8), "by-cli-0": (5, 3), "by-api": (0, None), "by-page": (7, None)}
    assert caps() == expected
    shown = {m["name"]: (m["max_logprobs"], m["max_choices"]) for m in json.loads(cli("ctl", "models", "--json"))}
    assert shown == expected
    read = operator.get("/api/v1/models/").json()["results"]
    assert {m["name"]: (m["max_logprobs"], m["max_choices"]) for m in read} == expected
    listed = page.get("/models/").content.decode()
    assert "at most 7 logprobs per token · no choices cap" in listed
    assert "at most 5 logprobs per token · at most 3 choices per request" in listed
    assert 'name="max_logprobs" value="none"' in listed and 'name="max_choices" value="3"' in listed

    before = row_counts()
    for flag, bad in (("--max-logprobs", "-1"), ("--max-logprobs", "lots"), ("--max-choices", "0"),
                      ("--max-choices", "2.5")):
        with pytest.raises(CommandError, match=f"^llmgw ctl model set: argument {flag}: '{re.escape(bad)}'") as refused:
            cli("ctl", "model", "set", "by-api", flag, bad)
        assert "\n" not in str(refused.value)
        with pytest.raises(CommandError, match=flag):
            cli("ctl", "model", "add", "by-cli-bad", "--file", f.sha256, "--engine", "llama.cpp", flag, bad)
    for field, bad in (("max_logprobs", -1), ("max_logprobs", "lots"), ("max_logprobs", 2**31), ("max_choices", 0),
                       ("max_choices", 1.5), ("max_choices", True)):
        answer = operator.patch("/api/v1/models/by-api/", {field: bad, "max_tokens": 9}, format="json")
        assert answer.status_code == 400 and field in answer.json(), (field, bad)
        answer = operator.post("/api/v1/models/", {"name": "by-api-bad", "file": f.sha256, "engine": "llama.cpp",
                                                   field: bad}, format="json")
        assert answer.status_code == 400 and field in answer.json(), (field, bad)
    said = page.post("/models/by-api/set/", {"max_choices": "lots"}, HTTP_HX_REQUEST="true").content.decode()
    assert "max choices: &#x27;lots&#x27; is not a whole number" in said
    said = page.post("/models/by-api/set/", {"max_choices": "0", "max_tokens": "9"}, HTTP_HX_REQUEST="true")
    assert "max choices must be a whole number from 1" in said.content.decode()
    said = page.post("/models/by-api/set/", {"max_logprobs": "-1"}, HTTP_HX_REQUEST="true").content.decode()
    assert "max logprobs must be a whole number from 0" in said
    said = page.post("/models/add/", {"name": "by-page-bad", "file": f.sha256, "engine": "llama.cpp",
                                      "max_logprobs": "many"}, HTTP_HX_REQUEST="true").content.decode()
    assert "max logprobs: &#x27;many&#x27; is not a whole number" in said
    assert row_counts() == before and caps() == expected
    assert Model.objects.get(name="by-api").max_tokens == 4096


def test_a_models_aliases_are_set_the_same_way_everywhere(db, operator):
    """`--alias A,B` (none or '': cleared), the API's `aliases` list and the dashboard's comma-separated field,
    shown by each; a taken alias refused alike (one line, a 409, a form message), a malformed one (one line, a
    DRF 400, a form message), each changing nothing."""
    from django.core.management.base import CommandError

    from cluster.models import Model
    from tests.factories import make_file, row_counts

    f = make_file(name="tiny.gguf")
    page = session_for("operator")

    def aliases():
        return dict(Model.objects.values_list("name", "aliases"))

    said = cli("ctl", "model", "add", "by-cli", "--file", f.sha256, "--engine", "llama.cpp", "--alias",
               "gpt-5-codex, claude-sonnet-4-5,gpt-5-codex")
    assert "also answers to claude-sonnet-4-5, gpt-5-codex;" in said
    made = operator.post("/api/v1/models/", {"name": "by-api", "file": f.sha256, "engine": "llama.cpp",
                                             "aliases": ["anthropic/claude-x"]}, format="json")
    assert made.status_code == 201 and made.json()["aliases"] == ["anthropic/claude-x"]
    page.post("/models/add/", {"name": "by-page", "file": f.sha256, "engine": "llama.cpp",
                               "aliases": "gpt-4o-mini, claude-3-5-haiku-20241022"})
    assert aliases() == {"by-cli": ["claude-sonnet-4-5", "gpt-5-codex"], "by-api": ["anthropic/claude-x"],
                         "by-page": ["claude-3-5-haiku-20241022", "gpt-4o-mini"]}

    said = cli("ctl", "model", "set", "by-cli", "--alias", "gpt-5-codex")
    assert said.endswith("routing prefix, aliases gpt-5-codex, resume 2, idle 30s\n")
    changed = operator.patch("/api/v1/models/by-api/", {"aliases": ["claude-sonnet-4-5", "Claude:Latest"]},
                             format="json").json()
    assert changed["aliases"] == ["Claude:Latest", "claude-sonnet-4-5"]
    page.post("/models/by-page/set/", {"aliases": "none"})
    expected = {"by-cli": ["gpt-5-codex"], "by-api": ["Claude:Latest", "claude-sonnet-4-5"], "by-page": []}
    assert aliases() == expected
    shown = {m["name"]: m["aliases"] for m in json.loads(cli("ctl", "models", "--json"))}
    assert shown == expected
    listed = cli("ctl", "models")
    assert "ALIASES" in listed.splitlines()[0]
    assert re.search(r"^by-api .* Claude:Latest,claude-sonnet-4-5\b", listed, re.M)
    assert re.search(r"^by-page .* - *$", listed, re.M)
    read = operator.get("/api/v1/models/").json()["results"]
    assert {m["name"]: m["aliases"] for m in read} == expected
    page_text = page.get("/models/").content.decode()
    assert "also answers to Claude:Latest, claude-sonnet-4-5" in page_text
    assert 'name="aliases" value="Claude:Latest, claude-sonnet-4-5"' in page_text

    before = row_counts()
    with pytest.raises(CommandError, match="^alias 'gpt-5-codex' is already model by-cli's") as refused:
        cli("ctl", "model", "set", "by-page", "--alias", "gpt-5-codex,x")
    assert "\n" not in str(refused.value)
    with pytest.raises(CommandError, match="^alias 'by-api' is the name of a model"):
        cli("ctl", "model", "add", "new", "--file", f.sha256, "--engine", "llama.cpp", "--alias", "by-api")
    with pytest.raises(CommandError, match="^'gpt-5-codex' is an alias of model by-cli"):
        cli("ctl", "model", "add", "gpt-5-codex", "--file", f.sha256, "--engine", "llama.cpp")
    answer = operator.patch("/api/v1/models/by-page/", {"aliases": ["claude-sonnet-4-5"]}, format="json")
    assert answer.status_code == 409
    assert answer.json() == {"detail": "alias 'claude-sonnet-4-5' is already model by-api's; an alias names one model"}
    answer = operator.post("/api/v1/models/", {"name": "by-cli-2", "file": f.sha256, "engine": "llama.cpp",
                                               "aliases": ["by-cli"]}, format="json")
    assert answer.status_code == 409 and "is the name of a model" in answer.json()["detail"]
    for bad in (["has space"], ["a,b"], [""], "gpt-5", [5], ["x" * 129], [f"a{i}" for i in range(33)]):
        answer = operator.patch("/api/v1/models/by-page/", {"aliases": bad}, format="json")
        assert answer.status_code == 400 and "aliases" in answer.json(), (bad, answer.content)
    with pytest.raises(CommandError, match="^aliases: 0: invalid alias 'a b': use letters"):
        cli("ctl", "model", "set", "by-page", "--alias", "a b")
    said = page.post("/models/by-page/set/", {"aliases": "gpt-5-codex"}, HTTP_HX_REQUEST="true").content.decode()
    assert "alias &#x27;gpt-5-codex&#x27; is already model by-cli&#x27;s" in said
    said = page.post("/models/by-page/set/", {"aliases": "a b"}, HTTP_HX_REQUEST="true").content.decode()
    assert "invalid alias &#x27;a b&#x27;" in said
    assert row_counts() == before and aliases() == expected

    cli("ctl", "model", "set", "by-cli", "--alias", "")  # cleared, and the name free for another
    cli("ctl", "model", "set", "by-api", "--alias", "none")
    cli("ctl", "model", "set", "by-page", "--alias", "gpt-5-codex")
    assert aliases() == {"by-cli": [], "by-api": [], "by-page": ["gpt-5-codex"]}


def test_a_models_routing_is_set_the_same_way_everywhere(db, operator):
    """prefix for a new model, least-inflight on request, by the CLI, the REST API and the dashboard; an unknown
    policy is refused by each and changes nothing."""
    from django.core.management.base import CommandError

    from cluster.models import Model
    from tests.factories import make_file, row_counts

    f = make_file(name="tiny.gguf")
    page = session_for("operator")

    cli("ctl", "model", "add", "r-cli", "--file", f.sha256, "--engine", "llama.cpp")
    cli("ctl", "model", "add", "r-cli-li", "--file", f.sha256, "--engine", "llama.cpp", "--routing", "least-inflight")
    operator.post("/api/v1/models/", {"name": "r-api", "file": f.sha256, "engine": "llama.cpp"}, format="json")
    page.post("/models/add/", {"name": "r-page", "file": f.sha256, "engine": "llama.cpp", "routing": "least-inflight"})
    assert dict(Model.objects.values_list("name", "routing")) == {
        "r-cli": "prefix", "r-cli-li": "least-inflight", "r-api": "prefix", "r-page": "least-inflight"}

    assert "routing least-inflight" in cli("ctl", "model", "set", "r-cli", "--routing", "least-inflight")
    operator.patch("/api/v1/models/r-api/", {"routing": "least-inflight"}, format="json")
    page.post("/models/r-page/set/", {"routing": "prefix"})
    shown = {m["name"]: m["routing"] for m in json.loads(cli("ctl", "models", "--json"))}
    assert shown == {"r-cli": "least-inflight", "r-cli-li": "least-inflight", "r-api": "least-inflight", "r-page": "prefix"}
    assert re.search(r"^r-page .* prefix ", cli("ctl", "models"), re.M)
    listing = page.get("/models/").content.decode()
    assert "routed by prefix" in listing and '<option selected>prefix</option>' in listing

    before = row_counts()
    with pytest.raises(CommandError, match="--routing"):
        cli("ctl", "model", "set", "r-api", "--routing", "sticky")
    assert operator.patch("/api/v1/models/r-api/", {"routing": "sticky"}, format="json").status_code == 400
    said = page.post("/models/r-api/set/", {"routing": "sticky"}, HTTP_HX_REQUEST="true").content.decode()
    assert "routing is one of prefix, least-inflight, not &#x27;sticky&#x27;" in said
    assert row_counts() == before and Model.objects.get(name="r-api").routing == "least-inflight"


def test_how_an_answer_is_resumed_is_set_the_same_way_everywhere(db, operator):
    """resume_limit (2 unless set; 0: off) and stream_idle_timeout_seconds (30 unless set; a duration on the CLI and
    the page), by the CLI, the REST API and the dashboard, shown by each; a value out of range refused alike (one
    line, a DRF 400 naming the field, a form message), changing nothing."""
    from django.core.management.base import CommandError

    from cluster.models import Model
    from tests.factories import make_file, row_counts

    f = make_file(name="tiny.gguf")
    page = session_for("operator")

    def resuming():
        return {name: (limit, idle) for name, limit, idle in
                Model.objects.values_list("name", "resume_limit", "stream_idle_timeout_seconds")}

    cli("ctl", "model", "add", "by-cli", "--file", f.sha256, "--engine", "llama.cpp")
    cli("ctl", "model", "add", "by-cli-0", "--file", f.sha256, "--engine", "llama.cpp", "--resume-limit", "0",
        "--stream-idle-timeout", "2m")
    made = operator.post("/api/v1/models/", {"name": "by-api", "file": f.sha256, "engine": "llama.cpp"},
                         format="json").json()
    assert (made["resume_limit"], made["stream_idle_timeout_seconds"]) == (2, 30)
    page.post("/models/add/", {"name": "by-page", "file": f.sha256, "engine": "llama.cpp", "resume_limit": "5",
                               "stream_idle_timeout": "45s"})
    assert resuming() == {"by-cli": (2, 30), "by-cli-0": (0, 120), "by-api": (2, 30), "by-page": (5, 45)}

    said = cli("ctl", "model", "set", "by-cli", "--resume-limit", "10", "--stream-idle-timeout", "1h")
    assert said.rstrip().endswith("resume 10, idle 1h")
    changed = operator.patch("/api/v1/models/by-api/", {"resume_limit": 1}, format="json").json()
    assert (changed["resume_limit"], changed["stream_idle_timeout_seconds"]) == (1, 30)  # the other left as it is
    page.post("/models/by-page/set/", {"resume_limit": "0", "stream_idle_timeout": "1"})
    expected = {"by-cli": (10, 3600), "by-cli-0": (0, 120), "by-api": (1, 30), "by-page": (0, 1)}
    assert resuming() == expected
    shown = {m["name"]: (m["resume_limit"], m["stream_idle_timeout_seconds"])
             for m in json.loads(cli("ctl", "models", "--json"))}
    assert shown == expected
    read = operator.get("/api/v1/models/").json()["results"]
    assert {m["name"]: (m["resume_limit"], m["stream_idle_timeout_seconds"]) for m in read} == expected
    listed = cli("ctl", "models")
    assert "RESUME" in listed.splitlines()[0]
    assert re.search(r"^by-cli .* 10, idle 1h ", listed, re.M) and re.search(r"^by-cli-0 .* off, idle 2m ", listed, re.M)
    edited = [e.message for e in Event.objects.filter(kind="model.edited", subject="by-cli")]
    assert edited == ["model by-cli edited: resume_limit=10, stream_idle_timeout_seconds=3600"]
    listing = page.get("/models/").content.decode()
    assert "an answer resumed on another replica at most 1 time(s) (a stream silent 30s counts as failed)" in listing
    assert "an answer never resumed on another replica" in listing
    assert 'name="resume_limit" type="number" min="0" max="10"' in listing
    assert 'name="stream_idle_timeout" size="5" value="1h"' in listing

    before = row_counts()
    for flag, bad, said in (("--resume-limit", "11", "resume_limit"), ("--resume-limit", "-1", "resume_limit"),
                            ("--resume-limit", "two", "--resume-limit"),
                            ("--stream-idle-timeout", "0", "stream_idle_timeout_seconds"),
                            ("--stream-idle-timeout", "2h", "stream_idle_timeout_seconds"),
                            ("--stream-idle-timeout", "soon", "--stream-idle-timeout")):
        for command in (("set", "by-api"), ("add", "by-cli-bad", "--file", f.sha256, "--engine", "llama.cpp")):
            with pytest.raises(CommandError, match=said) as refused:
                cli("ctl", "model", *command, flag, bad)
            assert "\n" not in str(refused.value), (flag, bad)
    for field, bad in (("resume_limit", 11), ("resume_limit", -1), ("resume_limit", None), ("resume_limit", "x"),
                       ("stream_idle_timeout_seconds", 0), ("stream_idle_timeout_seconds", 3601),
                       ("stream_idle_timeout_seconds", True)):
        answer = operator.patch("/api/v1/models/by-api/", {field: bad, "max_tokens": 9}, format="json")
        assert answer.status_code == 400 and field in answer.json(), (field, bad)
        if bad is not None:
            answer = operator.post("/api/v1/models/", {"name": "by-api-bad", "file": f.sha256, "engine": "llama.cpp",
                                                       field: bad}, format="json")
            assert answer.status_code == 400 and field in answer.json(), (field, bad)
    said = page.post("/models/by-api/set/", {"resume_limit": "11"}, HTTP_HX_REQUEST="true").content.decode()
    assert "resume limit must be a whole number from 0 to 10, not 11" in said
    said = page.post("/models/by-api/set/", {"stream_idle_timeout": "2h", "max_tokens": "9"}, HTTP_HX_REQUEST="true")
    assert "stream idle timeout (seconds) must be a whole number from 1 to 3600, not 7200" in said.content.decode()
    said = page.post("/models/add/", {"name": "by-page-bad", "file": f.sha256, "engine": "llama.cpp",
                                      "stream_idle_timeout": "soon"}, HTTP_HX_REQUEST="true").content.decode()
    assert "stream idle timeout: not a duration" in said
    assert row_counts() == before and resuming() == expected
    assert Model.objects.get(name="by-api").max_tokens == 4096


def test_how_a_model_scales_is_shown_the_same_everywhere(db):
    from datetime import timedelta

    from django.core.management.base import CommandError

    from cluster.models import Demand

    model = make_model("lazy", min_replicas=0, max_replicas=3, idle_after_seconds=600)
    last = timezone.now() - timedelta(minutes=4)
    Demand.objects.create(model=model, replicas=1, last_request_at=last)
    make_replica(model, make_node("n1"), state=S.READY)
    idle_at = last + timedelta(minutes=10)

    # the CLI
    out = io.StringIO()
    call_command("llmgw", "ctl", "models", "--json", stdout=out)
    row = json.loads(out.getvalue())[0]["scaling"]  # the API's own representation
    assert (row["mode"], row["wanted"], row["min_replicas"], row["max_replicas"]) == ("on-demand", 1, 0, 3)
    assert row["idle_at"].replace("Z", "+00:00") == idle_at.isoformat()
    out = io.StringIO()
    call_command("llmgw", "ctl", "models", stdout=out)
    line = out.getvalue().splitlines()[1]
    assert "on-demand" in line and "1/1 (0-3)" in line and "4m ago" in line and "in 5m" in line

    # the REST API
    shown = session_for("viewer").get("/api/v1/models/lazy/").json()["scaling"]
    assert (shown["mode"], shown["wanted"], shown["max_replicas"]) == ("on-demand", 1, 3)
    assert shown["idle_at"].replace("Z", "+00:00") == idle_at.isoformat()

    # the dashboard
    page = session_for("viewer").get("/models/").content.decode()
    assert "on-demand 0–3" in page and "last request 4m ago" in page

    # and the CLI's own refusals are one line
    for args, said in ((["--idle-after", "10x"], "not a duration"),
                       (["--replicas", "2", "--min-replicas", "0", "--max-replicas", "2"], "either a fixed number")):
        with pytest.raises(CommandError, match=said):
            call_command("llmgw", "ctl", "model", "set", "lazy", *args, stdout=io.StringIO())


@pytest.mark.django_db
def test_the_default_engine_is_one_the_fleets_nodes_can_run():
    """A new model's engine unless told otherwise (the dashboard's Add a model form): what the quick start installs
    (xllamacpp), not the first name in the list (llama.cpp), which no node here has and whose model stays pending."""
    from cluster.models import EngineVersion

    engine_names = set(EngineVersion.objects.values_list("name", flat=True))
    assert {"llama.cpp", "xllamacpp", "vllm"} <= engine_names  # the engines a new cluster starts with
    make_node("laptop", facts={"engines": {"xllamacpp": "0.2.1"}})
    assert queries.default_engine().name == "xllamacpp"
    # a node that has gone away counts for less than one that is here now
    make_node("old", alive=False, facts={"engines": {"llama.cpp": "b4500"}})
    make_node("old-2", alive=False, facts={"engines": {"llama.cpp": "b4500"}})
    assert queries.default_engine().name == "xllamacpp"
    # a GPU engine counts only nodes with a GPU
    gpu = {"gpus": [{"index": 0, "name": "L4", "memory_bytes": 24 * GIB}]}
    for name in ("cpu-1", "cpu-2"):
        make_node(name, facts={"engines": {"vllm": "0.6"}})
    assert queries.default_engine().name == "xllamacpp"
    for name in ("gpu-1", "gpu-2"):
        make_node(name, facts={"engines": {"vllm": "0.6"}, **gpu})
    assert queries.default_engine().name == "vllm"


@pytest.mark.django_db
def test_the_default_engine_without_nodes_is_still_one():
    from cluster.models import EngineVersion

    assert queries.default_engine() is not None
    EngineVersion.objects.all().delete()
    assert queries.default_engine() is None


def test_every_door_shows_a_models_ready_wanted_range_and_last_request_alike(db):
    """`status` said `1/0 ready` for an autoscaled model, the Overview WANTED 0, `ctl models` `2/2 (1-3)`; LAST
    REQUEST showed a time for a model never called and "-" for a fixed one that served requests."""
    import time

    from cluster import inflight, operations
    from cluster.locks import redis_client
    from cluster.models import Demand
    from tests.factories import make_file

    node = make_node("n1")
    file = make_file("smol.gguf")
    auto = operations.add_model("auto", "test", file=file.sha256, engine="llama.cpp", min_replicas=1, max_replicas=3)
    Demand.objects.filter(model=auto).update(replicas=2)  # what its autoscaler wants now
    for _ in range(2):
        make_replica(auto, node, S.READY)
    fixed = operations.add_model("fixed", "test", file=file.sha256, engine="llama.cpp", replicas=2)
    make_replica(fixed, node, S.READY)
    asked = time.time() - 120  # the gateway served `fixed` two minutes ago; nobody asked for `auto`
    redis = redis_client()
    redis.delete(inflight.LAST_REQUEST)
    redis.hset(inflight.LAST_REQUEST, mapping={"fixed": f"{asked:.3f}"})

    def cli(*args):
        out = io.StringIO()
        call_command("llmgw", *args, stdout=out)
        return out.getvalue()

    # the CLI: status and ctl models
    status = cli("status")
    assert "  auto: 2/2 (1-3) ready" in status and "  fixed: 1/2 ready" in status
    rows = {line.split()[0]: line for line in cli("ctl", "models").splitlines()[1:]}
    assert "2/2 (1-3)" in rows["auto"] and "1/2" in rows["fixed"]
    last_request = cli("ctl", "models").splitlines()[0].index("LAST REQUEST")
    assert rows["auto"][last_request:].split()[0] == "-"
    assert rows["fixed"][last_request:].startswith("2m ago")

    # the REST API: status and models
    viewer = session_for("viewer")
    by_name = {m["name"]: m for m in viewer.get("/api/v1/status/").json()["models"]}
    assert [(by_name[n]["ready"], by_name[n]["wanted"], by_name[n]["replicas_text"]) for n in ("auto", "fixed")] == [
        (2, 2, "2/2 (1-3)"), (1, 2, "1/2")]
    assert by_name["auto"]["last_request_at"] is None and by_name["fixed"]["last_request_at"]
    models = {m["name"]: m["scaling"] for m in viewer.get("/api/v1/models/").json()["results"]}
    assert (models["auto"]["wanted"], models["auto"]["last_request_at"]) == (2, None)
    assert models["fixed"]["last_request_at"] == by_name["fixed"]["last_request_at"]

    # the dashboard: the Overview's WANTED and READY, the Models page's ready/wanted and last request
    overview = viewer.get("/").content.decode()
    cells = {name: re.sub(r"<[^>]+>", " ", row).split()
             for name, row in re.findall(r'#model-(\w+)">.*?</a>(.*?)</tr>', overview, re.S)}
    assert cells["auto"][:3] == ["2", "(1-3)", "2"] and cells["fixed"][:2] == ["2", "1"]
    page = viewer.get("/models/").content.decode()
    auto_card = page[page.index('id="model-auto"'):page.index('id="model-fixed"')]
    fixed_card = page[page.index('id="model-fixed"'):]
    assert '<span class="n">2</span>/2 ready' in auto_card and "last request" not in auto_card
    assert '<span class="n">1</span>/2 ready' in fixed_card and "last request 2m ago" in fixed_card


def test_cpu_cores_in_use_are_shown_as_placement_counts_them(db):
    from tests.factories import make_agent_node, make_profile

    node = make_agent_node("n1", cpu_count=4)
    wide = make_model("wide", profile=make_profile("wide", threads=2).name)
    make_replica(wide, node, S.READY, snapshot={"args": wide.profile.args(), "engine": wide.engine.spec()})
    make_replica(make_model("one"), node, S.STARTING, snapshot={"engine": {"kind": "llama.cpp"}})  # the default: 1
    make_replica(make_model("gone"), node, S.STOPPED, snapshot={"engine": {"kind": "llama.cpp"}})  # over: none
    assert queries.memory_in_use().cores(node.pk) == 3
    snapshot = reconciler.take_snapshot()
    fleet = planner.Planner(snapshot)
    fleet._nodes()
    fleet._replicas()
    assert fleet.fleet.by_id[node.pk].free_cpu == 1  # placement sees the same

    out = io.StringIO()
    call_command("llmgw", "ctl", "nodes", stdout=out)
    header, row = out.getvalue().splitlines()[:2]
    assert row[header.index("CPUS USED"):].startswith("3 / 4")
    shown = session_for("viewer").get("/api/v1/nodes/n1/").json()
    assert (shown["cpus"], shown["cpus_used"]) == (4, 3)
    assert "CPU cores 3 / 4 used" in session_for("viewer").get("/nodes/").content.decode()


def test_ctl_models_shows_the_requests_waiting_and_the_longest_wait(db):
    from cluster.locks import redis_client
    from tests.factories import put_waiting

    make_model("busy")
    make_model("quiet")
    tickets = put_waiting(redis_client(), "busy", 4.2, 0.3, lapsed=1)
    try:
        table = cli("ctl", "models").splitlines()
        shown = json.loads(cli("ctl", "models", "--json"))
    finally:
        redis_client().delete(*tickets)
    at = table[0].index("WAITING"), table[0].index("LONGEST WAIT")
    rows = {line.split()[0]: line for line in table[1:]}
    assert rows["busy"][at[0]:].split()[0] == "2" and re.fullmatch(r"4\.\ds", rows["busy"][at[1]:].split()[0])
    assert rows["quiet"][at[0]:].split()[:2] == ["-", "-"]
    queues = {m["name"]: m["queue"] for m in shown}
    assert queues["busy"]["waiting"] == 2 and queues["busy"]["queue_limit"] == 512
    assert queues["quiet"] == {"waiting": 0, "longest_wait_seconds": None, "queue_limit": 512, "max_wait_seconds": 120}
