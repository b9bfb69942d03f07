"""The dashboard's pages and buttons with Django's test client: whole pages, htmx partials, every button calling
the same operation as the CLI and API, bad input as a message that changes nothing, and roles."""

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from cluster import operations, peers
from cluster.models import ClusterSettings, EngineVersion, Event, Model, Node, Replica
from dashboard.views import PAGES
from gateway import budgets
from gateway.models import ApiKey, Usage
from tests.factories import (
    make_control_plane,
    make_file,
    make_model,
    make_node,
    make_replica,
    row_counts,
    session_for,
)

HTMX = {"HTTP_HX_REQUEST": "true"}


def test_every_page_needs_a_login(db):
    client = Client()
    for page in PAGES:
        url = "/" if page == "overview" else f"/{page}/"
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/"), page


def test_login_with_a_wrong_password_says_so_and_a_right_one_lands_on_the_overview(db):
    operations.add_user("ada", "viewer", "test", password="correct-horse")
    client = Client()
    page = client.post("/login/", {"username": "ada", "password": "wrong-password"})
    assert page.status_code == 200 and b"Wrong user name or password" in page.content
    response = client.post("/login/", {"username": "ada", "password": "correct-horse"}, follow=True)
    assert response.status_code == 200
    assert b"Serving" in response.content and b"No models yet" in response.content


def test_every_page_renders_whole_and_as_a_partial_for_htmx(op):
    node = make_node("gpu-1", facts={"memory_total_bytes": 32 * 1024**3,
                                     "gpus": [{"index": 0, "name": "L4", "memory_bytes": 24 * 1024**3}]})
    model = make_model(name="chat")
    make_replica(model, node, gpu_index=0, memory_bytes=2 * 1024**3)
    make_replica(model, node, state=Replica.State.FAILED, log_tail="boom: out of memory")
    for page in PAGES:
        url = "/" if page == "overview" else f"/{page}/"
        whole = op.get(url)
        assert whole.status_code == 200, page
        assert b"<nav" in whole.content and b'id="live"' in whole.content, page
        part = op.get(url, **HTMX)
        assert part.status_code == 200, page
        assert b"<nav" not in part.content and part.content.count(b'id="live"') == 1, page
        # only the live region (and messages): the page's forms and toolbars stay as the operator left them
        assert part.content.decode().strip().endswith("</div>"), page
        for form_title in ("Add a model", "Add a node", "Create a key", "Upload a model file", "Restart selected"):
            assert form_title not in part.content.decode(), (page, form_title)
    nodes = op.get("/nodes/").content.decode()
    assert "GPU 0 L4" in nodes and "2.0 GiB used" in nodes
    replicas = op.get("/replicas/").content.decode()
    assert "boom: out of memory" in replicas  # a failed replica's engine log


def test_stop_and_start_buttons_call_the_operations_and_answer_with_the_partial_and_a_message(op):
    response = op.post("/system/stop/", **HTMX)
    assert response.status_code == 200
    body = response.content.decode()
    assert 'hx-swap-oob="true"' in body and "/v1/ answers 503 until Start" in body and "Stopped" in body
    assert ClusterSettings.load().serving_stopped
    assert Event.objects.filter(kind="system.stopped", actor__startswith="user:operator").exists()
    again = op.post("/system/stop/", **HTMX).content.decode()
    assert "llmgw is already stopped" in again and "msg error" in again
    op.post("/system/start/", **HTMX)
    assert not ClusterSettings.load().serving_stopped


def test_without_javascript_a_button_redirects_back_with_the_message(op):
    response = op.post("/system/stop/", follow=True)
    assert response.redirect_chain[-1][0] == "/"
    assert b"/v1/ answers 503 until Start" in response.content


def test_a_viewer_sees_no_buttons_and_a_forged_post_is_refused_changing_nothing(look):
    node = make_node("n1")
    model = make_model(name="chat")
    make_replica(model, node)
    for page in ("overview", "nodes", "models", "replicas", "keys", "settings", "profiles"):
        body = look.get("/" if page == "overview" else f"/{page}/").content.decode()
        assert "hx-post" not in body, page
    before = row_counts()
    for url in ("/system/stop/", "/nodes/n1/drain/", "/models/chat/restart/", "/replicas/restart/", "/keys/create/",
                "/settings/engine-key/rotate/", "/models/chat/remove/"):
        response = look.post(url, {"how": "all", "name": "k"}, **HTMX)
        assert response.status_code == 403, url
        assert b"needs the operator or admin role" in response.content
    assert row_counts() == before and not ClusterSettings.load().serving_stopped
    assert not Node.objects.get(name="n1").draining


