"""Rollouts: a model change tried on canary replicas, then promoted or rolled back (cluster/rollouts.py judges).

`start_rollout`, `promote_rollout`, `abort_rollout` and `rollout_of` are the front doors' operations. `carry_on`
is what the control plane does every few seconds (gateway/tasks.py's `watch_rollouts`, on every control plane):
each step is a conditional update of the rollout's state, so two control planes never both take it, and the
one left after the other dies takes each on from where the database says it is.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cluster import rollouts
from cluster.errors import Conflict, NotFound, OperationError
from cluster.events import kick_reconciler, record
from cluster.models import ClusterSettings, EngineVersion, Model, Profile, Replica, Rollout
from cluster.operations.files import resolve_file
from cluster.operations.models import check_engine_file
from cluster.operations.restart import staleness
from cluster.operations.validation import MEMORY, Bounds, get_named
from ground.units import MAX_DURATION, format_size

ACTOR = "rollout"
CANARY = Bounds(1, 100)
WATCH = Bounds(1, MAX_DURATION)
MIN_REQUESTS = Bounds(1, 1_000_000)
DEFAULTS: dict[str, Any] = {"canary": 1, "traffic": 0.10, "shadow": 0.0, "watch_seconds": 600, "min_requests": 50,
                            "max_error_rate": 0.01, "max_ttft_ratio": 1.5, "max_tpot_ratio": 1.3}
# figures of a side (cluster.rollouts.Side) from the request records: (model name, canary replica names, since)
Figures = Callable[[str, frozenset[str], datetime], tuple[rollouts.Side, rollouts.Side]]


def _share(label: str, value: object, low: float = 0.0, high: float = 1.0, above_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
        raise OperationError(f"{label} must be a number, not {value!r}")
    if not (low < value if above_low else low <= value) or value > high:
        return _out_of_range(label, value, low, high, above_low)
    return float(value)


def _out_of_range(label: str, value: object, low: float, high: float, above_low: bool) -> float:
    least = f"above {low:g}" if above_low else f"from {low:g}"
    raise OperationError(f"{label} must be {least} to {high:g}, not {value!r}")


def _bounds(values: dict[str, Any]) -> dict[str, Any]:
    """The rollout's numbers, checked (the front doors parse `10%` and `10m` into 0.1 and 600)."""
    v = {**DEFAULTS, **{k: x for k, x in values.items() if x is not None}}
    return {
        "canary": CANARY.check("canary replicas", v["canary"]),
        "traffic": _share("traffic (a share of new conversations)", v["traffic"]),
        "shadow": _share("shadow (a share of requests copied to the canary)", v["shadow"]),
        "watch_seconds": WATCH.check("watch (seconds)", v["watch_seconds"]),
        "min_requests": MIN_REQUESTS.check("min requests", v["min_requests"]),
        "max_error_rate": _share("max error rate", v["max_error_rate"]),
        "max_ttft_ratio": _share("max TTFT ratio", v["max_ttft_ratio"], 1.0, 1000.0),
        "max_tpot_ratio": _share("max TPOT ratio", v["max_tpot_ratio"], 1.0, 1000.0),
    }


