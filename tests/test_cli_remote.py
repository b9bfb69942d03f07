"""`llmgw` from anywhere: every command that talks to the cluster is a client of the REST API, so the same command
prints the same thing on the control plane's host (the API in process) and from elsewhere (over HTTP, to a real
server on a socket: pytest-django's live server), and obeys the roles there.

The whole path with real processes (a wheel without the server part, `llmgw up`, nginx with TLS) is in
tests/integration/test_package.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import stat
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from cluster.models import ControlPlane, EngineVersion, Event, Model, Node, Profile
from tests.factories import make_control_plane, make_file, make_model, make_node, make_replica, make_user


@pytest.fixture(autouse=True)
def no_login(tmp_path, monkeypatch):
    """No stored login, server or token but what a test gives."""
    monkeypatch.setenv("LLMGW_CONFIG", str(tmp_path / "config" / "llmgw.json"))
    for name in ("LLMGW_SERVER", "LLMGW_TOKEN", "LLMGW_CA_CERT"):
        monkeypatch.delenv(name, raising=False)


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def server(live_server, transactional_db):
    """A real HTTP server of the API (the test database), and an admin's token for it."""
    _, token = make_user("admin", "root")
    return live_server.url, token


def remote(server, *args: str, token: str | None = None) -> str:
    url, admin = server
    return run("--server", url, "--token", token or admin, *args)


@pytest.fixture
def cluster(server):
    """A cluster to look at: nodes, a model with replicas, a key, events; every time far enough back that an
    age printed a moment later is the same."""
    old = timezone.now() - timedelta(hours=3)
    gpu = make_node("gpu-1", last_seen=old - timedelta(hours=1), connected=False,
                    facts={"gpus": [{"index": 0, "memory_bytes": 24 * 1024**3}], "engines": {"llama.cpp": "b1"}})
    cpu = make_node("cpu-1", memory_bytes=64 * 1024**3)
    Node.objects.filter(pk=cpu.pk).update(last_seen=timezone.now() + timedelta(seconds=5))
    file = make_file("smol.gguf")
    # what the migrations made (a transactional test's database is emptied after it)
    EngineVersion.objects.get_or_create(name="llama.cpp", defaults={"kind": "llama.cpp"})
    Profile.objects.get_or_create(name="default")
    model = make_model("smol", file=file, replicas=2)
    for node in (gpu, cpu):
        replica = make_replica(model, node)
        type(replica).objects.filter(pk=replica.pk).update(created_at=old)
    run("ctl", "keys", "create", "team", "--models", "smol", "--rpm", "60")
    return server


READS = [
    ["status"],
    ["status", "--json"],
    ["ctl", "nodes"],
    ["ctl", "nodes", "--json"],
    ["node", "list"],
    ["ctl", "models"],
    ["ctl", "models", "--json"],
    ["ctl", "replicas"],
    ["ctl", "replicas", "--all", "--json"],
    ["ctl", "replicas", "--model", "smol"],
    ["ctl", "profiles"],
    ["ctl", "engines", "--json"],
    ["ctl", "events", "--limit", "5"],
    ["ctl", "events", "--kind", "key.", "--json"],
    ["ctl", "keys", "list"],
    ["ctl", "usage"],
    ["ctl", "settings"],
    ["ctl", "engine-key", "show"],
    ["mirror", "list"],
    ["user", "list"],
    ["user", "list", "--json"],
]


@pytest.mark.parametrize("args", READS, ids=" ".join)
def test_what_a_command_shows_is_the_same_from_anywhere(cluster, args):
    assert remote(cluster, *args) == run(*args)


SECRET = re.compile(r"\b(lnt|llmgw|sk)[-_][A-Za-z0-9_-]{8,}|\b[0-9a-f]{40}\b|\b[0-9a-f]{64}\b|fingerprint [0-9a-f]+")


def same(local: str, far: str, mine: str, theirs: str) -> None:
    """Two runs of one change, on different objects: the same words but for the names and the secrets."""
    assert SECRET.sub("SECRET", far.replace(theirs, mine)) == SECRET.sub("SECRET", local), (local, far)