def test_a_get_on_a_button_is_refused(op):
    assert op.get("/system/stop/").status_code == 405


def test_drain_and_undrain(op):
    node = make_node("n1")
    body = op.post("/nodes/n1/drain/", **HTMX).content.decode()
    assert "node n1 draining" in body and "drained" in body  # nothing on it: drained at once
    assert Node.objects.get(pk=node.pk).draining
    body = op.post("/nodes/n1/undrain/", **HTMX).content.decode()
    assert "takes new replicas again" in body and not Node.objects.get(pk=node.pk).draining
    assert "no node named" in op.post("/nodes/nope/drain/", **HTMX).content.decode()


def test_add_a_node_shows_the_wheel_to_install_and_the_agent_command_once(op):
    page = op.get("/nodes/").content.decode()  # what the README's fleet steps say: llmgw is on no package index
    assert "<code>python -m pip wheel --no-deps -w dist .</code>" in page
    assert "<code>pip install &quot;llmgw-0.1.0-py3-none-any.whl[xllamacpp]&quot;</code>" in page
    body = op.post("/nodes/add/", {"name": "gpu-9"}, **HTMX).content.decode()
    assert "install llmgw from the wheel built in the checkout (pip install &quot;llmgw-0.1.0-py3-none-any.whl" in body
    assert re.search(r"LLMGW_AGENT_TOKEN=lnt_\S+ llmgw agent --server http://testserver<", body)
    assert Node.objects.filter(name="gpu-9").exists()
    assert "lnt_" not in op.get("/nodes/").content.decode()


def test_a_node_gets_a_new_token_shown_once_and_the_old_one_stops_working(op, look):
    node, old = operations.add_node("gpu-8", "test")
    body = op.post("/nodes/gpu-8/token/", **HTMX).content.decode()
    assert "node gpu-8: a new token; the old one no longer works" in body
    (new,) = re.findall(r"LLMGW_AGENT_TOKEN=(lnt_\S+) llmgw agent --server http://testserver<", body)
    node.refresh_from_db()
    assert node.token_hash == Node.hash_token(new) != Node.hash_token(old)
    assert Event.objects.filter(kind="node.token_reset", subject="gpu-8", actor__startswith="user:").exists()
    assert "lnt_" not in op.get("/nodes/").content.decode()
    assert "no node named" in op.post("/nodes/nope/token/", **HTMX).content.decode()
    assert look.post("/nodes/gpu-8/token/", **HTMX).status_code == 403
    node.refresh_from_db()
    assert node.token_hash == Node.hash_token(new)


def test_add_edit_restart_and_remove_a_model(op):
    f = make_file(name="tiny.gguf")
    before = Model.objects.count()
    body = op.post("/models/add/", {"name": "chat", "file": f.sha256, "engine": "llama.cpp", "profile": "default",
                                    "replicas": "2", "memory": "1GiB", "nodes": "", "wait_seconds": ""}, **HTMX).content.decode()
    assert "model chat added" in body
    model = Model.objects.get(name="chat")
    assert model.replicas == 2 and model.memory_bytes == 1024**3 and Model.objects.count() == before + 1
    body = op.post("/models/chat/set/", {"replicas": "3", "wait_seconds": "45"}, **HTMX).content.decode()
    assert "model chat changed" in body
    model.refresh_from_db()
    assert (model.replicas, model.wait_seconds) == (3, 45)
    node = make_node("n1")
    make_replica(model, node)
    body = op.post("/models/chat/restart/", **HTMX).content.decode()
    assert "1 replica(s) queued for restart" in body and "restart queued" in body
    assert "already queued" in op.post("/models/chat/restart/", **HTMX).content.decode()
    body = op.post("/models/chat/remove/", **HTMX).content.decode()
    assert "removing" in body and Model.objects.get(name="chat").removing