def start_rollout(name: str, actor: str, *, file: str | None = None, profile: str | None = None,
                  engine: str | None = None, memory_bytes: int | None = None, **values) -> Rollout:
    """Canary replicas of model `name` with the new file, profile or engine, beside its current ones; the
    model's settings change only when the rollout is promoted. `memory_bytes`: each canary's memory, the model's
    once promoted (0: estimated from the new file and profile; None: the model's, as it is)."""
    unknown = set(values) - set(DEFAULTS)
    if unknown:
        raise OperationError(f"unknown rollout setting(s): {', '.join(sorted(unknown))}")
    numbers = _bounds(values)
    if not numbers["traffic"] and not numbers["shadow"]:
        raise OperationError("a canary with no traffic and no shadow would never be judged: give --traffic or "
                             "--shadow above 0%")
    with transaction.atomic():
        model = get_named(Model.objects.select_for_update().select_related("file", "profile", "engine"), "model",
                          name)
        if model.removing:
            raise Conflict(f"model {name} is being removed")
        running = model.rollouts.filter(state__in=Rollout.ACTIVE).first()
        if running is not None:
            raise Conflict(f"model {name} has a rollout {running.get_state_display()} (since "
                           f"{running.started_at:%Y-%m-%d %H:%M:%S} UTC): one at a time")
        new_engine = get_named(EngineVersion, "engine", engine) if engine is not None else None
        new_profile = get_named(Profile, "profile", profile) if profile is not None else None
        new_file = resolve_file(file, actor) if file is not None else None  # last: a path is imported
        check_engine_file(new_engine or model.engine, new_file or model.file)
        change = {}
        for what, new, was in (("file", new_file, model.file), ("profile", new_profile, model.profile),
                               ("engine", new_engine, model.engine)):
            if new is not None and new.pk != was.pk:
                change[what] = [str(was.name), str(new.name)]
        if not change:
            raise OperationError(f"nothing to roll out: give a --file, --profile or --engine other than model "
                                 f"{name}'s own (its memory alone is set with `ctl model set {name} --memory`)")
        memory = None if memory_bytes is None else (MEMORY.check("memory", memory_bytes) or None)
        if memory_bytes is not None and memory != model.memory_bytes:
            change["memory"] = [_memory_text(model.memory_bytes), _memory_text(memory)]
        rollout = Rollout.objects.create(
            model=model, actor=actor, change=change, **numbers, memory_bytes=memory,
            file=new_file if "file" in change else None,
            profile=new_profile if "profile" in change else None,
            engine=new_engine if "engine" in change else None,
            was_file=model.file if "file" in change else None,
            was_profile=model.profile if "profile" in change else None,
            was_engine=model.engine if "engine" in change else None,
            was_memory_bytes=model.memory_bytes if "memory" in change else None)
        shadow = f" and a copy of {rollouts.percent(rollout.shadow)} of the others' requests" if rollout.shadow else ""
        record("rollout.started", actor, f"rollout of model {name} started: {rollout.change_text()}; "
               f"{rollout.canary} canary replica(s) take {rollouts.percent(rollout.traffic)} of new conversations"
               f"{shadow}",
               subject=name, rollout=rollout.pk, change=change, **numbers)
        kick_reconciler()
    return rollout


def _memory_text(memory: int | None) -> str:
    return format_size(memory) if memory else "estimated"


def rollout_of(name: str) -> Rollout:
    """Model `name`'s rollout: the one under way, else its last."""
    model = get_named(Model, "model", name)
    rollout = model.rollouts.select_related("file", "profile", "engine").order_by(
        "-started_at", "-id").first()
    if rollout is None:
        raise NotFound(f"model {name} has no rollout")
    return rollout


def _active(name: str) -> Rollout:
    """Model `name`'s rollout under way, locked with its model (the model first, then the rollout: the order every
    step of a rollout takes them in)."""
    model = get_named(Model.objects.select_for_update(), "model", name)
    rollout = model.rollouts.select_for_update().filter(state__in=Rollout.ACTIVE).first()
    if rollout is None:
        raise Conflict(f"model {name} has no rollout under way")
    return rollout


def _move(rollout: Rollout, to: str, reason: str, *, frm: str = Rollout.State.WATCHING, **fields) -> bool:
    """The rollout from `frm` to `to`, unless another process moved it first."""
    now = timezone.now()
    if to in Rollout.FINISHED:
        fields["ended_at"] = now
    moved = Rollout.objects.filter(pk=rollout.pk, state=frm).update(
        state=to, reason=reason[:500], state_changed_at=now, **fields)
    if moved:
        rollout.state, rollout.reason, rollout.state_changed_at = to, reason[:500], now
    return bool(moved)


def _moved_meanwhile(rollout: Rollout) -> Conflict:
    rollout.refresh_from_db(fields=["state"])
    return Conflict(f"the rollout of model {rollout.model.name} is {rollout.get_state_display()} now")