def test_what_a_change_prints_is_the_same_from_anywhere(cluster, tmp_path):
    def both(*args: str) -> None:
        """The command on the `-lcl` object here and on the `-rmt` object over HTTP."""
        local = run(*[a.replace("{}", "lcl") for a in args])
        far = remote(cluster, *[a.replace("{}", "rmt") for a in args])
        same(local, far, "lcl", "rmt")

    sha = Model.objects.get(name="smol").file.sha256
    agents = "http://llmgw.example:8000"
    both("node", "add", "n-{}", "--server", agents)
    both("node", "token", "n-{}", "--server", agents)
    both("ctl", "drain", "n-{}")
    both("ctl", "undrain", "n-{}")
    both("ctl", "engine", "add", "e-{}", "--kind", "llama.cpp", "--version", "b2")
    both("ctl", "engine", "add", "c-{}", "--kind", "command", "--command", "srv {port}", "--serves", "rerank,chat")
    both("ctl", "engine", "set", "c-{}", "--serves", "none")
    both("ctl", "profile", "add", "p-{}", "--threads", "2", "--extra", "--flash-attn on")
    both("ctl", "profile", "set", "p-{}", "--context-size", "8192")
    both("ctl", "model", "add", "m-{}", "--file", sha, "--engine", "e-{}", "--profile", "p-{}", "--replicas", "0")
    both("ctl", "model", "set", "m-{}", "--min-replicas", "0", "--max-replicas", "2", "--idle-after", "10m")
    both("ctl", "model", "set", "m-{}", "--queue-limit", "10", "--max-wait", "30s")
    assert [(m.queue_limit, m.max_wait_seconds) for m in Model.objects.filter(name__in=["m-lcl", "m-rmt"])] == [
        (10, 30), (10, 30)]
    both("ctl", "model", "set", "m-{}", "--resume-limit", "0", "--stream-idle-timeout", "90s")
    assert set(Model.objects.filter(name__in=["m-lcl", "m-rmt"]).values_list(
        "resume_limit", "stream_idle_timeout_seconds")) == {(0, 90)}
    both("ctl", "model", "set", "m-{}", "--queue-limit", "default")
    assert set(Model.objects.filter(name__in=["m-lcl", "m-rmt"]).values_list("queue_limit", "max_wait_seconds")) == {
        (None, 30)}
    both("ctl", "settings", "--queue-limit", "64", "--max-wait", "2m")
    both("ctl", "restart", "--model", "m-{}")
    both("ctl", "model", "remove", "m-{}")
    both("ctl", "keys", "create", "k-{}", "--rpm", "10", "--expires", "2099-01-01", "--priority", "batch")
    both("ctl", "keys", "set", "k-{}", "--priority", "interactive", "--rpm", "none", "--models", "smol",
         "--expires", "never")
    both("ctl", "keys", "revoke", "k-{}")
    both("ctl", "keys", "create", "b-{}", "--budget", "2M/day", "--max-concurrency", "4")
    both("ctl", "keys", "set", "b-{}", "--budget", "none")
    both("user", "add", "u-{}", "--role", "viewer")
    both("node", "remove", "n-{}")
    assert [run("stop"), run("start")] == [remote(cluster, "stop"), remote(cluster, "start")]
    assert run("ctl", "settings", "--drain-grace", "100") == remote(cluster, "ctl", "settings", "--drain-grace", "100")
    same(run("ctl", "engine-key", "rotate"), remote(cluster, "ctl", "engine-key", "rotate"), "", "")
    for name in ("lcl", "rmt"):
        (tmp_path / f"f-{name}.bin").write_bytes(name.encode() * 1000)
    same(run("mirror", "import", str(tmp_path / "f-lcl.bin")),
         remote(cluster, "mirror", "import", str(tmp_path / "f-rmt.bin")), "lcl", "rmt")
    # who did what: the host's own command is `cli`, a user over the API is `user:<name>`
    assert {e.actor for e in Event.objects.filter(subject__in=["n-lcl", "n-rmt"], kind="node.added")} == {"cli", "user:root"}


# the roles, as the API has them: a viewer looks, an operator changes the cluster, an admin also adds users