def test_a_change_that_adds_many_replicas_at_once_is_confirmed_first(op):
    f = make_file(name="tiny.gguf")
    make_model(name="chat", replicas=2)
    before = row_counts()
    body = op.post("/models/chat/set/", {"replicas": "1000", "wait_seconds": "45"}, **HTMX).content.decode()
    assert "this adds up to 998 replicas at once (to 1000); more than 8 at once is confirmed first: confirm to go " \
           "ahead" in body
    assert row_counts() == before and Model.objects.get(name="chat").replicas == 2
    # the same form again, confirmed
    form = re.search(r'<form class="msg confirm"[^>]*hx-post="([^"]+)".*?</form>', body, re.S)
    assert form and form.group(1) == "/models/chat/set/"
    sent = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', form.group(0)))
    assert sent.pop("csrfmiddlewaretoken")  # (the form works without JavaScript too)
    assert sent == {"replicas": "1000", "wait_seconds": "45", "confirm": "yes"}
    body = op.post(form.group(1), sent, **HTMX).content.decode()
    assert "model chat changed" in body and Model.objects.get(name="chat").replicas == 1000

    form = {"name": "big", "file": f.sha256, "engine": "llama.cpp", "min_replicas": "0", "max_replicas": "50"}
    assert "confirm to go ahead" in op.post("/models/add/", form, **HTMX).content.decode()
    assert not Model.objects.filter(name="big").exists()
    # without JavaScript too: the page with the question, not a redirect
    page = op.post("/models/add/", form)
    assert page.status_code == 200 and 'name="confirm" value="yes"' in page.content.decode()
    assert "model big added" in op.post("/models/add/", {**form, "confirm": "yes"}, **HTMX).content.decode()
    assert "model chat changed" in op.post("/models/chat/set/", {"replicas": "3"}, **HTMX).content.decode()  # fewer


def test_an_on_demand_model_from_the_form(op):
    f = make_file(name="tiny.gguf")
    body = op.post("/models/add/", {"name": "lazy", "file": f.sha256, "engine": "llama.cpp", "replicas": "",
                                    "min_replicas": "0", "max_replicas": "2", "idle_after": "10m",
                                    "scale_down_delay": "90s", "target_inflight": "3"}, **HTMX).content.decode()
    assert ("model lazy added: 0 to 2 replicas at 3 requests in flight each (one replica fewer after 90s below that, "
            "none after 10m idle)") in body
    model = Model.objects.get(name="lazy")
    assert (model.mode, model.idle_after_seconds, model.scale_down_delay_seconds) == ("on-demand", 600, 90)
    page = op.get("/models/").content.decode()
    assert "on-demand 0–2" in page and 'name="idle_after" size="5" value="10m"' in page
    body = op.post("/models/lazy/set/", {"replicas": "1", "min_replicas": "", "max_replicas": ""}, **HTMX).content.decode()
    assert "model lazy changed" in body and Model.objects.get(name="lazy").mode == "fixed"


@pytest.mark.parametrize("form, said", [
    ({"name": "Bad Name!", "engine": "llama.cpp"}, "name"),
    ({"name": "ok", "engine": "llama.cpp", "replicas": "two"}, "is not a whole number"),
    ({"name": "ok", "engine": "llama.cpp", "memory": "lots"}, "memory: not a size"),
    ({"name": "ok", "engine": "nope"}, "engine"),
    ({"name": "ok", "engine": "llama.cpp", "min_replicas": "2", "max_replicas": "1"}, "is above max replicas"),
    ({"name": "ok", "engine": "llama.cpp", "replicas": "1", "min_replicas": "0", "max_replicas": "1"},
     "either a fixed number"),
    ({"name": "ok", "engine": "llama.cpp", "min_replicas": "0", "max_replicas": "1", "idle_after": "soon"},
     "idle after: not a duration"),
])
def test_bad_model_input_is_a_message_and_changes_nothing(op, form, said):
    f = make_file()
    before = row_counts()
    body = op.post("/models/add/", {"file": f.sha256, **form}, **HTMX).content.decode()
    assert "msg error" in body and said in body
    assert row_counts() == before


def test_restart_buttons_selected_stale_all(op):
    model = make_model(name="chat", replicas=3)
    node = make_node("n1")
    a, b, c = (make_replica(model, node) for _ in range(3))
    assert "select one or more replicas" in op.post("/replicas/restart/", {"how": "selected"}, **HTMX).content.decode()
    body = op.post("/replicas/restart/", {"how": "selected", "replica": [a.name, b.name]}, **HTMX).content.decode()
    assert "2 replica(s) queued" in body
    assert "no replica named" in op.post("/replicas/restart/", {"how": "selected", "replica": ["nope"]}, **HTMX).content.decode()
    body = op.post("/replicas/restart/", {"how": "stale"}, **HTMX).content.decode()
    assert "0 replica(s) queued" in body
    body = op.post("/replicas/restart/", {"how": "all"}, **HTMX).content.decode()
    assert "1 replica(s) queued" in body  # c; a and b are already queued
    assert set(Replica.objects.filter(restart="queued").values_list("name", flat=True)) == {a.name, b.name, c.name}


