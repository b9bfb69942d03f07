"""A model's rollout in the dashboard with Django's test client: the Models page's form starts one (or says what the
operation refused, changing nothing), the rollout page shows the canary and the current replicas side by side
with their figures against the bounds (a breach in red), Promote and Abort call the operations, and a viewer sees
no button and is refused one. Clicking it in Chromium: tests/dashboard/test_browser.py."""

import html

import pytest

from cluster import operations, queries
from cluster.models import Model, Rollout
from cluster.rollouts import Side
from tests.factories import make_file, make_model, make_node, make_profile, make_replica, row_counts

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def chat(db):
    """Model `chat` with two ready replicas on n1, and a profile `fast` to roll out."""
    node = make_node("n1")
    model = make_model(name="chat")
    make_profile("fast", context_size=8192)
    for _ in range(2):
        make_replica(model, node)
    return model


def watching(model, node_name: str = "n1", **figures) -> Rollout:
    """A rollout of `profile fast` watching: its canary ready on the node, both sides' figures as last judged."""
    from django.utils import timezone

    from cluster.models import Node

    rollout = operations.start_rollout(model.name, "user:alice", profile="fast", watch_seconds=600, min_requests=10)
    make_replica(model, Node.objects.get(name=node_name), rollout=rollout)
    canary = figures.get("canary", Side(requests=12, errors=0, timed=12, ttft_p50=110, ttft_p99=300, tpot_p50=10,
                                        tpot_p99=14))
    current = figures.get("current", Side(requests=30, errors=1, timed=29, ttft_p50=100, ttft_p99=250, tpot_p50=10,
                                          tpot_p99=12))
    Rollout.objects.filter(pk=rollout.pk).update(watching_since=timezone.now(), figures={
        "canary": canary.shown(), "current": current.shown(), "verdict": "watching: 540s of the window left"})
    rollout.refresh_from_db()
    return rollout


def test_the_form_starts_a_rollout_and_goes_to_its_page(op, chat):
    models = op.get("/models/").content.decode()
    assert "Roll out a change" in models and 'action="/models/chat/rollout/start/"' not in models
    assert 'hx-post="/models/chat/rollout/start/"' in models
    assert 'name="traffic" size="4" value="10"' in models and 'name="watch" size="5" value="10m"' in models
    response = op.post("/models/chat/rollout/start/", {"profile": "fast", "traffic": "20%", "shadow": "5", "watch": "5m",
                                                       "canary": "1", "min_requests": "", "max_error_rate": "2",
                                                       "max_ttft_ratio": "1.4x", "max_tpot_ratio": "", "file": "",
                                                       "engine": ""}, **HTMX)
    assert response.status_code == 200 and response["HX-Redirect"] == "/models/chat/rollout/"
    rollout = Rollout.objects.get(model=chat)
    assert (rollout.state, rollout.change, rollout.traffic, rollout.shadow, rollout.watch_seconds,
            rollout.max_error_rate, rollout.max_ttft_ratio, rollout.min_requests, rollout.max_tpot_ratio) == (
        "watching", {"profile": ["default", "fast"]}, 0.2, 0.05, 300, 0.02, 1.4, 50, 1.3)  # blank: the DEFAULTS
    assert rollout.actor.startswith("user:operator")
    page = op.get("/models/chat/rollout/").content.decode()
    assert "rollout of model chat started: profile default -&gt; fast" in page  # the message, on the next page
    assert "waiting for a canary replica to be ready" in page
    assert "takes 20% of new conversations and a copy of 5% of the others' requests" in page
    # without JavaScript: a redirect to the page; memory `auto`: estimated from the new file and profile
    Rollout.objects.all().delete()
    chat.memory_bytes = 2 * 1024**3
    chat.save()
    plain = op.post("/models/chat/rollout/start/", {"profile": "fast", "memory": "auto"})
    assert plain.status_code == 302 and plain["Location"] == "/models/chat/rollout/"
    assert Rollout.objects.get().change["memory"] == ["2.0 GiB", "estimated"]
    assert 'data-testid="rollout">rollout watching</a>' in op.get("/models/").content.decode()


@pytest.mark.parametrize("form, said", [
    ({}, "nothing to roll out"),
    ({"profile": "nope"}, "no profile named"),
    ({"profile": "fast", "traffic": "150"}, "traffic (a share of new conversations) must be from 0 to 1, not 1.5"),
    ({"profile": "fast", "traffic": "0", "shadow": "0%"}, "a canary with no traffic and no shadow would never be"),
    ({"profile": "fast", "watch": "soon"}, "watch: not a duration"),
    ({"profile": "fast", "canary": "0"}, "canary replicas must be"),
    ({"profile": "fast", "max_ttft_ratio": "0.5"}, "max TTFT ratio must be from 1 to 1000, not 0.5"),
    ({"profile": "fast", "max_error_rate": "lots"}, "max error rate %: 'lots' is not a number"),
    ({"profile": "fast", "memory": "lots"}, "memory: not a size: 'lots'"),
])
def test_bad_input_is_the_operations_message_and_changes_nothing(op, chat, form, said):
    before = row_counts()
    response = op.post("/models/chat/rollout/start/", form, **HTMX)
    assert response.status_code == 200 and "HX-Redirect" not in response
    body = html.unescape(response.content.decode())
    assert "msg error" in body and said in body, body[:600]
    assert row_counts() == before and not Rollout.objects.exists()