CHANGES = [
    (["stop"], "stop serving"),
    (["start"], "start serving"),
    (["restart"], "restart the system"),
    (["node", "add", "n9"], "add nodes"),
    (["node", "remove", "cpu-1"], "remove nodes"),
    (["node", "token", "cpu-1"], "give nodes new tokens"),
    (["ctl", "drain", "cpu-1"], "drain nodes"),
    (["ctl", "model", "set", "smol", "--replicas", "1"], "change models"),
    (["ctl", "model", "remove", "smol"], "remove models"),
    (["ctl", "restart", "--all"], "restart replicas"),
    (["ctl", "keys", "create", "k9"], "create keys"),
    (["ctl", "keys", "set", "team", "--priority", "batch"], "change keys"),
    (["ctl", "keys", "revoke", "team"], "revoke keys"),
    (["ctl", "profile", "add", "p9"], "add profiles"),
    (["ctl", "engine", "set", "llama.cpp", "--serves", "chat"], "change engines"),
    (["ctl", "settings", "--drain-grace", "5"], "change the cluster settings"),
    (["ctl", "engine-key", "rotate"], "rotate the engine key"),
    (["user", "add", "u9", "--role", "viewer"], "add users"),
    (["control-plane", "remove", "cp-2"], "remove control planes"),
    (["control-plane", "token", "cp-2"], "give control planes new tokens"),
]


@pytest.mark.parametrize("args, doing", CHANGES, ids=[" ".join(a) for a, _ in CHANGES])
def test_a_viewer_may_look_and_not_change(cluster, args, doing):
    _, viewer = make_user("viewer", "vera")
    events = Event.objects.count()
    assert remote(cluster, "ctl", "models", token=viewer) == run("ctl", "models")
    with pytest.raises(CommandError) as refused:
        remote(cluster, *args, token=viewer)
    assert str(refused.value) == f"your role (viewer) may not {doing}"
    assert Event.objects.count() == events


def test_control_planes_are_listed_removed_and_given_new_tokens_the_same_from_anywhere(cluster, this_control_plane):
    old = timezone.now() - timedelta(hours=3)
    held = make_file("held.gguf")
    for name in ("cp-lcl", "cp-rmt"):
        make_control_plane(name, seen_at=old, holds=(held,))
    ControlPlane.objects.filter(name="cp-1").update(seen_at=old, url="")
    for args in (["control-plane", "list"], ["control-plane", "list", "--json"]):
        assert remote(cluster, *args) == run(*args)
    assert run("control-plane", "list").splitlines() == [
        "NAME    URL                                  STATUS                 SEEN  FILES  FLAGS",
        "cp-1    - (the others cannot fetch from it)  not heard from lately  3h    0      this one",
        "cp-lcl  http://cp-lcl.test:8000              not heard from lately  3h    1",
        "cp-rmt  http://cp-rmt.test:8000              not heard from lately  3h    1"]
    said = run("control-plane", "token", "cp-lcl")
    assert said == ("control plane cp-lcl makes itself a new token when its worker runs again (not heard from for "
                    "3h); its old token works until then (`llmgw control-plane remove cp-lcl` cuts it off at once)\n")
    same(said, remote(cluster, "control-plane", "token", "cp-rmt"), "lcl", "rmt")
    assert "new token asked" in run("control-plane", "list")
    said = run("control-plane", "remove", "cp-lcl")
    assert said == "control plane cp-lcl removed: its token no longer opens /mirror; the 1 file(s) it held forgotten\n"
    assert remote(cluster, "control-plane", "remove", "cp-rmt") == (
        "control plane cp-rmt removed: its token no longer opens /mirror; the 1 file(s) it held forgotten; on no "
        "control plane now: held.gguf (import them again)\n")
    assert list(held.copies.all()) == [] and ControlPlane.objects.get().name == "cp-1"
    with pytest.raises(CommandError, match="cp-1 is the one this runs on"):
        run("control-plane", "remove", "cp-1")
    assert run("control-plane", "token", "cp-1") == (
        "control plane cp-1: a new token, written to its LLMGW_HOME; the old one no longer opens /mirror\n")


