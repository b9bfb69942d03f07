"""Models: what to serve. Added, edited (scaling down drains and stops the surplus), removed once its replicas stop."""

from __future__ import annotations

import re
from typing import Any, TypedDict

from django.db import transaction
from django.utils import timezone

from cluster.errors import Conflict, OperationError
from cluster.events import kick_reconciler, record
from cluster.models import (
    ALIAS_HINT,
    ALIAS_PATTERN,
    DEFAULT_MAX_CHOICES,
    DEFAULT_MAX_LOGPROBS,
    ClusterSettings,
    Demand,
    EngineVersion,
    Model,
    ModelFile,
    Profile,
    Rollout,
)
from cluster.operations.files import resolve_file
from cluster.operations.profiles import DEFAULT_PROFILE
from cluster.operations.validation import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_TOKENS,
    MAX_WAIT,
    MEMORY,
    QUEUE_LIMIT,
    REPLICAS,
    RESUME_LIMIT,
    SCALING_SECONDS,
    STREAM_IDLE_TIMEOUT,
    TARGET_INFLIGHT,
    WAIT_SECONDS,
    check_name,
    created,
    get_named,
)
from ground.confirmation import needs_confirmation

GGUF_ENGINES = ("llama.cpp", "xllamacpp")
DEFAULT_MAX_TOKENS = 4096  # a completion's cap unless the operator sets another (or none)
ROUTINGS = tuple(Model.Routing.values)  # how the gateway picks among a model's ready replicas
MAX_ALIASES = 32  # per model: a client's vendor names, not a catalogue


def check_alias(alias: str) -> None:
    """Another name a model answers to, as clients send it (ALIAS_PATTERN, whole)."""
    if not re.fullmatch(ALIAS_PATTERN, alias):
        raise OperationError(f"invalid alias {alias[:140]!r}: use {ALIAS_HINT}")


def _aliases(aliases) -> list[str]:
    """The other names a model answers to, each as clients send it, duplicates folded, sorted."""
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise OperationError("aliases must be a list of names")
    for alias in aliases:
        check_alias(alias)
    folded = sorted(set(aliases))
    if len(folded) > MAX_ALIASES:
        raise OperationError(f"a model has at most {MAX_ALIASES} aliases, not {len(folded)}")
    return folded


def _check_names(name: str, aliases: list[str], adding: bool) -> None:
    """Each name a request may give (a model's name, every alias) names one model: refused with a one-line
    Conflict when `aliases` (for the model `name`) or, when `adding`, `name` itself would take one that is taken.

    Run inside the operation's transaction, after the lock on the one settings row that every operation taking
    such a name holds until it commits: two at once (one giving `claude-sonnet-4-5` to a model while another gives
    it to a second, or adds a model of that name) are checked one after the other, each seeing what the other
    committed. Without it (PostgreSQL; SQLite's IMMEDIATE transactions already run one at a time) both could pass
    their check and the same alias name two models; the gateway would still route a model's own name to it, and
    the alias to one of them. Not a table of aliases with a unique name: that guards aliases against each other
    only, not against model names, so the lock would still be needed, and every read of a model would join it."""
    ClusterSettings.objects.select_for_update().filter(pk=ClusterSettings.load().pk).first()
    if aliases:
        if name in aliases:
            raise Conflict(f"alias {name!r} is the model's own name")
        named = Model.objects.filter(name__in=aliases).values_list("name", flat=True).first()
        if named:
            raise Conflict(f"alias {named!r} is the name of a model; an alias never shadows a model's name")
    for other, theirs in Model.objects.exclude(name=name).values_list("name", "aliases"):
        if adding and name in theirs:
            raise Conflict(f"{name!r} is an alias of model {other}; a model cannot be named as another's alias")
        taken = sorted(set(aliases) & set(theirs))
        if taken:
            raise Conflict(f"alias {taken[0]!r} is already model {other}'s; an alias names one model")