def test_one_at_a_time_is_the_operations_message(op, chat):
    watching(chat)
    body = op.post("/models/chat/rollout/start/", {"profile": "default"}, **HTMX).content.decode()
    assert "model chat has a rollout watching" in body and "one at a time" in body
    assert Rollout.objects.count() == 1


def test_the_page_shows_both_sides_their_figures_and_the_bounds(op, chat):
    rollout = watching(chat)
    canary = rollout.canaries.get()
    page = op.get("/models/chat/rollout/").content.decode()
    assert 'data-testid="rollout-state">watching</span> profile default -&gt; fast' in page
    assert "started by user:alice at " in page and "1 canary replica takes 10% of new conversations" in page
    assert "of the watch window left" in page and "So far: watching: 540s of the window left" in page
    canary_side, current_side = page.split('data-side="canary"')[1].split('data-side="current"')
    assert canary.name in canary_side and canary.name not in current_side
    assert current_side.count("<tr data-replica=") == 2 and "n1" in current_side
    assert 'data-figure="requests">12<' in canary_side and 'data-figure="requests">30<' in current_side
    assert 'data-figure="ttft">110 ms / 300 ms<' in canary_side
    assert 'data-figure="error_rate">3.33%<' in current_side
    assert "1.10x" in page and "of at most 1.5x" in page and "of at most 1%" in page  # TTFT ratio, its bound
    assert "breach" not in page and "over</span>" not in page
    assert 'hx-post="/models/chat/rollout/promote/"' in page and 'hx-post="/models/chat/rollout/abort/"' in page
    assert "hx-confirm=" in page
    part = op.get("/models/chat/rollout/", **HTMX).content.decode()
    assert "<nav" not in part and part.count('id="live"') == 1 and 'llmgw:rollout from:body' in part
    assert queries.rollout_shown(rollout)["ratios"] == {"ttft": 1.1, "tpot": 1.0}


def test_a_breached_bound_is_drawn_red(op, chat):
    watching(chat, canary=Side(requests=12, errors=0, timed=12, ttft_p50=400, tpot_p50=10),
             current=Side(requests=30, timed=30, ttft_p50=100, tpot_p50=10))
    page = op.get("/models/chat/rollout/").content.decode()
    assert 'class="gauge breached" data-gauge="TTFT ratio (p50)"' in page and "4.00x" in page
    assert 'class="num breach" data-figure="ttft"' in page
    assert page.count("breached") == 1  # the error rate and TPOT hold
    shown = queries.rollout_shown(Rollout.objects.get())
    assert shown["breached"] == {"error_rate": False, "ttft": True, "tpot": False}


def test_promote_and_abort(op, chat):
    watching(chat)
    body = op.post("/models/chat/rollout/promote/", **HTMX).content.decode()
    assert "rollout of model chat promoting" in body and 'data-testid="rollout-state">promoting<' in body
    assert 'hx-post="/models/chat/rollout/promote/"' not in body  # only while it watches
    assert Model.objects.get(name="chat").profile.name == "fast"
    assert 'hx-post="/models/chat/rollout/abort/"' in body  # while promoting: to go back
    back = op.post("/models/chat/rollout/abort/", **HTMX).content.decode()
    assert "rollout of model chat rolling back: the model goes back to its settings before" in back
    assert 'data-testid="rollout-state">rolling back<' in back and "aborted by user:operator" in back
    assert Model.objects.get(name="chat").profile.name == "default"
    again = op.post("/models/chat/rollout/abort/", **HTMX).content.decode()
    assert "msg error" in again and "only a rollout watching or promoting may be aborted" in again
    Rollout.objects.all().delete()
    Model.objects.filter(name="chat").update(profile=chat.profile)
    watching(chat)
    response = op.post("/models/chat/rollout/abort/", follow=True)  # without JavaScript: back to the page
    assert response.redirect_chain[-1][0] == "/models/chat/rollout/"
    body = response.content.decode()
    assert "rollout of model chat aborted" in body and 'data-testid="rollout-state">aborted<' in body
    assert "aborted by user:operator" in body


def test_a_model_without_a_rollout_says_so(op, chat):
    response = op.get("/models/chat/rollout/")
    assert response.status_code == 404 and "model chat has no rollout" in response.content.decode()
    assert "no model named" in op.get("/models/nope/rollout/").content.decode()
    assert "msg error" in op.post("/models/nope/rollout/promote/", **HTMX).content.decode()


def test_a_viewer_sees_the_rollout_but_no_button_and_a_forged_post_is_refused(look, chat):
    make_file(name="other.gguf")
    watching(chat)
    models = look.get("/models/").content.decode()
    assert "Roll out a change" not in models and 'href="/models/chat/rollout/"' in models
    assert models.count(">canary</a>") == 1 and ">rollout watching</a>" in models
    page = look.get("/models/chat/rollout/").content.decode()
    assert "watching" in page and 'data-side="canary"' in page and "hx-post" not in page
    before = row_counts()
    for url in ("/models/chat/rollout/start/", "/models/chat/rollout/promote/", "/models/chat/rollout/abort/"):
        response = look.post(url, {"profile": "default"}, **HTMX)
        assert response.status_code == 403 and b"needs the operator or admin role" in response.content, url
    assert row_counts() == before and Rollout.objects.get().state == "watching"
    assert look.get("/models/chat/rollout/promote/").status_code == 405