def test_keys_create_once_list_and_revoke(op):
    body = op.post("/keys/create/", {"name": "team-a", "rpm": "60"}, **HTMX).content.decode()
    assert "copy it now" in body and 'id="once-value"' in body
    secret = body.split('id="once-value">')[1].split("<")[0]
    assert secret.startswith("sk-") or len(secret) > 20
    listing = op.get("/keys/").content.decode()
    assert "team-a" in listing and secret not in listing
    assert "already" in op.post("/keys/create/", {"name": "team-a"}, **HTMX).content.decode()
    assert "no model named &#x27;nosuch&#x27;" in op.post("/keys/create/", {"name": "team-b", "models": "nosuch"},
                                                          **HTMX).content.decode()
    assert not ApiKey.objects.filter(name="team-b").exists()
    body = op.post("/keys/team-a/revoke/", **HTMX).content.decode()
    assert "key team-a revoked" in body and "revoked" in body


def keys_now() -> list:
    return list(ApiKey.objects.order_by("name").values_list(
        "name", "priority", "rpm", "tpm", "max_tokens", "allowed_models", "expires_at", "revoked_at", "budget_tokens",
        "budget_period", "max_concurrency", "log_bodies"))


def test_keys_create_with_a_priority_and_change_it(op):
    make_model("smol")
    page = op.get("/keys/").content.decode()
    assert "Change a key" in page and '<option selected>standard</option>' in page
    op.post("/keys/create/", {"name": "nightly", "priority": "batch", "rpm": "10"}, **HTMX)
    assert ApiKey.objects.get(name="nightly").priority == "batch"
    assert '<td class="priority">batch</td>' in op.get("/keys/", **HTMX).content.decode()

    form = {"name": "nightly", "priority": "interactive", "rpm": "none", "tpm": "500", "max_tokens": "",
            "models": "smol", "expires_days": "7"}
    body = op.post("/keys/set/", form, **HTMX).content.decode()
    assert "key nightly changed" in body and '<td class="priority">interactive</td>' in body
    key = ApiKey.objects.get(name="nightly")
    assert (key.priority, key.rpm, key.tpm, key.max_tokens, key.allowed_models) == ("interactive", None, 500, None,
                                                                                    ["smol"])
    assert key.expires_at is not None
    assert Event.objects.get(kind="key.edited", subject="nightly").actor.startswith("user:operator")
    op.post("/keys/set/", {"name": "nightly", "models": "all", "expires_days": "never"}, **HTMX)
    key.refresh_from_db()
    assert (key.allowed_models, key.expires_at, key.priority, key.tpm) == ([], None, "interactive", 500)


def test_a_keys_budget_and_concurrency_limit_from_the_forms(op):
    page = op.get("/keys/").content.decode()
    assert page.count('name="budget"') == 2 and page.count('name="max_concurrency"') == 2  # create and change
    body = op.post("/keys/create/", {"name": "metered", "budget": "2M/day", "max_concurrency": "4"},
                   **HTMX).content.decode()
    assert "copy it now" in body
    key = ApiKey.objects.get(name="metered")
    assert (key.budget_tokens, key.budget_period, key.max_concurrency) == (2_000_000, "day", 4)
    now = timezone.now()
    Usage.objects.create(key=key, model="smol", hour=now.replace(minute=0, second=0, microsecond=0), requests=2,
                         prompt_tokens=100_000, completion_tokens=20_000)
    Usage.objects.create(key=key, model="smol", hour=budgets.period_start("day", now) - timedelta(hours=1),
                         requests=9, prompt_tokens=900_000, completion_tokens=0)  # yesterday's: not this day's
    listing = op.get("/keys/", **HTMX).content.decode()
    row = re.search(r'<tr data-key="metered">.*?</tr>', listing, re.S).group(0)
    resets = budgets.period_end("day", now)
    assert f"120K of 2M this day, resets {resets:%Y-%m-%d} 00:00 UTC" in row
    assert 'style="width: 6.0%"' in row and '<td class="num concurrency">4</td>' in row

    # a blank field stays as it is; none clears
    op.post("/keys/set/", {"name": "metered", "budget": "", "max_concurrency": "", "rpm": "9"}, **HTMX)
    key.refresh_from_db()
    assert (key.budget_tokens, key.budget_period, key.max_concurrency, key.rpm) == (2_000_000, "day", 4, 9)
    body = op.post("/keys/set/", {"name": "metered", "budget": "1.5M/week", "max_concurrency": "none"},
                   **HTMX).content.decode()
    assert "key metered changed" in body and "of 1.5M this week" in body
    key.refresh_from_db()
    assert (key.budget_tokens, key.budget_period, key.max_concurrency) == (1_500_000, "week", None)
    assert "budget 1.5M/week" in Event.objects.filter(kind="key.edited").latest("id").message
    op.post("/keys/set/", {"name": "metered", "budget": "none"}, **HTMX)
    key.refresh_from_db()
    assert (key.budget_tokens, key.budget_period) == (None, "")
    op.post("/keys/create/", {"name": "free", "budget": "none"}, **HTMX)
    assert ApiKey.objects.get(name="free").budget_tokens is None