def promote_rollout(name: str, actor: str, why: str = "promoted by hand") -> Rollout:
    with transaction.atomic():
        rollout = _active(name)
        if rollout.state != Rollout.State.WATCHING:
            raise Conflict(f"the rollout of model {name} is {rollout.get_state_display()}: only a rollout "
                           "watching may be promoted")
        if not _promote(rollout, actor, why):
            raise _moved_meanwhile(rollout)
    return rollout


def _promote(rollout: Rollout, actor: str, why: str) -> bool:
    """The model takes the canary's settings; its canaries become its own replicas, and the others are
    replaced one at a time, as a restart does (the ones too many drained first). In a transaction."""
    model = Model.objects.select_for_update().get(pk=rollout.model_id)  # before the rollout: as _active locks
    if not _move(rollout, Rollout.State.PROMOTING, why, failures=0):
        return False
    for what in ("file", "profile", "engine"):
        if what in rollout.change and getattr(rollout, what) is not None:
            setattr(model, what, getattr(rollout, what))
    if "memory" in rollout.change:
        model.memory_bytes = rollout.memory_bytes
    model.save(update_fields=["file", "profile", "engine", "memory_bytes"])
    rollout.canaries.all().update(rollout=None)
    queued = _queue_stale(model)
    record("rollout.promoting", actor, f"rollout of model {model.name} promoting: {why}; its {queued} "
           "replica(s) with the old settings are replaced one at a time", subject=model.name, rollout=rollout.pk,
           figures=rollout.figures)
    kick_reconciler()
    return True


def _queue_stale(model: Model, unqueue: bool = False) -> int:
    """The model's replicas that no longer run its settings, queued to be replaced one at a time (`unqueue`: and
    the ones queued that run them again, a promotion gone back, left be)."""
    cluster = ClusterSettings.load()
    placed = Replica.objects.filter(model=model, state__in=Replica.COUNTING, node__isnull=False).select_related(
        "model__profile", "model__engine", "model__file")
    stale = {r.pk for r in placed if staleness(r, model, cluster)}
    if unqueue:
        placed.filter(restart=Replica.Restart.QUEUED).exclude(pk__in=stale).update(restart=Replica.Restart.NONE)
    return placed.filter(pk__in=stale, restart=Replica.Restart.NONE).update(restart=Replica.Restart.QUEUED)


def abort_rollout(name: str, actor: str) -> Rollout:
    """Watching: the canary drains and stops. Promoting: the model goes back to its settings before, its replicas
    on the new ones replaced one at a time."""
    with transaction.atomic():
        rollout = _active(name)
        if rollout.state == Rollout.State.PROMOTING:
            if not _go_back(rollout, actor, f"aborted by {actor} while promoting"):
                raise _moved_meanwhile(rollout)
            return rollout
        if rollout.state != Rollout.State.WATCHING:
            raise Conflict(f"the rollout of model {name} is {rollout.get_state_display()}: only a rollout "
                           "watching or promoting may be aborted")
        if not _move(rollout, Rollout.State.ABORTED, f"aborted by {actor}"):
            raise _moved_meanwhile(rollout)
        record("rollout.aborted", actor, f"rollout of model {name} aborted: its canary drains and stops",
               subject=name, rollout=rollout.pk, figures=rollout.figures)
        kick_reconciler()
    return rollout


def _go_back(rollout: Rollout, actor: str, why: str) -> bool:
    """A promotion undone: the model takes its settings before again, and its replicas on the new ones are
    replaced one at a time (the rollout rolls back, and is rolled back once the model is whole again). In a
    transaction."""
    model = Model.objects.select_for_update().get(pk=rollout.model_id)
    if not _move(rollout, Rollout.State.ROLLING_BACK, why, frm=Rollout.State.PROMOTING):
        return False
    for what in ("file", "profile", "engine"):
        was = getattr(rollout, f"was_{what}")
        if what in rollout.change and was is not None:  # (a profile is not removed while a rollout may go back to it)
            setattr(model, what, was)
    if "memory" in rollout.change:
        model.memory_bytes = rollout.was_memory_bytes
    model.failures, model.backoff_until = 0, None  # the new settings' failures, not the old ones'
    model.save(update_fields=["file", "profile", "engine", "memory_bytes", "failures", "backoff_until"])
    queued = _queue_stale(model, unqueue=True)
    record("rollout.rolling_back", actor, f"rollout of model {model.name} rolling back: {why}; the model goes back "
           f"to its settings before, its {queued} replica(s) on the new ones replaced one at a time",
           subject=model.name, rollout=rollout.pk, figures=rollout.figures)
    kick_reconciler()
    return True