def test_adding_a_model_says_how_it_scales_in_plain_words(cluster):
    sha = Model.objects.get(name="smol").file.sha256
    said = run("ctl", "model", "add", "lazy", "--file", sha, "--engine", "llama.cpp", "--memory", "1GiB",
               "--min-replicas", "0", "--max-replicas", "2", "--idle-after", "10m")
    assert said == ("model lazy added: smol.gguf on llama.cpp, 1.0 GiB each; 0 to 2 replicas at 4 requests in flight "
                    "each (one replica fewer after 5m below that, none after 10m idle); watch with: "
                    "llmgw ctl replicas --model lazy\n")
    said = run("ctl", "model", "add", "fixed", "--file", sha, "--engine", "llama.cpp", "--memory", "1GiB")
    assert said.startswith("model fixed added: smol.gguf on llama.cpp, 1.0 GiB each; 1 replica(s); watch with: ")


def test_what_a_command_engine_serves_is_declared_in_one_line(cluster):
    said = run("ctl", "engine", "add", "ranker", "--kind", "command", "--command", "srv {port}", "--serves",
               "rerank,embeddings")
    assert said == "engine ranker (command, cpu) added, serving embeddings,rerank\n"
    assert run("ctl", "engine", "set", "ranker", "--serves", "chat,messages") == "engine ranker serves chat,messages\n"
    assert "ranker     command    -        cpu     chat,messages  srv {port}" in run("ctl", "engines")
    events = Event.objects.count()
    for args, error in (
        (["--serves", "chats"], "argument --serves: unknown capability 'chats' (known: chat, completions, embeddings, "
                                "messages, responses, rerank, images, audio)"),
        ([], "nothing to change: give --serves"),
    ):
        with pytest.raises(CommandError) as refused:
            run("ctl", "engine", "set", "ranker", *args)
        assert str(refused.value).endswith(error), str(refused.value)
    with pytest.raises(CommandError) as refused:
        remote(cluster, "ctl", "engine", "set", "llama.cpp", "--serves", "chat")
    assert str(refused.value) == ("only a command engine declares what it serves: a llama.cpp engine's models serve "
                                  "what its driver reads from their profile")
    assert Event.objects.count() == events


def test_a_key_for_a_model_that_does_not_exist_is_refused_in_one_line(cluster):
    from gateway.models import ApiKey

    keys, events = ApiKey.objects.count(), Event.objects.count()
    for command in (run, lambda *args: remote(cluster, *args)):
        with pytest.raises(CommandError) as refused:
            command("ctl", "keys", "create", "k", "--models", "smol", "nosuch")
        assert str(refused.value) == "no model named 'nosuch'"
    assert (ApiKey.objects.count(), Event.objects.count()) == (keys, events)


def test_a_key_is_changed_and_says_what_changed_in_one_line(cluster):
    from gateway.models import ApiKey

    said = run("ctl", "keys", "create", "nightly", "--priority", "batch", "--tpm", "100")
    assert said.startswith("key nightly created (priority batch); the key (shown once, keep it): sk-llmgw-")
    assert run("ctl", "keys", "set", "nightly", "--priority", "interactive", "--rpm", "60") == (
        "key nightly changed: priority interactive, rpm 60\n")
    said = run("ctl", "keys", "set", "nightly", "--tpm", "none", "--max-tokens", "32", "--models", "smol",
               "--expires", "2099-01-02T03:04:00Z")
    assert said == "key nightly changed: models smol, tpm none, max tokens 32, expires 2099-01-02 03:04\n"
    assert run("ctl", "keys", "set", "nightly", "--models", "all", "--expires", "never", "--max-tokens", "none") == (
        "key nightly changed: models all, max tokens none, expires never\n")
    key = ApiKey.objects.get(name="nightly")
    assert (key.priority, key.rpm, key.tpm, key.max_tokens, key.allowed_models, key.expires_at) == (
        "interactive", 60, None, None, [], None)
    listed = run("ctl", "keys", "list").splitlines()
    assert listed[0].split()[:5] == ["NAME", "PREFIX", "MODELS", "PRIORITY", "RPM"]
    assert [line.split()[3] for line in listed[1:]] == ["interactive", "standard"]  # nightly, team

    events = Event.objects.count()
    for args, error in (
        ([], "nothing to change: give --priority, --rpm, --tpm, --max-tokens, --models, --expires, --budget, "
             "--max-concurrency or --[no-]log-bodies"),
        (["--priority", "urgent"], "argument --priority: invalid choice: 'urgent' (choose from "),
        (["--rpm", "lots"], "argument --rpm: 'lots' is not a whole number or none"),
        (["--tpm", "0"], "argument --tpm: '0': at least 1"),
        (["--expires", "soon"], "--expires wants a date like 2026-12-31 or 2026-12-31T18:00:00Z, not 'soon'"),
        (["--expires", ""], "--expires wants a date like 2026-12-31 or 2026-12-31T18:00:00Z, or never"),
        (["--models", "smol,nosuch"], "no model named 'nosuch'"),
    ):
        with pytest.raises(CommandError) as refused:
            run("ctl", "keys", "set", "nightly", *args)
        assert error in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    run("ctl", "keys", "revoke", "nightly")
    events += 1
    for command in (run, lambda *args: remote(cluster, *args)):
        with pytest.raises(CommandError) as refused:
            command("ctl", "keys", "set", "nightly", "--rpm", "5")
        assert str(refused.value) == "key nightly is revoked: create a new one"
    assert Event.objects.count() == events