def test_a_keys_body_logging_from_the_forms_and_in_the_table(op):
    page = op.get("/keys/").content.decode()
    assert '<input type="checkbox" name="log_bodies" value="yes"> Log request and response bodies' in page  # create
    assert '<select name="log_bodies"><option value="">as it is</option>' in page  # change
    assert "copy it now" in op.post("/keys/create/", {"name": "logged", "log_bodies": "yes"}, **HTMX).content.decode()
    op.post("/keys/create/", {"name": "plain"}, **HTMX)  # the box unticked: not sent
    assert (ApiKey.objects.get(name="logged").log_bodies, ApiKey.objects.get(name="plain").log_bodies) == (True, False)
    assert Event.objects.get(kind="key.created", subject="logged").message.endswith("bodies logged")
    listing = op.get("/keys/", **HTMX).content.decode()
    assert "<th>Bodies</th>" in listing
    rows = dict(re.findall(r'<tr data-key="([a-z]+)">.*?<td class="bodies">(.*?)</td>', listing, re.S))
    assert rows == {"logged": "logged", "plain": "—"}

    body = op.post("/keys/set/", {"name": "logged", "log_bodies": "no"}, **HTMX).content.decode()
    assert "key logged changed" in body
    assert ApiKey.objects.get(name="logged").log_bodies is False
    assert Event.objects.filter(kind="key.edited").latest("id").message.endswith("bodies not logged")
    op.post("/keys/set/", {"name": "plain", "log_bodies": "yes"}, **HTMX)
    op.post("/keys/set/", {"name": "plain", "log_bodies": "", "rpm": "7"}, **HTMX)  # as it is
    assert (ApiKey.objects.get(name="plain").log_bodies, ApiKey.objects.get(name="plain").rpm) == (True, 7)
    before, events = keys_now(), Event.objects.count()
    body = op.post("/keys/create/", {"name": "other", "log_bodies": "maybe"}, **HTMX).content.decode()
    assert "msg error" in body and "log request and response bodies: yes or no, not &#x27;maybe&#x27;" in body
    assert (keys_now(), Event.objects.count()) == (before, events)


def test_a_key_with_a_bad_budget_is_not_created(op):
    before, events = keys_now(), Event.objects.count()
    body = op.post("/keys/create/", {"name": "metered", "budget": "2M/year"}, **HTMX).content.decode()
    assert "msg error" in body and "budget: a budget is TOKENS/PERIOD" in body
    body = op.post("/keys/create/", {"name": "metered", "max_concurrency": "0"}, **HTMX).content.decode()
    assert "msg error" in body and "max concurrency must be a whole number from 1" in body
    assert (keys_now(), Event.objects.count()) == (before, events)


@pytest.mark.parametrize("form, said", [
    ({"name": "nightly"}, "nothing to change"),
    ({"name": "nightly", "priority": "urgent"}, "priority is one of interactive, standard, batch"),
    ({"name": "nightly", "rpm": "lots"}, "requests per minute: &#x27;lots&#x27; is not a whole number"),
    ({"name": "nightly", "tpm": "0"}, "tokens per minute must be a whole number from 1"),
    ({"name": "nightly", "expires_days": "0"}, "expires in days must be a whole number from 1 to 36500, not 0"),
    ({"name": "nightly", "models": "nosuch", "priority": "batch"}, "no model named &#x27;nosuch&#x27;"),
    ({"name": "nope", "rpm": "5"}, "no key named &#x27;nope&#x27;"),
    ({"name": "gone", "rpm": "5"}, "key gone is revoked"),
    ({"name": "nightly", "budget": "2M/year"}, "budget: a budget is TOKENS/PERIOD with PERIOD one of day, week, month"),
    ({"name": "nightly", "budget": "lots/day", "rpm": "5"}, "tokens are a number (with K, M or G)"),
    ({"name": "nightly", "budget": "day"}, "budget: a budget is TOKENS/PERIOD"),
    ({"name": "nightly", "max_concurrency": "0"}, "max concurrency must be a whole number from 1"),
    ({"name": "nightly", "max_concurrency": "many"}, "max concurrency: &#x27;many&#x27; is not a whole number"),
    ({"name": "nightly", "log_bodies": "true"}, "log request and response bodies: yes or no, not &#x27;true&#x27;"),
    ({"name": "nightly", "log_bodies": "yes", "rpm": "0"}, "requests per minute must be a whole number from 1"),
    ({"name": "gone", "log_bodies": "yes"}, "key gone is revoked"),
])
def test_a_refused_key_change_is_a_message_and_changes_nothing(op, form, said):
    op.post("/keys/create/", {"name": "nightly", "rpm": "10"}, **HTMX)
    op.post("/keys/create/", {"name": "gone"}, **HTMX)
    op.post("/keys/gone/revoke/", **HTMX)
    before, events = keys_now(), Event.objects.count()
    body = op.post("/keys/set/", form, **HTMX).content.decode()
    assert "msg error" in body and said in body, body
    assert (keys_now(), Event.objects.count()) == (before, events)