def _model_values(values: dict[str, Any], actor: str) -> dict[str, Any]:
    """The model's fields to set (Model's keywords), checked, from the values given (a front door's, as sent)."""
    clean: dict[str, Any] = {}
    if "replicas" in values and values["replicas"] is not None:
        clean["replicas"] = REPLICAS.check("replicas", values["replicas"])
    if values.get("engine") is not None:
        clean["engine"] = get_named(EngineVersion, "engine", values["engine"])
    if values.get("profile") is not None:
        clean["profile"] = get_named(Profile, "profile", values["profile"])
    if "memory_bytes" in values:
        memory = values["memory_bytes"]
        clean["memory_bytes"] = None if memory in (None, 0) else MEMORY.check("memory", memory)
    if values.get("nodes") is not None:
        nodes = values["nodes"]
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise OperationError("nodes must be a list of node names")
        for node_name in nodes:
            check_name("node", node_name)
        clean["nodes"] = sorted(set(nodes))
    if values.get("wait_seconds") is not None:
        clean["wait_seconds"] = WAIT_SECONDS.check("wait seconds", values["wait_seconds"])
    if "max_tokens" in values:  # None: no cap of llmgw's (the engine's context is the limit)
        cap = values["max_tokens"]
        clean["max_tokens"] = None if cap is None else MAX_TOKENS.check("max tokens", cap)
    # None: no cap; 0 log-probabilities: a request may ask for none at all
    for field, label, bounds in (("max_logprobs", "max logprobs", MAX_LOGPROBS),
                                 ("max_choices", "max choices", MAX_CHOICES)):
        if field in values:
            cap = values[field]
            clean[field] = None if cap is None else bounds.check(label, cap)
    # None: the cluster's default (ClusterSettings), read by the gateway when it admits a request
    for field, label, bounds in (("queue_limit", "queue limit", QUEUE_LIMIT),
                                 ("max_wait_seconds", "max wait (seconds)", MAX_WAIT)):
        if field in values:
            value = values[field]
            clean[field] = None if value is None else bounds.check(label, value)
    for field, label in (("min_replicas", "min replicas"), ("max_replicas", "max replicas")):
        if values.get(field) is not None:
            clean[field] = REPLICAS.check(label, values[field])
    if values.get("resume_limit") is not None:
        clean["resume_limit"] = RESUME_LIMIT.check("resume limit", values["resume_limit"])
    if values.get("stream_idle_timeout_seconds") is not None:
        clean["stream_idle_timeout_seconds"] = STREAM_IDLE_TIMEOUT.check("stream idle timeout (seconds)",
                                                                         values["stream_idle_timeout_seconds"])
    if values.get("target_inflight") is not None:
        clean["target_inflight"] = TARGET_INFLIGHT.check("target in flight", values["target_inflight"])
    for field, label in (("idle_after_seconds", "idle after"), ("scale_down_delay_seconds", "scale-down delay")):
        if values.get(field) is not None:
            clean[field] = SCALING_SECONDS.check(f"{label} (seconds)", values[field])
    if values.get("aliases") is not None:
        clean["aliases"] = _aliases(values["aliases"])
    if values.get("routing") is not None:
        if values["routing"] not in ROUTINGS:
            raise OperationError(f"routing is one of {', '.join(ROUTINGS)}, not {str(values['routing'])[:40]!r}")
        clean["routing"] = values["routing"]
    if values.get("file") is not None:  # last: a path is imported, and everything else must be valid first
        clean["file"] = resolve_file(values["file"], actor)
    return clean


def check_engine_file(engine: EngineVersion, model_file: ModelFile) -> None:
    if engine.kind in GGUF_ENGINES and model_file.format != "gguf":
        raise OperationError(f"file {model_file.name} is not GGUF; engine {engine.name} ({engine.kind}) needs GGUF")


AUTOSCALE_ONLY = ("target_inflight", "idle_after_seconds", "scale_down_delay_seconds")


class ScalingFields(TypedDict, total=False):
    replicas: int
    min_replicas: int | None
    max_replicas: int | None