def test_a_keys_budget_and_concurrency_limit_are_set_and_listed_in_one_line_each(cluster):
    from gateway.models import ApiKey, Usage

    said = run("ctl", "keys", "create", "metered", "--budget", "2M/day", "--max-concurrency", "4")
    assert said.startswith("key metered created (budget 2M/day, max concurrency 4); the key (shown once, keep it): ")
    key = ApiKey.objects.get(name="metered")
    assert (key.budget_tokens, key.budget_period, key.max_concurrency) == (2_000_000, "day", 4)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    Usage.objects.create(key=key, model="smol", hour=hour, requests=3, prompt_tokens=100_000, completion_tokens=20_000)
    listed = run("ctl", "keys", "list").splitlines()
    assert re.match(r"NAME +PREFIX +MODELS +PRIORITY +RPM +TPM +MAX TOKENS +BUDGET +CONCURRENCY +BODIES +EXPIRES ",
                    listed[0])
    assert re.search(r" - +120K/2M day +4 +- +never +active ", listed[1]), listed  # metered
    assert re.search(r" - +- +- +never +active ", listed[2]), listed  # team: neither
    (shown,) = [k for k in json.loads(run("ctl", "keys", "list", "--json")) if k["name"] == "metered"]
    assert (shown["budget"]["spent"], shown["budget"]["tokens"], shown["max_concurrency"]) == (120_000, 2_000_000, 4)

    assert run("ctl", "keys", "set", "metered", "--budget", "500K/week", "--max-concurrency", "none") == (
        "key metered changed: max concurrency none, budget 500K/week\n")
    assert run("ctl", "keys", "set", "metered", "--budget", "none") == "key metered changed: budget none\n"
    key.refresh_from_db()
    assert (key.budget_tokens, key.budget_period, key.max_concurrency) == (None, "", None)
    events = Event.objects.count()
    for args, error in (
        (["--budget", "2M/year"], "argument --budget: a budget is TOKENS/PERIOD with PERIOD one of day, week, month, "
                                  "e.g. 2M/day, not '2M/year'"),
        (["--budget", "lots/day"], "argument --budget: a budget's tokens are a number (with K, M or G), not 'LOTS'"),
        (["--max-concurrency", "0"], "argument --max-concurrency: '0': at least 1"),
    ):
        for command in (run, lambda *a: remote(cluster, *a)):
            with pytest.raises(CommandError) as refused:
                command("ctl", "keys", "set", "metered", *args)
            assert str(refused.value).endswith(error) and "\n" not in str(refused.value), str(refused.value)
    with pytest.raises(CommandError) as refused:
        run("ctl", "keys", "create", "other", "--budget", "2M/year")
    assert str(refused.value).endswith("not '2M/year'")
    assert Event.objects.count() == events and not ApiKey.objects.filter(name="other").exists()


