"""Profiles: named sets of engine arguments. Editing one changes no running replica until it is restarted."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Q

from cluster.errors import Conflict, OperationError
from cluster.events import record
from cluster.models import Profile, Rollout
from cluster.operations.validation import Bounds, check_name, created, get_named

DEFAULT_PROFILE = "default"
PROFILE_FIELDS = ("context_size", "threads", "gpu_layers", "batch_size", "parallel", "extra_args")
PROFILE_MAXIMA = {"context_size": 10_000_000, "threads": 4096, "batch_size": 1_000_000, "parallel": 1024}
PROFILE_BOUNDS = {**{field: Bounds(1, most) for field, most in PROFILE_MAXIMA.items()},
                  "gpu_layers": Bounds(-1, 100_000)}  # -1: all


def _profile_values(values: dict[str, Any]) -> dict[str, int | list[str] | None]:
    clean: dict[str, int | list[str] | None] = {}
    for key, value in values.items():
        if key not in PROFILE_FIELDS:
            raise OperationError(f"unknown profile field {key!r} (known: {', '.join(PROFILE_FIELDS)})")
        if value is None and key in ("threads", "gpu_layers", "batch_size"):
            clean[key] = None
        elif key == "extra_args":
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise OperationError("extra_args must be a list of strings")
            clean[key] = value
        elif key == "gpu_layers":
            layers = PROFILE_BOUNDS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not layers.low <= value <= layers.high:
                raise OperationError(f"gpu_layers must be -1 (all) or a layer count, not {value!r}")
            clean[key] = value
        else:
            clean[key] = PROFILE_BOUNDS[key].check(key.replace("_", " "), value)
    return clean


def add_profile(name: str, actor: str, **values) -> Profile:
    check_name("profile", name)
    clean = _profile_values(values)
    with transaction.atomic():
        if Profile.objects.filter(name=name).exists():
            raise Conflict(f"a profile named {name!r} already exists")
        profile = created(f"a profile named {name!r} already exists", lambda: Profile.objects.create(name=name, **clean))
        record("profile.added", actor, f"profile {name} added: {profile.args()}", subject=name)
    return profile


def set_profile(name: str, actor: str, **values) -> Profile:
    clean = _profile_values(values)
    with transaction.atomic():
        profile = get_named(Profile, "profile", name)
        changed = [key for key, value in clean.items() if getattr(profile, key) != value]
        if not changed:
            return profile
        for key in changed:
            setattr(profile, key, clean[key])
        profile.save(update_fields=[*changed, "updated_at"])
        record(
            "profile.edited",
            actor,
            f"profile {name} edited: {profile.args()} (running replicas keep their arguments until restarted)",
            subject=name,
        )
    return profile


def remove_profile(name: str, actor: str) -> None:
    with transaction.atomic():
        profile = get_named(Profile, "profile", name)
        if name == DEFAULT_PROFILE:
            raise Conflict("the default profile cannot be removed (models use it when none is named)")
        users = list(profile.models.values_list("name", flat=True))
        if users:
            raise Conflict(f"profile {name} is used by model(s) {', '.join(users)}")
        # a rollout's new profile, or the one a promotion that fails goes back to
        trying = list(Rollout.objects.filter(Q(profile=profile) | Q(was_profile=profile), state__in=Rollout.ACTIVE)
                      .values_list("model__name", flat=True))
        if trying:
            raise Conflict(f"profile {name} is being rolled out on model(s) {', '.join(trying)}")
        profile.delete()
        record("profile.removed", actor, f"profile {name} removed", subject=name)