def _roll_back(rollout: Rollout, why: str) -> None:
    with transaction.atomic():
        if _move(rollout, Rollout.State.ROLLING_BACK, why):
            record("rollout.rolling_back", ACTOR, f"rollout of model {rollout.model.name} rolling back: {why}",
                   subject=rollout.model.name, rollout=rollout.pk, figures=rollout.figures)
            kick_reconciler()


# carried on by the control plane


def carry_on(figures: Figures, now: datetime | None = None) -> None:
    """Every rollout under way, one step on: judged and promoted or rolled back while watching; promoted once
    its model is whole on the new settings, or gone back on a replica of them that failed; rolled back once its
    canary is gone and its model whole on the settings before."""
    now = now or timezone.now()
    serving_stopped = ClusterSettings.load().serving_stopped
    for rollout in Rollout.objects.filter(state__in=Rollout.ACTIVE).select_related(
            "model", "file", "profile", "engine"):
        if rollout.state == Rollout.State.WATCHING:
            _watch(rollout, figures, now, serving_stopped)
        if rollout.state == Rollout.State.PROMOTING:
            _promoted_yet(rollout)
        elif rollout.state == Rollout.State.ROLLING_BACK:
            _rolled_back_yet(rollout)


def _watch(rollout: Rollout, figures: Figures, now: datetime, serving_stopped: bool) -> None:
    model = rollout.model
    if model.removing:
        if _move(rollout, Rollout.State.ABORTED, "its model is being removed"):
            record("rollout.aborted", ACTOR, f"rollout of model {model.name} aborted: the model is being removed",
                   subject=model.name, rollout=rollout.pk)
        return
    canaries = list(rollout.canaries.order_by("state_changed_at", "id").values_list("name", "state", "reason"))
    failed = [(n, why) for n, state, why in canaries if state == Replica.State.FAILED]
    if rollout.failures and failed:
        name, why = failed[-1]
        return _roll_back(rollout, f"canary replica {name} failed: {why}")
    if rollout.failures:
        return _roll_back(rollout, "a canary replica failed")
    ready = [n for n, state, _ in canaries if state == Replica.State.READY]
    if not _readiness(rollout, bool(ready), now, serving_stopped):
        return
    if rollout.watching_since is None:
        if ready and Rollout.objects.filter(pk=rollout.pk, watching_since=None).update(watching_since=now):
            record("rollout.watching", ACTOR, f"rollout of model {model.name}: canary {ready[0]} ready; "
                   f"watched for {rollout.watch_seconds}s", subject=model.name, rollout=rollout.pk)
        return
    names = frozenset(n for n, _, _ in canaries)
    canary, current = figures(model.name, names, rollout.watching_since)
    shown = {"canary": canary.shown(), "current": current.shown(), "at": now.timestamp()}
    bounds = rollouts.Bounds(rollout.min_requests, rollout.max_error_rate, rollout.max_ttft_ratio,
                             rollout.max_tpot_ratio)
    elapsed = (now - rollout.watching_since).total_seconds()
    verdict = rollouts.judge(canary, current, bounds, elapsed, rollout.watch_seconds)
    shown["verdict"] = verdict.why if ready or not verdict.promote else "waiting for a canary replica to be ready again"
    Rollout.objects.filter(pk=rollout.pk, state=Rollout.State.WATCHING).update(figures=shown)
    rollout.figures = shown
    if serving_stopped:
        return  # nothing serves: judged again once it does
    if verdict.roll_back:
        _roll_back(rollout, verdict.why)
    elif verdict.promote and ready:  # (never on the figures of a canary gone since)
        with transaction.atomic():
            _promote(rollout, ACTOR, verdict.why)