def test_a_keys_body_logging_is_turned_on_and_off_and_listed(cluster):
    from gateway.models import ApiKey

    said = run("ctl", "keys", "create", "logged", "--log-bodies")
    assert said.startswith("key logged created (bodies logged); the key (shown once, keep it): sk-llmgw-")
    assert ApiKey.objects.get(name="logged").log_bodies is True
    listed = run("ctl", "keys", "list").splitlines()
    assert re.search(r" +CONCURRENCY +BODIES +EXPIRES ", listed[0]), listed
    assert re.search(r" - +logged +never +active ", listed[1]), listed  # logged
    assert re.search(r" - +- +never +active ", listed[2]), listed  # team: not
    shown = {k["name"]: k["log_bodies"] for k in json.loads(remote(cluster, "ctl", "keys", "list", "--json"))}
    assert shown == {"logged": True, "team": False}

    assert remote(cluster, "ctl", "keys", "set", "logged", "--no-log-bodies") == "key logged changed: bodies not logged\n"
    assert ApiKey.objects.get(name="logged").log_bodies is False
    assert run("ctl", "keys", "set", "team", "--log-bodies", "--rpm", "5") == "key team changed: bodies logged, rpm 5\n"
    assert ApiKey.objects.get(name="team").log_bodies is True
    assert run("ctl", "keys", "set", "team", "--rpm", "6") == "key team changed: rpm 6\n"  # left out: it stays
    assert ApiKey.objects.get(name="team").log_bodies is True
    assert "bodies" not in run("ctl", "keys", "create", "plain").split(";")[0]
    assert ApiKey.objects.get(name="plain").log_bodies is False

    events = Event.objects.count()
    for args, error in (
        (["set", "team", "--log-bodies=no"], "argument --log-bodies/--no-log-bodies: ignored explicit argument 'no'"),
        (["create", "other", "--log-bodies=yes"], "argument --log-bodies: ignored explicit argument 'yes'"),
    ):
        with pytest.raises(CommandError) as refused:
            run("ctl", "keys", *args)
        assert str(refused.value).endswith(error) and "\n" not in str(refused.value), str(refused.value)
    assert Event.objects.count() == events and not ApiKey.objects.filter(name="other").exists()
    assert ApiKey.objects.get(name="team").log_bodies is True