def test_a_models_queue_bounds_and_the_requests_waiting(op):
    """The add and edit forms set a model's queue limit and max wait (blank or default: the cluster's); the card
    shows the requests waiting, the oldest's wait and the bounds in effect, in the live partial."""
    from cluster.locks import redis_client
    from tests.factories import put_waiting

    f = make_file(name="tiny.gguf")
    body = op.post("/models/add/", {"name": "chat", "file": f.sha256, "engine": "llama.cpp", "queue_limit": "",
                                    "max_wait": "90s"}, **HTMX).content.decode()
    assert "model chat added" in body
    model = Model.objects.get(name="chat")
    assert (model.queue_limit, model.max_wait_seconds) == (None, 90)
    assert "at most 512 waiting (default), each at most 90s" in body and "queue 0" not in body
    body = op.post("/models/chat/set/", {"queue_limit": "10", "max_wait": "default"}, **HTMX).content.decode()
    assert "model chat changed" in body
    model.refresh_from_db()
    assert (model.queue_limit, model.max_wait_seconds) == (10, None)
    assert 'name="queue_limit" type="number" min="1" max="100000" size="6" value="10"' in body
    before = row_counts()
    for bad, words in (({"queue_limit": "0"}, "queue limit must be a whole number from 1"),
                       ({"queue_limit": "many"}, "queue limit: &#x27;many&#x27; is not a whole number"),
                       ({"max_wait": "2h"}, "max wait (seconds) must be a whole number from 1 to 3600")):
        assert words in op.post("/models/chat/set/", bad, **HTMX).content.decode()
    assert row_counts() == before
    tickets = put_waiting(redis_client(), "chat", 4.2, 1.0, 0.5)
    try:
        page = op.get("/models/", **HTMX).content.decode()
    finally:
        redis_client().delete(*tickets)
    shown = re.search(r"queue 3 waiting, longest (\d+\.\d) s", page)
    assert shown and 4.2 <= float(shown.group(1)) < 10
    assert "at most 10 waiting, each at most 2m (default)" in page


def test_settings_and_engine_key_rotation(op):
    body = op.post("/settings/set/", {"drain_grace_seconds": "120", "reconcile_interval_seconds": "2"}, **HTMX).content.decode()
    assert "settings saved" in body
    cluster = ClusterSettings.load()
    assert (cluster.drain_grace_seconds, cluster.reconcile_interval_seconds) == (120, 2)
    assert "reconcile interval" in op.post("/settings/set/", {"reconcile_interval_seconds": "0"}, **HTMX).content.decode()
    assert ClusterSettings.load().reconcile_interval_seconds == 2
    body = op.post("/settings/set/", {"queue_limit": "64", "max_wait_seconds": "30"}, **HTMX).content.decode()
    assert "settings saved" in body and 'name="queue_limit" type="number" min="1" max="100000" value="64"' in body
    assert (ClusterSettings.load().queue_limit, ClusterSettings.load().max_wait_seconds) == (64, 30)
    assert "max wait" in op.post("/settings/set/", {"max_wait_seconds": "0"}, **HTMX).content.decode()
    assert ClusterSettings.load().max_wait_seconds == 30
    key = cluster.engine_key
    assert "engine key rotated" in op.post("/settings/engine-key/rotate/", **HTMX).content.decode()
    assert ClusterSettings.load().engine_key != key


