"""The browser dashboard: every page renders whole on a normal request and only its partial on an htmx one.

Every button is a POST (with CSRF) whose input its form reads and checks (dashboard/forms.py: an invalid one is
its errors as the message, nothing changed) and that calls the same function in `cluster/operations.py` as the CLI
and the REST API, then answers with the page's updated partial and a message (htmx), or redirects back to the page
with the message (no JavaScript). A viewer sees no button that would be refused, and a forged POST from one
is refused with 403 and changes nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, OuterRef, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from cluster import operations, peers, queries
from cluster.clients import agents_url
from cluster.models import ClusterSettings, EngineVersion, Event, Model, ModelFile, Profile, Replica, Rollout
from cluster.operations import OperationError
from cluster.roles import ROLES, WRITE_ROLES, role_of
from dashboard import usage_charts
from dashboard.buttons import ConfirmFirst, attempt, refusal
from dashboard.forms import (
    EngineAddForm,
    EngineSetForm,
    EventsFilterForm,
    ForceForm,
    FormError,
    KeyCreateForm,
    KeySetForm,
    MirrorImportForm,
    MirrorUploadForm,
    ModelAddForm,
    ModelSetForm,
    NodeAddForm,
    ProfileAddForm,
    ProfileSetForm,
    ReplicasRestartForm,
    RequestsFilterForm,
    RolloutStartForm,
    SettingsForm,
    UsageFilterForm,
    UserAddForm,
    valid,
)
from gateway import budgets, records, timeline
from gateway import operations as gateway_operations
from gateway.admission import CLASSES, DEFAULT_CLASS
from gateway.models import ApiKey, RequestRecord
from ground.facts import BUILD_WHEEL, INSTALL_WHEEL

PAGES = ("overview", "nodes", "models", "replicas", "profiles", "engines", "mirror", "keys", "usage", "requests",
         "users", "events", "settings")
ADMIN_PAGES = frozenset({"users"})  # in the nav of admins only; anyone else is told so on the page


def actor_of(request) -> str:
    return f"user:{request.user.username}"


# What each page shows


def _overview(request) -> dict:
    from cluster.locks import redis_client
    from dashboard.charts import traffic_charts
    from gateway.accounting import first_chunk_percentiles, traffic

    try:
        redis = redis_client()
        charts = traffic_charts(traffic(redis, 60))
        first_chunk = first_chunk_percentiles(redis)
    except Exception:  # Redis away: the page still shows the cluster
        charts, first_chunk = [], None
    status = queries.cluster_status()
    counts = status["replicas"]  # running replicas by state
    states = [(s, counts.get(s, 0)) for s in (Replica.State.PENDING, Replica.State.DOWNLOADING, Replica.State.STARTING,
                                                 Replica.State.READY, Replica.State.DRAINING, Replica.State.STOPPING)]
    return {"status": status, "states": states, "models_total": len(status["models"]), "charts": charts,
            "ttft": first_chunk and {"count": first_chunk["count"], "p50": first_chunk[0.5], "p95": first_chunk[0.95]},
            "failed_recently": Replica.objects.filter(
                state=Replica.State.FAILED, state_changed_at__gte=timezone.now() - timedelta(hours=1)).count()}


@dataclass
class Bar:
    """Memory as a bar: used by replicas, free, and what the agent does not offer (reserved)."""

    total: int
    used: int
    reserved: int = 0

    @property
    def free(self) -> int:
        return max(self.total - self.used - self.reserved, 0)

    def pct(self, part: int) -> float:
        return round(100 * part / self.total, 1) if self.total else 0.0

    @property
    def used_pct(self) -> float:
        return self.pct(self.used)

    @property
    def reserved_pct(self) -> float:
        return self.pct(self.reserved)


def _nodes(request) -> dict:
    now = timezone.now()
    nodes = list(queries.nodes_with_counts())
    used = queries.memory_in_use(nodes)
    rows = []
    for node in nodes:
        total = int(node.facts.get("memory_total_bytes") or node.memory_bytes)
        offered = node.memory_bytes
        gpu_used = used.gpus(node.pk, len(node.gpus))
        gpus = [{"index": g.get("index", i), "name": g.get("name", ""),
                 "bar": Bar(int(g.get("memory_bytes") or 0), gpu_used[i])}
                for i, g in enumerate(node.gpus)]
        rows.append({
            "node": node, "alive": node.is_alive(now), "drain": node.drain_state(node.replica_count) or "",
            "memory": Bar(total, used.ram(node.pk), max(total - offered, 0)), "gpus": gpus,
            "cpus": node.cpus, "cpus_used": used.cores(node.pk),
        })
    server = agents_url(request)
    return {"rows": rows, "server": server, "build_wheel": BUILD_WHEEL, "install_wheel": INSTALL_WHEEL}


@dataclass
class ModelShown:
    """A model's card: the model, its replicas not over, and its scaling and queue as every door shows them."""

    model: Model
    live: list[Replica]
    scaling: dict[str, Any]
    queue: dict[str, Any]


