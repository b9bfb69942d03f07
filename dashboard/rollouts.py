"""A model's rollout in the browser (cluster/operations/rollouts.py): the Models page's "Roll out a change" form
starts one and goes to its page; the page (`/models/<name>/rollout/`) shows it as `queries.rollout_shown` does for
every front door — its state, the change, the canary and the current replicas side by side with their figures
against the bounds — refreshes itself live, and has Promote and Abort while it watches.

The buttons are the dashboard's (dashboard/buttons.py): a viewer sees none and a forged POST from one is refused
with 403; what the operation refuses is the page's message, and nothing changes.
"""

from __future__ import annotations

import functools

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseClientRedirect

from cluster import operations, queries
from cluster.errors import NotFound
from cluster.models import Rollout
from dashboard.buttons import attempt, refusal
from dashboard.charts import Gauge
from dashboard.forms import RolloutStartForm, valid
from dashboard.views import actor_of, frame, partial, render_page


def _gauges(shown: dict) -> list[Gauge]:
    """The canary's figures against their bounds, each a bar (the bound at its middle; red once past it)."""
    canary = shown["figures"]["canary"] or {}
    ratios, breached = shown["ratios"], shown["breached"]
    return [
        Gauge("error rate", canary.get("error_rate"), shown["max_error_rate"], breached["error_rate"], percent=True),
        Gauge("TTFT ratio (p50)", ratios["ttft"], shown["max_ttft_ratio"], breached["ttft"]),
        Gauge("TPOT ratio (p50)", ratios["tpot"], shown["max_tpot_ratio"], breached["tpot"]),
    ]


def _page(request, name: str, status: int = 200) -> HttpResponse:
    """The rollout page, whole or its live partial (htmx); a model with no rollout is said so (404)."""
    context = {**frame(request, "models"), "name": name, "rollout": None}
    try:
        shown = queries.rollout_shown(operations.rollout_of(name))
        context.update(rollout=shown, gauges=_gauges(shown),
                       sides=[("canary", "Canary", shown["replicas"]["canary"], shown["figures"]["canary"]),
                              ("current", "Current replicas", shown["replicas"]["current"],
                               shown["figures"]["current"])])
    except NotFound as exc:
        context["missing"], status = str(exc), 404
    return render(request, "dashboard/_rollout.html" if partial(request) else "dashboard/rollout.html", context,
                  status=status)


@login_required
@require_GET
def rollout(request, name: str):
    return _page(request, name)


def _start(request, name: str) -> str:
    form = valid(RolloutStartForm(request.POST))
    started = operations.start_rollout(name, actor_of(request), **form.given())
    return f"rollout of model {name} started: {started.change_text()}"


@login_required
@require_POST
def rollout_start(request, name: str):
    """The Models page's form: started, to the rollout's page; refused, the message on the Models page."""
    if refused := refusal(request):
        return refused
    started, extra = attempt(request, _start, name)
    if started:
        where = reverse("dashboard:rollout", args=[name])
        return HttpResponseClientRedirect(where) if request.htmx else redirect(where)
    if request.htmx:
        return render_page(request, "models", extra)
    return redirect(reverse("dashboard:models"))


def _button(view):
    """Promote or Abort: the rollout's page again (its partial, with htmx) with the operation's message."""

    @functools.wraps(view)
    @login_required
    @require_POST
    def run(request, name: str):
        if refused := refusal(request):
            return refused
        attempt(request, view, name)
        return _page(request, name) if request.htmx else redirect(reverse("dashboard:rollout", args=[name]))

    return run


@_button
def rollout_promote(request, name: str) -> str:
    actor = actor_of(request)
    operations.promote_rollout(name, actor, f"promoted by {actor}")  # (as the REST API says it)
    return f"rollout of model {name} promoting: the model takes the new settings, its replicas replaced one at a time"


@_button
def rollout_abort(request, name: str) -> str:
    if operations.abort_rollout(name, actor_of(request)).state == Rollout.State.ROLLING_BACK:  # it was promoting
        return (f"rollout of model {name} rolling back: the model goes back to its settings before, its replicas on "
                "the new ones replaced one at a time")
    return f"rollout of model {name} aborted: its canary drains and stops; the model runs as it did"