def test_profiles_engines_mirror(op, tmp_path, settings):
    body = op.post("/profiles/add/", {"name": "long", "context_size": "8192", "extra_args": "--flash-attn on"},
                   **HTMX).content.decode()
    assert "profile long added" in body and "--flash-attn on" in body
    body = op.post("/profiles/set/", {"name": "long", "context_size": "16384"}, **HTMX).content.decode()
    assert "profile long changed" in body and "16384" in body
    assert "profile long removed" in op.post("/profiles/long/remove/", **HTMX).content.decode()
    body = op.post("/engines/add/", {"name": "mine", "kind": "command", "command": "{python} x.py --port {port}"},
                   **HTMX).content.decode()
    assert "engine mine added" in body
    body = op.post("/engines/add/", {"name": "ranker", "kind": "command", "command": "r {port}",
                                     "serves": ["rerank", "embeddings"]}, **HTMX).content.decode()
    assert "engine ranker added" in body and "embeddings, rerank" in body
    body = op.post("/engines/set/", {"name": "ranker", "serves": ["chat"]}, **HTMX).content.decode()
    assert "engine ranker serves chat" in body
    body = op.post("/engines/set/", {"name": "llama.cpp", "serves": ["chat"]}, **HTMX).content.decode()
    assert "only a command engine declares what it serves" in body
    assert EngineVersion.objects.get(name="llama.cpp").serves == []
    path = tmp_path / "m.bin"
    path.write_bytes(b"x" * 1000)
    body = op.post("/mirror/import/", {"path": str(path)}, **HTMX).content.decode()
    assert "must come from the import directories" in body  # as over the API: not any file the server can read
    settings.LLMGW_IMPORT_DIRS = [str(tmp_path)]
    body = op.post("/mirror/import/", {"path": str(path)}, **HTMX).content.decode()
    assert "m.bin imported: sha256" in body and "1000 B" in body
    assert "path: the model file" in op.post("/mirror/import/", {"path": ""}, **HTMX).content.decode()


def test_control_planes_on_the_mirror_page_are_removed_and_given_new_tokens_by_admins(op, this_control_plane):
    make_control_plane("cp-2", holds=(make_file("alone.gguf"),))
    admin = session_for("admin")
    page = admin.get("/mirror/").content.decode()
    assert "(this one)" in page and "/mirror/control-planes/cp-2/token/" in page
    assert "/mirror/control-planes/cp-1/remove/" in page
    assert "/mirror/control-planes/" not in op.get("/mirror/").content.decode()  # an operator sees no such button
    before = row_counts()
    assert op.post("/mirror/control-planes/cp-2/remove/", **HTMX).status_code == 403
    body = admin.post("/mirror/control-planes/cp-1/remove/", **HTMX).content.decode()
    assert "msg error" in body and "cp-1 is the one this runs on" in body and row_counts() == before
    body = admin.post("/mirror/control-planes/cp-2/token/", **HTMX).content.decode()
    assert "cp-2 makes itself a new token at its worker&#x27;s next heartbeat" in body and "(new token asked)" in body
    body = admin.post("/mirror/control-planes/cp-2/remove/", **HTMX).content.decode()
    assert "control plane cp-2 removed: its token no longer opens /mirror; on no control plane now: alone.gguf" in body
    assert not peers.is_peer("lcp_cp-2") and 'data-control-plane="cp-2"' not in body
    body = admin.post("/mirror/control-planes/cp-1/remove/", {"force": "1"}, **HTMX).content.decode()
    assert "control plane cp-1 removed" in body and not peers.is_peer(peers.token())


def test_events_filter(op):
    make_node("n1")
    operations.drain_node("n1", "test")
    body = op.get("/events/?kind=node.drain", **HTMX).content.decode()
    assert "node.drain" in body
    assert "No events match" in op.get("/events/?kind=nothing.like.this", **HTMX).content.decode()


def test_every_command_of_the_cli_has_a_button_and_an_endpoint():
    """The three doors: every command of the CLI's own tree (llmgw/cli/tree.py), not a hand-kept list, has a
    dashboard button (a URL name here) and an API endpoint in dashboard/commands.py, or is one that runs on this
    machine by its nature (dashboard.commands.LOCAL, with the reason). A new command with neither fails."""
    from django.urls import NoReverseMatch, resolve, reverse

    from dashboard.commands import COMMANDS, LOCAL
    from llmgw.cli import tree

    commands = cli_commands()
    assert set(LOCAL) == set(tree.LOCAL), "the commands that run on this machine are the ones the CLI runs there"
    assert all(why for why in LOCAL.values())
    local = {c for c in commands if c.split()[0] in LOCAL}
    missing = set(commands) - local - set(COMMANDS)
    assert not missing, f"commands with no button or endpoint in dashboard/commands.py: {sorted(missing)}"
    assert not set(COMMANDS) - set(commands), "dashboard/commands.py names a command the CLI does not have"
    for command, (button, endpoint) in COMMANDS.items():
        try:
            reverse(f"dashboard:{button}")
        except NoReverseMatch:
            reverse(f"dashboard:{button}", args=["x"])
        method, path = endpoint.split()
        assert method in ("GET", "POST", "PATCH", "DELETE"), command
        match = resolve(path.replace("{name}", "x"))
        assert match.url_name != "gateway", command
        actions = getattr(match.func, "actions", None)  # a viewset's route: the methods it answers
        assert actions is None or method.lower() in actions, (command, method)