def _models(request) -> dict:
    last_rollout = Rollout.objects.filter(model=OuterRef("pk")).values("state")[:1]  # its last one's state
    models = list(queries.models_with_counts().annotate(rollout_state=Subquery(last_rollout)))
    replicas: dict[int, list[Replica]] = {}
    for r in Replica.objects.exclude(state__in=Replica.TERMINAL).select_related("node").defer("log_tail").order_by("name"):
        replicas.setdefault(r.model_id, []).append(r)
    asked = queries.last_requests()
    waiting, cluster = queries.queues([m.name for m in models]), queries.read_settings()
    return {
        "cluster": cluster,
        "models": [ModelShown(m, replicas.get(m.pk, []), queries.scaling_shown(m, asked),
                              queries.queue_shown(m, waiting, cluster)) for m in models],
        "files": ModelFile.objects.order_by("name"),
        "engines": EngineVersion.objects.order_by("name"),
        "default_engine": getattr(queries.default_engine(), "name", None),
        "profiles": Profile.objects.order_by("name"),
        "routings": Model.Routing.values,
        "rollout_defaults": RolloutStartForm.defaults(),
    }


@dataclass
class ReplicaShown:
    replica: Replica
    stale: str | None  # why it no longer matches what it would start with now


def _replicas(request) -> dict:
    show_over = request.GET.get("over") == "1"
    rows = queries.replicas_listed(include_over=show_over).order_by("model__name", "name")
    cluster = ClusterSettings.load()
    out = [ReplicaShown(r, operations.staleness(r, r.model, cluster)) for r in rows]
    return {"replicas": out, "show_over": show_over,
            "any_stale": any(row.stale for row in out if row.replica.state not in Replica.TERMINAL)}


def _profiles(request) -> dict:
    return {"profiles": Profile.objects.annotate(used=Count("models")).order_by("name")}


def _engines(request) -> dict:
    from ground.engines import CAPABILITIES, DRIVERS

    return {"engines": EngineVersion.objects.annotate(used=Count("models")).order_by("name"), "kinds": sorted(DRIVERS),
            "devices": EngineVersion.Device.choices, "capabilities": CAPABILITIES}


def _mirror(request) -> dict:
    planes = list(peers.listed())
    for plane in planes:
        plane.alive, plane.this = peers.alive(plane), peers.is_this(plane)
    files = ModelFile.objects.annotate(used=Count("models")).order_by("name").prefetch_related("copies__control_plane")
    return {"files": files, "planes": planes}


def _budget_shown(key, now) -> dict | None:
    """Spend against the budget, in words and as a bar: `120K of 2M this day, resets 2026-12-04 00:00 UTC`."""
    budget = budgets.status(key, now)
    if budget is None:
        return None
    text = (f"{budgets.about(budget['spent'])} of {budgets.shown(budget['tokens'])} this {budget['period']}, "
            f"resets {budget['resets_at']:%Y-%m-%d %H:%M} UTC")  # period_end's, in UTC
    return {"text": text, "bar": Bar(budget["tokens"], min(budget["spent"], budget["tokens"]))}


@dataclass
class KeyShown:
    """A key's row: the key, its last day's requests and tokens, and its budget as a bar (None: no budget)."""

    key: ApiKey
    used: dict[str, int]
    budget: dict[str, Any] | None


def _keys(request) -> dict:
    now = timezone.now()
    keys = list(budgets.with_spent(ApiKey.objects.order_by("name"), now))
    since = now - timedelta(days=1)
    usage: dict[str, dict[str, int]] = {}
    for row in gateway_operations.usage_report(since=since):
        u = usage.setdefault(row["key"], {"requests": 0, "tokens": 0})
        u["requests"] += row["requests"]
        u["tokens"] += row["prompt_tokens"] + row["completion_tokens"]
    shown = [KeyShown(k, usage.get(k.name, {"requests": 0, "tokens": 0}), _budget_shown(k, now)) for k in keys]
    return {"keys": shown, "models": Model.objects.order_by("name").values_list("name", flat=True),
            "priorities": CLASSES, "default_priority": DEFAULT_CLASS}