@pytest.mark.integration  # a process of its own: this one has Django
def test_a_budget_is_parsed_and_shown_without_django():
    """`--budget` and `ctl keys list` use ground.units on a laptop too, whose install has no Django."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('django', 'celery', 'rest_framework', 'channels'): sys.modules[name] = None\n"
            "import llmgw\n"
            "from llmgw.cli.args import budget_arg\n"
            "from llmgw.cli.keys import _budget_shown\n"
            "budget = {'tokens': budget_arg('2M/day')[0], 'period': 'day', 'spent': 123456}\n"
            "print(_budget_shown(budget), _budget_shown(budget, spent=True))\n")
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this one's llmgw, first on the path
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=checkout, timeout=60)
    assert done.stdout == "2M/day 123K/2M day\n", done.stderr


def test_an_operator_changes_the_cluster_and_only_an_admin_adds_users_or_sees_the_engine_key(cluster):
    _, operator = make_user("operator", "otto")
    assert remote(cluster, "stop", token=operator).startswith("llmgw stopped")
    assert Event.objects.filter(kind="system.stopped", actor="user:otto").exists()
    with pytest.raises(CommandError, match=r"^your role \(operator\) may not add users$"):
        remote(cluster, "user", "add", "u9", "--role", "viewer", token=operator)
    with pytest.raises(CommandError, match=r"^your role \(operator\) may not do that: the engine key is shown to"):
        remote(cluster, "ctl", "engine-key", "show", token=operator)
    assert "user u9 added as viewer" in remote(cluster, "user", "add", "u9", "--role", "viewer")
    with pytest.raises(CommandError, match=r"^your role \(operator\) may not do that: users are listed to admins only$"):
        remote(cluster, "user", "list", token=operator)
    listed = remote(cluster, "user", "list")
    assert re.search(r"^u9 +viewer +no ", listed, re.M) and re.search(r"^otto +operator ", listed, re.M), listed


def test_a_wrong_token_a_dead_server_and_a_tls_error_are_one_line_each(cluster):
    url, _ = cluster
    with pytest.raises(CommandError) as wrong:
        remote(cluster, "status", token="not-a-token")
    assert str(wrong.value) == (f"the server at {url} did not take the token (Invalid token.): "
                                f"`llmgw login {url}` again, or check LLMGW_TOKEN")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(CommandError, match=rf"^cannot reach the llmgw server at {dead}: .*refused"):
        run("--server", dead, "--token", "t", "status")
    tls = url.replace("http://", "https://")  # the server speaks plain HTTP: the TLS handshake fails
    with pytest.raises(CommandError, match=rf"^TLS error talking to {tls}: "):
        run("--server", tls, "--token", "t", "status")
    with pytest.raises(CommandError, match=r"^no API token for http://"):
        run("--server", url, "status")
    with pytest.raises(CommandError, match=r"^a server is an http:// or https:// URL"):
        run("--server", "llmgw.example", "--token", "t", "status")


def test_the_server_and_token_come_from_the_flags_the_environment_or_the_login(cluster, monkeypatch, tmp_path):
    url, admin = cluster
    local = run("ctl", "nodes")
    monkeypatch.setenv("LLMGW_SERVER", url)
    with pytest.raises(CommandError, match="no API token"):
        run("ctl", "nodes")
    monkeypatch.setenv("LLMGW_TOKEN", admin)
    assert run("ctl", "nodes") == local
    with pytest.raises(CommandError, match="did not take the token"):
        run("ctl", "nodes", "--token", "wrong")  # after the command, for this one command
    monkeypatch.delenv("LLMGW_SERVER")
    monkeypatch.delenv("LLMGW_TOKEN")

    # login with a user and a password (read from stdin where it is not a terminal)
    make_user("operator", "olga")
    from django.contrib.auth.models import User

    user = User.objects.get(username="olga")
    user.set_password("a long password")
    user.save()
    monkeypatch.setattr("sys.stdin", io.StringIO("a long password\n"))
    said = run("login", url + "/", "--user", "olga")
    path = tmp_path / "config" / "llmgw.json"
    assert said == f"logged in to {url} as olga (operator); saved in {path}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text())["server"] == url
    assert run("ctl", "nodes") == local  # through the server, as olga
    with pytest.raises(CommandError, match=r"^your role \(operator\) may not add users$"):
        run("user", "add", "u9", "--role", "viewer")

    # a wrong password is one line, and is throttled as the dashboard's login is
    monkeypatch.setattr("sys.stdin", io.StringIO("wrong password\n"))
    with pytest.raises(CommandError, match=r"^wrong user name or password$"):
        run("login", url, "--user", "olga")

    # a token instead of a password; the stored token goes only to its own server
    assert run("login", url, "--token", admin).startswith(f"logged in to {url} as root (admin)")
    os.chmod(path, 0o644)
    with pytest.raises(CommandError, match=r"may be read by others \(mode 644\): chmod 600"):
        run("ctl", "nodes")
    os.chmod(path, 0o600)
    with pytest.raises(CommandError, match=r"^no API token for http://127.0.0.1:9"):
        run("--server", "http://127.0.0.1:9", "ctl", "nodes")

    assert run("logout") == f"logged out of {url}: {path} removed (the token itself still works until an admin " \
                            f"replaces it)\n"
    assert not path.exists()
    assert run("logout") == "not logged in: nothing stored\n"
    assert run("ctl", "nodes") == local  # this host's control plane again, in process


def test_events_follow_prints_what_happens_after_it_started(cluster):
    """`ctl events --follow` over the API: the events after the newest, as they come (the loop's one step)."""
    from llmgw.cli import client, events

    url, admin = cluster
    api = client.Api(url, admin)
    newest = events._newest(api)
    run("ctl", "profile", "add", "watched")
    out = io.StringIO()
    last = events.follow(api, newest, out, kind_prefix="profile.")
    assert last > newest and out.getvalue().count("\n") == 1 and "profile watched added" in out.getvalue()
    assert events.follow(api, last, io.StringIO()) == last


def test_the_choices_the_command_offers_are_the_servers():
    """The command tree is Django-free (a laptop's install), so it names the choices itself: they are the API's."""
    from cluster.operations import DEFAULT_MAX_CHOICES, DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_TOKENS, ROUTINGS
    from cluster.roles import ROLES
    from gateway.admission import CLASSES, DEFAULT_CLASS
    from llmgw.cli import args

    assert (args.ROUTINGS, args.ROLES, args.DEFAULT_MAX_TOKENS) == (ROUTINGS, ROLES, DEFAULT_MAX_TOKENS)
    assert (args.DEFAULT_MAX_LOGPROBS, args.DEFAULT_MAX_CHOICES) == (DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_CHOICES)
    assert (args.PRIORITIES, args.DEFAULT_PRIORITY) == (CLASSES, DEFAULT_CLASS)


def test_what_works_on_this_machine_says_so_when_a_server_is_configured(monkeypatch):
    from llmgw.cli.program import run as run_parsed

    seen = []
    monkeypatch.setenv("LLMGW_SERVER", "https://llmgw.example.com")
    err = io.StringIO()
    run_parsed({"command": "service", "func": lambda o, out: seen.append(o)}, io.StringIO(), err=err)
    assert err.getvalue() == ("note: `llmgw service` works on this machine, not on the server at "
                              "https://llmgw.example.com (LLMGW_SERVER)\n")
    assert seen and "api" not in seen[0]


def test_a_change_that_adds_many_replicas_at_once_needs_yes(cluster):
    """The typo that took a cluster down: `ctl model set chat --replicas 1000`. More than 8 replicas added at
    once is refused without --yes, in one line, changing nothing; the REST API takes it as given."""
    events = Event.objects.count()
    for where in (run, lambda *a: remote(cluster, *a)):
        with pytest.raises(CommandError) as refused:
            where("ctl", "model", "set", "smol", "--replicas", "1000")
        assert str(refused.value) == ("this adds up to 998 replicas at once (to 1000); more than 8 at once is "
                                      "confirmed first: pass --yes if you mean it")
        with pytest.raises(CommandError, match="adds up to 18 replicas at once .*pass --yes"):
            where("ctl", "model", "set", "smol", "--min-replicas", "1", "--max-replicas", "20")
        with pytest.raises(CommandError, match="adds up to 9 replicas at once .*pass --yes"):
            where("ctl", "model", "add", "big", "--file", "smol.gguf", "--engine", "llama.cpp", "--replicas", "9")
    assert Model.objects.get(name="smol").replicas == 2 and not Model.objects.filter(name="big").exists()
    assert Event.objects.count() == events

    assert "model smol: 10 replica(s)" in remote(cluster, "ctl", "model", "set", "smol", "--replicas", "10")  # 8 more
    assert "model smol: 100 replica(s)" in remote(cluster, "ctl", "model", "set", "smol", "--replicas", "100", "--yes")
    assert "model smol: 1 replica(s)" in run("ctl", "model", "set", "smol", "--replicas", "1")  # fewer: no question
    assert "model big added" in run("ctl", "model", "add", "big", "--file", "smol.gguf", "--engine", "llama.cpp",
                                    "--replicas", "9", "--yes")
    url, token = cluster
    import httpx

    answer = httpx.patch(f"{url}/api/v1/models/smol/", json={"replicas": 1000},
                         headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200 and Model.objects.get(name="smol").replicas == 1000


def test_usage_as_csv_is_the_same_from_anywhere(cluster):
    from gateway.models import ApiKey, Usage

    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    Usage.objects.create(key=ApiKey.objects.get(name="team"), model="smol", hour=hour, requests=2, prompt_tokens=30,
                         completion_tokens=4)
    far = remote(cluster, "ctl", "usage", "--csv")
    assert far == run("ctl", "usage", "--csv")
    assert far.splitlines()[1] == f"team,smol,{hour:%Y-%m-%dT%H}:00:00Z,2,30,4,0"