def _scaling(current: Model | None, given: dict[str, Any]) -> ScalingFields:
    """The model's replicas, fixed or autoscaled, from what was given (and what it had): the fields to set.
    A fixed count and a range together, a range with its minimum above its maximum, a maximum of 0, half a range
    for a fixed model, or an autoscaler's knob for a fixed one: each a one-line error."""
    fixed = given.get("replicas")
    low, high = given.get("min_replicas"), given.get("max_replicas")
    knobs = [k for k in AUTOSCALE_ONLY if given.get(k) is not None]
    if fixed is not None and (low is not None or high is not None):
        raise OperationError("give either a fixed number of replicas (replicas) or a range (min and max replicas), "
                             "not both")
    if fixed is not None:
        if knobs:
            raise OperationError(f"{knobs[0].replace('_', ' ')} is for an autoscaled model (min and max replicas), "
                                 "not a fixed number of replicas")
        return {"replicas": fixed, "min_replicas": None, "max_replicas": None}
    was_autoscaled = current is not None and current.autoscaled
    if low is None and high is None:
        if knobs and not was_autoscaled:
            raise OperationError(f"{knobs[0].replace('_', ' ')} is for an autoscaled model: give min and max replicas")
        return {}
    if low is None or high is None:
        # half a range: the rest is what the model has, an autoscaled one (both set)
        if current is None or current.min_replicas is None or current.max_replicas is None:
            raise OperationError("to autoscale a model give both min and max replicas")
        low = current.min_replicas if low is None else low
        high = current.max_replicas if high is None else high
    if high < 1:
        raise OperationError("max replicas must be at least 1")
    if low > high:
        raise OperationError(f"min replicas ({low}) is above max replicas ({high})")
    return {"min_replicas": low, "max_replicas": high}


def _start_demand(model: Model, replicas: int) -> None:
    """An autoscaled model's state begins: at `replicas` (its minimum when new, what it ran when it was fixed),
    scaled now, so an idle one is not unloaded before its idle time (counted from then: no request is made up)."""
    low, high = model.min_replicas, model.max_replicas
    assert low is not None and high is not None, f"model {model.name} is not autoscaled"
    Demand.objects.update_or_create(model=model, defaults={
        "replicas": min(max(replicas, low), high), "samples": [], "below_since": None,
        "last_request_at": None, "last_scaled_at": timezone.now(),
    })


def add_model(
    name: str,
    actor: str,
    file: str,
    engine: str,
    profile: str = DEFAULT_PROFILE,
    replicas: int | None = None,
    memory_bytes: int | None = None,
    nodes: list[str] | None = None,
    wait_seconds: int | None = None,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_logprobs: int | None = DEFAULT_MAX_LOGPROBS,
    max_choices: int | None = DEFAULT_MAX_CHOICES,
    routing: str = Model.Routing.PREFIX,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_inflight: int | None = None,
    idle_after_seconds: int | None = None,
    scale_down_delay_seconds: int | None = None,
    aliases: list[str] | None = None,
    queue_limit: int | None = None,
    max_wait_seconds: int | None = None,
    resume_limit: int | None = None,
    stream_idle_timeout_seconds: int | None = None,
) -> Model:
    """A new model: `replicas` fixed (1 unless given), or autoscaled between `min_replicas` and `max_replicas`;
    `queue_limit` and `max_wait_seconds` None: the cluster's defaults; `resume_limit` and
    `stream_idle_timeout_seconds` None: the model's defaults (2 and 30)."""
    check_name("model", name)
    existing = Model.objects.filter(name=name).first()
    if existing:
        state = " (it is being removed)" if existing.removing else ""
        raise Conflict(f"a model named {name!r} already exists{state}")
    # One transaction: a file imported by path on the way is not recorded if the model is refused after all.
    with transaction.atomic():
        clean = _model_values(
            {
                "file": file,
                "engine": engine,
                "profile": profile,
                "replicas": replicas,
                "memory_bytes": memory_bytes,
                "nodes": nodes or [],
                "wait_seconds": wait_seconds,
                "max_tokens": max_tokens,
                "max_logprobs": max_logprobs,
                "max_choices": max_choices,
                "routing": routing,
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "target_inflight": target_inflight,
                "idle_after_seconds": idle_after_seconds,
                "scale_down_delay_seconds": scale_down_delay_seconds,
                "aliases": aliases or [],
                "queue_limit": queue_limit,
                "max_wait_seconds": max_wait_seconds,
                "resume_limit": resume_limit,
                "stream_idle_timeout_seconds": stream_idle_timeout_seconds,
            },
            actor,
        )
        clean.update(_scaling(None, clean))
        if clean.get("replicas") is None:
            clean["replicas"] = 1 if clean.get("min_replicas") is None else 0
        check_engine_file(clean["engine"], clean["file"])
        _check_names(name, clean["aliases"], adding=True)
        if Model.objects.filter(name=name).exists():
            raise Conflict(f"a model named {name!r} already exists")
        model = created(f"a model named {name!r} already exists", lambda: Model.objects.create(name=name, **clean))
        if model.min_replicas is not None:  # autoscaled
            _start_demand(model, model.min_replicas)
        record(
            "model.added",
            actor,
            f"model {name} added: {model.file.name} on {model.engine.name}, profile {model.profile.name}, "
            f"{model.scaling_text()}, {model.memory_estimate()} bytes each, "
            f"{'no cap on' if model.max_tokens is None else f'at most {model.max_tokens}'} tokens per completion, "
            f"routed by {model.routing}, {model.resuming_text()}"
            f"{', also answering to ' + ', '.join(model.aliases) if model.aliases else ''}",
            subject=name,
        )
        kick_reconciler()
    return model