def _readiness(rollout: Rollout, ready: bool, now: datetime, serving_stopped: bool) -> bool:
    """Since when no canary has been ready (kept at now while nothing serves); False once that is past
    LLMGW_ROLLOUT_READY_TIMEOUT and the rollout rolls back. A canary that never came ready (no room, a download
    that does not end) and one lost with its node and not placed again alike."""
    if ready:
        if rollout.unready_since is not None:
            Rollout.objects.filter(pk=rollout.pk).update(unready_since=None)
        return True
    if serving_stopped or rollout.unready_since is None:
        Rollout.objects.filter(pk=rollout.pk, state=Rollout.State.WATCHING).update(unready_since=now)
        return True
    timeout = settings.LLMGW_ROLLOUT_READY_TIMEOUT
    if (now - rollout.unready_since).total_seconds() <= timeout:
        return True
    where = f" ({rollout.note})" if rollout.note else ""
    if rollout.watching_since is None:
        _roll_back(rollout, f"no canary replica became ready in {timeout}s{where}")
    else:
        _roll_back(rollout, f"no canary replica ready for {timeout}s{where}")
    return False


def _whole(model: Model) -> list[str]:
    """The model's replicas (not a canary) not yet on its settings: restarting, not yet placed or ready, stale."""
    cluster = ClusterSettings.load()
    running = Replica.objects.filter(model=model, rollout__isnull=True).exclude(
        state__in=Replica.TERMINAL).select_related("model__file", "model__profile", "model__engine")
    return [r.name for r in running if r.restart != Replica.Restart.NONE or r.state not in Replica.COUNTING
            or staleness(r, model, cluster)]


def _promoted_yet(rollout: Rollout) -> None:
    model = Model.objects.select_related("file", "profile", "engine").get(pk=rollout.model_id)
    if rollout.failures:  # a replica on the new settings failed (cluster/reports.py): the promotion goes back
        failed = (Replica.objects.filter(model=model, state=Replica.State.FAILED,
                                         state_changed_at__gte=rollout.state_changed_at)
                  .order_by("-state_changed_at", "-id").values_list("name", "reason").first())
        what = f"replica {failed[0]} on the new settings failed: {failed[1]}" if failed else \
            "a replica on the new settings failed"
        with transaction.atomic():
            _go_back(rollout, ACTOR, what)
        return
    if _whole(model) or not Replica.objects.filter(model=model, state=Replica.State.READY).exists():
        return
    with transaction.atomic():
        if _move(rollout, Rollout.State.PROMOTED, rollout.reason, frm=Rollout.State.PROMOTING):
            record("rollout.promoted", ACTOR, f"rollout of model {model.name} promoted: every replica runs "
                   f"{rollout.change_text()}", subject=model.name, rollout=rollout.pk, figures=rollout.figures)


def _rolled_back_yet(rollout: Rollout) -> None:
    """Once nothing runs the new settings: its canary gone, and (a promotion that went back) every replica of
    its model on them replaced."""
    if rollout.canaries.filter(~Q(state__in=Replica.TERMINAL)).exists():
        return
    live = Replica.objects.filter(model_id=rollout.model_id).exclude(state__in=Replica.TERMINAL)
    if any(rollout.runs_new(snapshot) for snapshot in live.values_list("snapshot", flat=True)):
        return
    with transaction.atomic():
        if _move(rollout, Rollout.State.ROLLED_BACK, rollout.reason, frm=Rollout.State.ROLLING_BACK):
            record("rollout.rolled_back", ACTOR, f"rollout of model {rollout.model.name} rolled back: "
                   f"{rollout.reason}; the model runs as it did", subject=rollout.model.name, rollout=rollout.pk,
                   figures=rollout.figures)