def test_the_table_of_buttons_lists_every_command():
    from pathlib import Path

    from dashboard.commands import COMMANDS

    table = (Path(__file__).resolve().parents[2] / "docs" / "dashboard.md").read_text()
    for command in COMMANDS:
        assert f"| `{command}` |" in table, f"docs/dashboard.md's table of buttons lacks {command}"


def test_upload_a_model_file(op):
    from django.core.files.uploadedfile import SimpleUploadedFile

    body = op.post("/mirror/upload/", {"file": SimpleUploadedFile("weights.bin", b"w" * 5000), "name": ""},
                   **HTMX).content.decode()
    assert "weights.bin uploaded: sha256" in body and "4.9 KiB" in body
    assert "choose a model file" in op.post("/mirror/upload/", {}, **HTMX).content.decode()


def test_the_system_restart_button_queues_it_once(op):
    from cluster.locks import redis_client
    from cluster.system import LOCK

    body = op.post("/system/restart/", **HTMX).content.decode()
    assert "system restart queued" in body
    lock = redis_client().lock(LOCK, timeout=30)
    assert lock.acquire(blocking=False)
    try:
        assert "already running" in op.post("/system/restart/", **HTMX).content.decode()
    finally:
        lock.release()


@pytest.mark.parametrize("url, form", [
    ("/keys/create/", {"name": "k", "expires_days": "99999999999"}),
    ("/mirror/import/", {"path": "/tmp/a\x00b"}),
    ("/models/add/", {"name": "m", "file": "\x00", "engine": "llama.cpp"}),
    ("/settings/set/", {"drain_grace_seconds": "1" * 40}),
])
def test_odd_input_is_a_message_never_a_500(op, url, form):
    before = row_counts()
    response = op.post(url, form, **HTMX)
    assert response.status_code == 200
    assert "msg error" in response.content.decode()
    assert row_counts() == before


def cli_commands() -> list[str]:
    """Every leaf of the `llmgw` command tree, e.g. "ctl model add", from the CLI's own parser; a command whose
    actions are optional (`agent`, `agent stop-engines`) is itself one too."""
    import argparse

    from llmgw.cli.tree import build

    parser = argparse.ArgumentParser()
    build(parser)

    def walk(p, prefix):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                if not a.required and prefix:
                    yield " ".join(prefix)
                for name, sub in a.choices.items():
                    yield from walk(sub, [*prefix, name])
                return
        yield " ".join(prefix)

    return list(walk(parser, []))


def test_the_add_model_form_offers_an_engine_the_nodes_have(op):
    make_node("laptop", facts={"engines": {"xllamacpp": "0.2.1"}})
    body = op.get("/models/").content.decode()
    engine = re.search(r'<select name="engine".*?</select>', body, re.S).group(0)
    assert '<option selected>xllamacpp</option>' in engine, engine
    assert engine.count("selected") == 1


def test_an_admin_lists_and_adds_users_on_the_users_page(db):
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    admin = session_for("admin")
    operations.add_user("carol", "viewer", "test", password="correct-horse")
    page = admin.get("/users/").content.decode()
    assert 'data-page="users"' in page  # in the nav
    assert re.search(r'<tr data-user="carol">.*?viewer.*?</tr>', page, re.S)
    body = admin.post("/users/add/", {"name": "dave", "role": "operator", "password": "long-enough"}, **HTMX).content.decode()
    assert "user dave added as operator" in body and 'data-user="dave"' in body
    token = re.search(r'<code id="once-value">([^<]+)</code>', body).group(1)
    assert Token.objects.get(user__username="dave").key == token  # shown once, here
    assert User.objects.get(username="dave").check_password("long-enough")
    assert Event.objects.filter(kind="user.added", subject="dave", actor__startswith="user:admin").exists()
    # bad input: a message, nothing changed
    before = row_counts()
    for form, words in (({"name": "bad name", "role": "viewer"}, "invalid user name"),
                        ({"name": "erin", "role": "owner"}, "role is one of admin, operator, viewer, not &#x27;owner&#x27;"),
                        ({"name": "erin", "role": "viewer", "password": "short"}, "at least 8 characters"),
                        ({"name": "Carol", "role": "viewer"}, "already exists")):
        answer = admin.post("/users/add/", form, **HTMX).content.decode()
        assert "msg error" in answer and words in answer, form
    assert row_counts() == before


def test_only_an_admin_sees_users_or_adds_one(op, look):
    for client in (op, look):
        page = client.get("/users/").content.decode()
        assert 'data-page="users"' not in page and "admins only" in page and "<table" not in page
        before = row_counts()
        response = client.post("/users/add/", {"name": "mallory", "role": "admin"}, **HTMX)
        assert response.status_code == 403 and row_counts() == before