def confirmation_needed(name: str | None, values: dict[str, Any]) -> str:
    """'' when adding the model `name` (None) or changing it so may go ahead at once; else why the change is
    confirmed first (ground.confirmation: it adds many replicas at once). A model that does not exist is the
    operation's to refuse."""
    current = None
    if name is not None:
        current = Model.objects.filter(name=name).values("replicas", "min_replicas", "max_replicas").first()
        if current is None:
            return ""
    return needs_confirmation(current, values)


def set_model(name: str, actor: str, **values) -> Model:
    with transaction.atomic():
        # locked: a rollout started meanwhile (which locks the model too) is seen by _refuse_under_rollout
        model = get_named(Model.objects.select_for_update(), "model", name)
        clean = _model_values(values, actor)
        if model.removing:
            raise Conflict(f"model {name} is being removed")
        engine = clean.get("engine", model.engine)
        model_file = clean.get("file", model.file)
        check_engine_file(engine, model_file)
        was_autoscaled, running = model.autoscaled, model.replicas
        if was_autoscaled:
            running = Demand.objects.filter(model=model).values_list("replicas", flat=True).first() or 0
        clean.update(_scaling(model, clean))
        changed = {k: v for k, v in clean.items() if getattr(model, k) != v}
        if not changed:
            return model
        _refuse_under_rollout(model, changed)
        if "aliases" in changed:
            _check_names(name, changed["aliases"], adding=False)
        for key, value in changed.items():
            setattr(model, key, value)
        model.save(update_fields=list(changed))
        if model.autoscaled and not was_autoscaled:
            _start_demand(model, running)  # from the replicas it ran, within its range
        if not model.autoscaled and was_autoscaled:
            Demand.objects.filter(model=model).delete()
        shown = ", ".join(f"{k}={_shown(k, v)}" for k, v in changed.items())
        record("model.edited", actor, f"model {name} edited: {shown}", subject=name)
        kick_reconciler()
    return model


def _refuse_under_rollout(model: Model, changed) -> None:
    """What a rollout under way changes (its file, profile, engine; its memory when it sets one) changes only
    through it."""
    touched = set(changed) & {"file", "profile", "engine", "memory_bytes"}
    rollout = model.rollouts.filter(state__in=Rollout.ACTIVE).first() if touched else None
    if rollout is None:
        return
    if "memory" not in rollout.change:
        touched.discard("memory_bytes")
    if touched:
        what = ", ".join(sorted("memory" if t == "memory_bytes" else t for t in touched))
        raise Conflict(f"model {model.name} has a rollout {rollout.get_state_display()}: its {what} "
                       f"changes only through it (`ctl rollout promote {model.name}` or `abort` it first)")


QUEUE_FIELDS = ("queue_limit", "max_wait_seconds")  # None: the cluster's default


def _shown(key: str, value) -> str:
    """A changed setting in the model.edited Event: a list as its items (`aliases=a,b`; `none` when empty), a
    queue's bound left to the cluster as `default`."""
    if isinstance(value, list):
        return ",".join(value) or "none"
    if value is None and key in QUEUE_FIELDS:
        return "default"
    return str(getattr(value, "name", value))


def remove_model(name: str, actor: str) -> Model:
    with transaction.atomic():
        model = get_named(Model, "model", name)
        if model.removing:
            return model
        model.removing = True
        model.save(update_fields=["removing"])
        record("model.removing", actor, f"model {name} removed: its replicas are stopping", subject=name)
        kick_reconciler()
    return model