def _usage_filters(request) -> tuple[str, str, str, str]:
    """The Usage page's filters (by, key, model) and what was wrong with them ("": nothing; that filter dropped)."""
    form = UsageFilterForm(request.GET)
    problem = "" if form.is_valid() else form.problem()
    given = form.cleaned_data  # the fields that were valid
    return given.get("by") or "hour", given.get("key", ""), given.get("model", ""), problem


def _usage(request) -> dict:
    """Tokens per key and per model, requests and errors, per hour (the last 48) or day (the last 30), as plots;
    each key's spend of its budget."""
    by, key, model, problem = _usage_filters(request)
    if problem:
        messages.error(request, problem)
    now = timezone.now()
    shown = usage_charts.window(by, now)
    try:
        rows = gateway_operations.usage_report(key=key or None, model=model or None, since=shown.since, by=by,
                                               limit=None)
    except OperationError as exc:  # a key that does not exist
        messages.error(request, str(exc))
        rows = []
    with_budget = ApiKey.objects.filter(revoked_at__isnull=True, budget_tokens__isnull=False).order_by("name")
    if key:
        with_budget = with_budget.filter(name=key)
    spend = [usage_charts.Budget(k.name, b["spent"], b["tokens"], b["period"], b["resets_at"])
             for k in budgets.with_spent(with_budget, now) if (b := budgets.status(k, now))]
    plots = usage_charts.usage_plots(shown, rows, records.errors_per(by, shown.since, key, model), spend)
    models = set(Model.objects.values_list("name", flat=True)) | {str(r["model"]) for r in rows} | ({model} - {""})
    return {"plots": plots, "budgeted": any(p.name == "budgets" for p in plots), "by": by, "key": key,
            "model": model, "hours": usage_charts.HOURS,
            "days": usage_charts.DAYS, "keys": ApiKey.objects.order_by("name").values_list("name", flat=True),
            "models": sorted(models)}


@login_required
@require_GET
def usage_csv(request):
    """What the Usage page plots, as rows: the API's usage as CSV (`/api/v1/usage/?format=csv`), a download."""
    by, key, model, problem = _usage_filters(request)
    if problem:
        return HttpResponseBadRequest(problem, content_type="text/plain")
    since = usage_charts.window(by, timezone.now()).since
    try:
        rows = gateway_operations.usage_report(key=key or None, model=model or None, since=since, by=by)
    except OperationError as exc:
        return HttpResponse(str(exc), status=404, content_type="text/plain")
    response = HttpResponse(gateway_operations.usage_csv(rows), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="llmgw-usage-by-{by}-from-{since:%Y-%m-%d}.csv"'
    return response


def _users(request) -> dict:
    if role_of(request.user) != "admin":
        return {"users": None}
    return {"users": queries.users_listed(), "roles": ROLES}


def _events(request) -> dict:
    form = EventsFilterForm(request.GET)
    if not form.is_valid():  # a NUL, which no database column holds: that filter is dropped, and said so
        messages.error(request, form.problem())
    kind, subject = form.cleaned_data.get("kind", ""), form.cleaned_data.get("subject", "")
    rows = Event.objects.order_by("-created_at", "-id")
    if kind:
        rows = rows.filter(kind__startswith=kind)
    if subject:
        rows = rows.filter(subject__icontains=subject)
    # each with the requests it broke, when it is a replica's failure (as their records say), or those it made
    # resume elsewhere (as its Event says)
    shown = [(e, records.broken_by(e.subject, e.created_at, 10) if e.kind == "replica.failed" else [],
              e.data.get("requests", []) if e.kind == "replica.broke_off" and isinstance(e.data, dict) else [])
             for e in rows[:200]]
    return {"events": shown, "kind": kind, "subject": subject}


def _requests(request) -> dict:
    """The requests through /v1/, newest first (the last 200 that pass the filters), and one shown whole."""
    form = RequestsFilterForm(request.GET)
    if not form.is_valid():  # a NUL, which no database column holds: that filter is dropped, and said so
        messages.error(request, form.problem())
    given = {name: form.cleaned_data.get(name, "") for name in ("key", "model", "status", "slower_than", "id")}
    resumed = bool(form.cleaned_data.get("resumed"))
    try:
        rows = list(records.listed(given["key"], given["model"], given["status"] or None,
                                   given["slower_than"] or None, resumed="true" if resumed else None)[:200])
    except records.FilterError as exc:
        messages.error(request, f"{exc.name.replace('_', ' ')}: {exc.message}")
        rows = []
    shown = records.listed().filter(request_id=given["id"]).first() if given["id"] else None
    if given["id"] and shown is None:
        messages.error(request, f"no request with id {given['id'][:128]!r} is on record")
    return {"requests": rows, "shown": shown, "resumed": resumed, **given, **(_request_shown(shown) if shown is not None else {})}


PICTURE_LEFT, PICTURE_WIDTH, PICTURE_ROW = 260, 720, 24  # the timeline's picture: its label column, bars, rows


@dataclass
class PhaseBar:
    phase: timeline.Phase
    x: float
    width: float
    y: int


def _request_shown(r: RequestRecord) -> dict:
    """A request's page: its timeline in words and as a picture (where its time went), why its replica, and the
    Events of the replicas it was sent to around its time."""
    total = max(r.total_ms, 1.0)
    bars = [PhaseBar(p, PICTURE_LEFT + p.start_ms / total * PICTURE_WIDTH,
                max(2.0, (p.end_ms - p.start_ms) / total * PICTURE_WIDTH), 8 + i * PICTURE_ROW)
            for i, p in enumerate(timeline.phases(r))]
    replicas = {t[0] for t in r.tries if isinstance(t, list) and t} | ({r.replica} if r.replica else set())
    window = (r.at - timedelta(minutes=10), r.at + timedelta(milliseconds=r.total_ms) + timedelta(minutes=10))
    events = (Event.objects.filter(subject__in=replicas, created_at__range=window).order_by("-created_at", "-id")[:20]
              if replicas else [])
    return {"steps": timeline.timeline(r), "bars": bars, "why": timeline.why(r.route), "replica_events": events,
            "replicas_of": sorted(replicas), "engine_figures": timeline.engine_figures(r),
            "picture_height": 16 + len(bars) * PICTURE_ROW, "picture_left": PICTURE_LEFT}


def _settings(request) -> dict:
    cluster = ClusterSettings.load()
    return {"cluster": cluster, "fingerprint": ClusterSettings.fingerprint(cluster.engine_key)}


CONTEXT = {
    "overview": _overview, "nodes": _nodes, "models": _models, "replicas": _replicas, "profiles": _profiles,
    "engines": _engines, "mirror": _mirror, "keys": _keys, "usage": _usage, "requests": _requests, "users": _users,
    "events": _events, "settings": _settings,
}


def frame(request, page: str) -> dict:
    """What every page's frame shows: the nav (`page` marked), and what the user's role may do."""
    role = role_of(request.user)
    shown = [p for p in PAGES if p not in ADMIN_PAGES or role == "admin"]
    return {"page": page, "pages": shown, "can_change": role in WRITE_ROLES, "is_admin": role == "admin", "role": role}


def partial(request) -> bool:
    """Whether to answer with the page's live partial alone (an htmx request), not the whole page."""
    return bool(request.htmx and not request.htmx.boosted)


def render_page(request, page: str, extra: dict | None = None, status: int = 200) -> HttpResponse:
    context = {**frame(request, page), **CONTEXT[page](request), **(extra or {})}
    return render(request, f"dashboard/_{page}.html" if partial(request) else f"dashboard/{page}.html", context,
                  status=status)


@login_required
def page(request, page: str = "overview"):
    return render_page(request, page)


# Buttons


def action(page: str, admin: bool = False):
    """A POST that changes the cluster: operator or admin only (admin only, with `admin`); OperationError becomes
    an error message and nothing changes. The view returns a success message, or a (message, extra context) pair."""

    def wrap(view):
        @functools.wraps(view)
        @login_required
        @require_POST
        def run(request, *args, **kwargs):
            if refused := refusal(request, admin):
                return refused
            _, extra = attempt(request, view, *args, **kwargs)
            if request.htmx:
                return render_page(request, page, extra)
            if extra.get("once") or extra.get("confirm"):  # a secret shown once, a form to confirm: render
                return render_page(request, page, extra)
            return redirect(reverse("dashboard:" + page))

        return run

    return wrap


def _confirmed(request: HttpRequest, form: ModelSetForm, name: str | None, values: dict[str, Any]) -> None:
    why = operations.confirmation_needed(name, values)
    if why and not form.confirmed:
        raise ConfirmFirst(why, request)


@action("overview")
def system_stop(request):
    operations.stop_serving(actor_of(request))
    return "llmgw is stopped: every model goes to zero replicas; /v1/ answers 503 until Start"


@action("overview")
def system_start(request):
    operations.start_serving(actor_of(request))
    return "llmgw is serving again: every model is placed as it asks"


@action("overview")
def system_restart(request):
    from cluster.system import queue_restart

    queue_restart(actor_of(request))
    return "system restart queued: every agent, then web, beat and worker restart; engines keep serving (see Events)"


@action("nodes")
def node_add(request):
    form = valid(NodeAddForm(request.POST))
    node, token = operations.add_node(form.cleaned_data["name"], actor_of(request))
    server = agents_url(request)
    command = operations.agent_command(server, token)
    return (f"node {node.name} added; on that machine, install llmgw from the wheel built in the checkout "
            f"({INSTALL_WHEEL}) and start its agent with the command below (the token is shown once)"), {
        "once": {"label": f"agent command for {node.name}", "value": command}}


@action("nodes")
def node_token(request, name: str):
    node, token = operations.reset_node_token(name, actor_of(request))
    server = agents_url(request)
    return f"node {node.name}: a new token; the old one no longer works (start its agent again with the command below)", {
        "once": {"label": f"agent command for {node.name}", "value": operations.agent_command(server, token)}}


@action("nodes")
def node_remove(request, name: str):
    form = valid(ForceForm(request.POST))
    operations.remove_node(name, actor_of(request), force=form.cleaned_data["force"])
    return f"node {name} removed"


@action("nodes")
def node_drain(request, name: str):
    form = valid(ForceForm(request.POST))
    node = operations.drain_node(name, actor_of(request), force=form.cleaned_data["force"])
    return f"node {node.name} draining: its replicas move elsewhere, one at a time per model"


@action("nodes")
def node_undrain(request, name: str):
    operations.undrain_node(name, actor_of(request))
    return f"node {name} takes new replicas again"


@action("models")
def model_add(request):
    form = valid(ModelAddForm(request.POST))
    values = form.given()
    _confirmed(request, form, None, values)
    model = operations.add_model(form.cleaned_data["name"], actor_of(request), file=form.cleaned_data["file"],
                                 engine=values.pop("engine", ""), **values)
    return f"model {model.name} added: {model.scaling_text()}"


@action("models")
def model_set(request, name: str):
    form = valid(ModelSetForm(request.POST))
    values = form.given()
    if not values:
        raise FormError("nothing to change")
    _confirmed(request, form, name, values)
    operations.set_model(name, actor_of(request), **values)
    return f"model {name} changed"


@action("models")
def model_remove(request, name: str):
    operations.remove_model(name, actor_of(request))
    return f"model {name} removing: its replicas drain and stop"


def _queued(result: operations.RestartQueued) -> str:
    said = f"{len(result)} replica(s) queued for restart"
    if result.skipped:
        said += "; " + "; ".join(f"{n}: {why}" for n, why in sorted(result.skipped.items()))
    return said


@action("models")
def model_restart(request, name: str):
    return _queued(operations.restart_replicas(actor_of(request), models=[name]))


@action("replicas")
def replicas_restart(request):
    form = valid(ReplicasRestartForm(request.POST))
    how = form.cleaned_data["how"]
    if how == "all":
        result = operations.restart_replicas(actor_of(request), all=True)
    elif how == "stale":
        result = operations.restart_replicas(actor_of(request), stale=True)
    else:
        chosen = form.cleaned_data["replica"]
        if not chosen:
            raise FormError("select one or more replicas to restart")
        result = operations.restart_replicas(actor_of(request), replicas=chosen)
    return _queued(result)


@action("profiles")
def profile_add(request):
    form = valid(ProfileAddForm(request.POST))
    profile = operations.add_profile(form.cleaned_data["name"], actor_of(request), **form.given())
    return f"profile {profile.name} added"


@action("profiles")
def profile_set(request):
    form = valid(ProfileSetForm(request.POST))
    name, values = form.cleaned_data["name"], form.given()
    if not values:
        raise FormError("nothing to change")
    operations.set_profile(name, actor_of(request), **values)
    return f"profile {name} changed: its replicas show stale until restarted (Replicas: Restart stale)"


@action("profiles")
def profile_remove(request, name: str):
    operations.remove_profile(name, actor_of(request))
    return f"profile {name} removed"


@action("engines")
def engine_add(request):
    form = valid(EngineAddForm(request.POST))
    given = form.cleaned_data
    engine = operations.add_engine(given["name"], given["kind"], actor_of(request), version=given["version"],
                                   device=given["device"], binary=given["binary"], command=given["command"],
                                   serves=given["serves"])
    return f"engine {engine.name} added"


@action("engines")
def engine_set(request):
    form = valid(EngineSetForm(request.POST))
    engine = operations.set_engine(form.cleaned_data["name"], actor_of(request), serves=form.cleaned_data["serves"])
    return f"engine {engine.name} serves {', '.join(engine.serves) or 'what a request asks (nothing declared)'}"


@action("mirror")
def mirror_import(request):
    form = valid(MirrorImportForm(request.POST))
    model_file, created = operations.import_model_file(form.cleaned_data["path"], actor_of(request),
                                                       name=form.cleaned_data["name"] or None)
    return f"{model_file.name} {'imported' if created else 'already in the mirror'}: sha256 {model_file.sha256}"


@action("mirror")
def mirror_upload(request):
    form = valid(MirrorUploadForm(request.POST, request.FILES))
    model_file, created = operations.import_uploaded_file(form.cleaned_data["file"], actor_of(request),
                                                          name=form.cleaned_data["name"] or None)
    return f"{model_file.name} {'uploaded' if created else 'already in the mirror'}: sha256 {model_file.sha256}"


@action("mirror", admin=True)
def control_plane_remove(request, name: str):
    form = valid(ForceForm(request.POST))
    removal = operations.remove_control_plane(name, actor_of(request), force=form.cleaned_data["force"])
    orphaned = f"; on no control plane now: {', '.join(removal.orphaned)}" if removal.orphaned else ""
    return f"control plane {name} removed: its token no longer opens /mirror{orphaned}"


@action("mirror", admin=True)
def control_plane_token(request, name: str):
    if operations.rotate_control_plane_token(name, actor_of(request)).now:
        return f"control plane {name}: a new token; the old one no longer opens /mirror"
    return f"control plane {name} makes itself a new token at its worker's next heartbeat; its old one works until then"


@action("keys")
def key_create(request):
    form = valid(KeyCreateForm(request.POST))
    key, secret = gateway_operations.create_key(form.cleaned_data["name"], actor_of(request), **form.changes())
    return f"key {key.name} created; copy it now, it is not shown again", {
        "once": {"label": f"key {key.name}", "value": secret}}


@action("keys")
def key_set(request):
    form = valid(KeySetForm(request.POST))
    values = form.changes()
    if not values:
        raise FormError("nothing to change: fill in what to change")
    gateway_operations.set_key(form.cleaned_data["name"], actor_of(request), **values)
    return f"key {form.cleaned_data['name']} changed"


@action("keys")
def key_revoke(request, name: str):
    gateway_operations.revoke_key(name, actor_of(request))
    return f"key {name} revoked"


@action("users", admin=True)
def user_add(request):
    form = valid(UserAddForm(request.POST))
    password = form.cleaned_data["password"]
    user, token = operations.add_user(form.cleaned_data["name"], form.cleaned_data["role"], actor_of(request),
                                      password=password)
    said = f"user {user.username} added as {role_of(user)}; copy its API token now, it is not shown again"
    if not password:
        said += " (no password: it may use the API, not log in here)"
    return said, {"once": {"label": f"API token for {user.username}", "value": token}}


@action("settings")
def engine_key_rotate(request):
    operations.rotate_engine_key(actor_of(request))
    return "engine key rotated: running replicas keep the old key until restarted (Replicas: Restart stale)"


@action("settings")
def engine_key_show(request):
    if role_of(request.user) != "admin":
        raise OperationError("the engine key is shown to admins only")
    return "the engine key: every engine requires it as its API key", {
        "once": {"label": "engine key", "value": ClusterSettings.load().engine_key}}


@action("settings")
def settings_set(request):
    form = valid(SettingsForm(request.POST))
    operations.set_settings(actor_of(request), **form.cleaned_data)
    return "settings saved"
