"""The dashboard's forms: what a button sends, parsed and checked by the domain's own rules before the operation
runs. A number's range is its `Bounds` (cluster.operations.validation, gateway.operations), the one the operation
checks and the API's serializer field publishes; a name is `check_name`'s; a choice is one of the domain's own
tuple (the serializer's choices too). An invalid form is its errors as the page's message, and nothing changes.

A field left blank is not given: the operation keeps what is there (a new row: its default). Some fields take a
word where blank would mean "as it is": `none` (no cap, no limit, no budget), `never`, `all`, `default`.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

from django import forms
from django.core.exceptions import ValidationError
from django.utils import timezone

from cluster.errors import OperationError
from cluster.models import EngineVersion, Model
from cluster.operations import PROFILE_BOUNDS, check_alias, check_password, user_name
from cluster.operations import rollouts as rollout_operations
from cluster.operations.validation import (
    DRAIN_GRACE,
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_TOKENS,
    MAX_WAIT,
    MEMORY,
    MIN_RESIDENT,
    MOST_REPLICAS,
    QUEUE_LIMIT,
    RECONCILE_INTERVAL,
    REPLICAS,
    RESUME_LIMIT,
    SCALING_SECONDS,
    STREAM_IDLE_TIMEOUT,
    TARGET_INFLIGHT,
    WAIT_SECONDS,
    Bounds,
    check_name,
)
from cluster.roles import ROLES
from gateway import budgets
from gateway.admission import CLASSES, DEFAULT_CLASS
from gateway.operations import CONCURRENCY, KEY_LIMIT
from ground.engines import CAPABILITIES, DRIVERS
from ground.units import format_duration, parse_duration, parse_size

NONE = ("none",)
DEFAULT = ("default",)
EXPIRY_DAYS = Bounds(1, 36500)  # the dashboard's own: the API takes the moment itself


class FormError(ValueError):
    """A form field the operator got wrong: shown as the message; nothing changed."""


def _refused(exc: OperationError) -> ValidationError:
    return ValidationError(str(exc), code="refused")


# Fields. Each error is a whole sentence that names its field, as the page shows it.


class Count(forms.IntegerField):
    """A whole number in its bounds; blank, or one of the words in `none`: None."""

    def __init__(self, label: str, bounds: Bounds, none: Collection[str] = ()):
        super().__init__(label=label, required=False)
        self.bounds, self.none = bounds, none

    def to_python(self, value: Any) -> int | None:
        raw = str(value or "").strip()
        if not raw or raw.lower() in self.none:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValidationError(f"{self.label}: {raw!r} is not a whole number", code="invalid") from None

    def validate(self, value: Any) -> None:
        if value is not None:
            try:
                self.bounds.check(str(self.label), value)
            except OperationError as exc:
                raise _refused(exc) from None


class Duration(Count):
    """Seconds, written as a duration (90s, 10m, 2h, 1d; a bare number is seconds)."""

    def to_python(self, value: Any) -> int | None:
        raw = str(value or "").strip()
        if not raw or raw.lower() in self.none:
            return None
        try:
            return parse_duration(raw)
        except ValueError as exc:
            raise ValidationError(f"{self.label}: {exc}", code="invalid") from None

    def validate(self, value: Any) -> None:
        if value is not None:
            try:
                self.bounds.check(f"{self.label} (seconds)", value)
            except OperationError as exc:
                raise _refused(exc) from None


class Size(Count):
    """Bytes, written as a size (8G, 512MiB; a bare number is bytes; `auto`: 0, estimated from the file)."""

    def to_python(self, value: Any) -> int | None:
        raw = str(value or "").strip()
        if not raw:
            return None
        if raw.lower() == "auto":
            return 0
        try:
            return parse_size(raw)
        except ValueError as exc:
            raise ValidationError(f"{self.label}: {exc}", code="invalid") from None


class Name(forms.CharField):
    """A name of llmgw's for a new row (node, model, profile, engine, key), checked as the operation checks it."""

    def __init__(self, kind: str):
        super().__init__(required=False)
        self.kind = kind

    def validate(self, value: Any) -> None:
        try:
            check_name(self.kind, value)
        except OperationError as exc:
            raise _refused(exc) from None


class Names(forms.Field):
    """Names separated by commas or spaces, each checked as a name of `kind`; blank: none. A word in `every`
    (`all`) stands for none named: every one."""

    def __init__(self, kind: str, every: Collection[str] = ()):
        super().__init__(required=False)
        self.kind, self.every = kind, every

    def to_python(self, value: Any) -> list[str]:
        raw = str(value or "").strip()
        if raw.lower() in self.every:
            return []
        return [n for n in raw.replace(",", " ").split() if n]

    def validate(self, value: Any) -> None:
        for name in value:
            try:
                check_name(self.kind, name)
            except OperationError as exc:
                raise _refused(exc) from None


class Aliases(forms.Field):
    """A model's aliases, comma-separated, each checked as the operation and the API check it; blank or `none`:
    none."""

    def __init__(self) -> None:
        super().__init__(required=False)

    def to_python(self, value: Any) -> list[str]:
        raw = str(value or "").strip()
        return [] if raw.lower() in NONE else [a for a in (x.strip() for x in raw.split(",")) if a]

    def validate(self, value: Any) -> None:
        for alias in value:
            try:
                check_alias(alias)
            except OperationError as exc:
                raise _refused(exc) from None


class Choice(forms.ChoiceField):
    """One of the domain's own choices; blank: not given (or `initial`, when the form has a default)."""

    def __init__(self, label: str, choices: Collection[str], required: bool = False):
        super().__init__(label=label, choices=[(c, c) for c in choices], required=required)
        known = ", ".join(choices)
        self.error_messages["invalid_choice"] = f"{label} is one of {known}, not %(value)r"
        self.error_messages["required"] = f"{label}: choose one of {known}"


class Choices(forms.MultipleChoiceField):
    """Some of the domain's choices (checkboxes); none ticked: an empty list."""

    def __init__(self, label: str, choices: Collection[str]):
        super().__init__(label=label, choices=[(c, c) for c in choices], required=False)
        self.error_messages["invalid_choice"] = f"unknown {label} %(value)r (known: {', '.join(choices)})"


class Listed(forms.Field):
    """Every value sent under the field's name (ticked checkboxes), as text."""

    widget = forms.MultipleHiddenInput  # whose value is them all, not the last

    def __init__(self) -> None:
        super().__init__(required=False)

    def to_python(self, value: Any) -> list[str]:
        return [str(v) for v in value or []]


class Budget(forms.Field):
    """A key's budget as TOKENS/PERIOD (2M/day), as the operations take it: `none`, no budget."""

    def to_python(self, value: Any) -> dict[str, int | str]:  # the operation's arguments
        raw = str(value or "").strip()
        if not raw:
            return {}
        if raw.lower() in NONE:
            return {"budget_tokens": 0}
        try:
            tokens, period = budgets.parse(raw)
        except ValueError as exc:
            raise ValidationError(f"budget: {exc}", code="invalid") from None
        return {"budget_tokens": tokens, "budget_period": period}


class YesNo(forms.Field):
    """A switch: `yes` (a ticked box's value) or `no`; blank (an unticked box): not given, as it is."""

    def __init__(self, label: str):
        super().__init__(label=label, required=False)

    def to_python(self, value: Any) -> bool | None:
        raw = str(value or "").strip().lower()
        if not raw:
            return None
        if raw not in ("yes", "no"):
            raise ValidationError(f"{self.label}: yes or no, not {raw[:20]!r}", code="invalid")
        return raw == "yes"


class ShellWords(forms.Field):
    """Words as a shell splits them ('--flash-attn on --jinja')."""

    def __init__(self, label: str):
        super().__init__(label=label, required=False)

    def to_python(self, value: Any) -> list[str]:
        try:
            return shlex.split(str(value or ""))
        except ValueError as exc:
            raise ValidationError(f"{self.label}: {exc}", code="invalid") from None


# Forms


class ButtonForm(forms.Form):
    """A button's form (or a page's filters). `given()` is what it changes: the cleaned value of each field filled
    in, and of each field in `sent_blank` sent at all (its blank means something: no nodes, the cluster's default),
    by the operation's name for it (`renamed`); the fields in `apart` the view reads itself."""

    renamed: ClassVar[dict[str, str]] = {}
    sent_blank: ClassVar[frozenset[str]] = frozenset()
    apart: ClassVar[frozenset[str]] = frozenset()

    def problem(self) -> str:
        """Its errors as the page's one message."""
        return "; ".join(str(message) for errors in self.errors.values() for message in errors)

    def given(self) -> dict[str, Any]:
        values = {}
        for name in self.fields:
            raw = self.data.get(name)
            if name in self.apart or raw is None or not (str(raw).strip() or name in self.sent_blank):
                continue
            values[self.renamed.get(name, name)] = self.cleaned_data[name]
        return values


Form = TypeVar("Form", bound=ButtonForm)


def valid(form: Form) -> Form:
    """The form, each field checked: FormError, its errors as the page's message, when one is wrong."""
    if not form.is_valid():
        raise FormError(form.problem())
    return form


class RequestsFilterForm(ButtonForm):
    """The Requests page's filters (gateway/records.py reads them, as for the API), and the request shown."""

    key = forms.CharField(required=False)
    model = forms.CharField(required=False)
    status = forms.CharField(required=False)
    slower_than = forms.CharField(required=False)
    resumed = forms.BooleanField(required=False)  # only those resumed on another replica
    id = forms.CharField(required=False)


class UsageFilterForm(ButtonForm):
    """The Usage page's filters: by hour (the last 48 hours) or by day (the last 30 days), a key, a model."""

    by = forms.ChoiceField(choices=[("hour", "hour"), ("day", "day")], required=False)
    key = forms.CharField(required=False)
    model = forms.CharField(required=False)


class EventsFilterForm(ButtonForm):
    """The Events page's filters: the kinds beginning so, the subjects containing that."""

    kind = forms.CharField(required=False)
    subject = forms.CharField(required=False)


class ForceForm(ButtonForm):
    """Remove or drain even so: only the box's own value, 1, forces (a forced removal loses the node's work)."""

    force = forms.CharField(required=False)

    def clean_force(self) -> bool:
        return self.cleaned_data["force"] == "1"


class NodeAddForm(ButtonForm):
    name = Name("node")


class ModelSetForm(ButtonForm):
    """Change a model: what is filled in. Blank queue limit and max wait, or `default`: the cluster's."""

    replicas = Count("replicas", REPLICAS)
    wait_seconds = Count("wait (seconds)", WAIT_SECONDS)
    min_replicas = Count("min replicas", REPLICAS)
    max_replicas = Count("max replicas", MOST_REPLICAS)
    target_inflight = Count("target in flight", TARGET_INFLIGHT)
    idle_after = Duration("idle after", SCALING_SECONDS)
    scale_down_delay = Duration("scale-down delay", SCALING_SECONDS)
    engine = forms.CharField(required=False)
    profile = forms.CharField(required=False)
    memory = Size("memory", MEMORY)
    nodes = Names("node")
    aliases = Aliases()
    max_tokens = Count("max tokens", MAX_TOKENS, none=NONE)
    max_logprobs = Count("max logprobs", MAX_LOGPROBS, none=NONE)
    max_choices = Count("max choices", MAX_CHOICES, none=NONE)
    routing = Choice("routing", Model.Routing.values)
    queue_limit = Count("queue limit", QUEUE_LIMIT, none=DEFAULT)
    max_wait = Duration("max wait", MAX_WAIT, none=DEFAULT)
    resume_limit = Count("resume limit", RESUME_LIMIT)
    stream_idle_timeout = Duration("stream idle timeout", STREAM_IDLE_TIMEOUT)
    confirm = forms.CharField(required=False)  # "yes": a change that needs confirming is confirmed

    renamed = {"idle_after": "idle_after_seconds", "scale_down_delay": "scale_down_delay_seconds",
               "memory": "memory_bytes", "max_wait": "max_wait_seconds",
               "stream_idle_timeout": "stream_idle_timeout_seconds"}
    sent_blank = frozenset({"nodes", "aliases", "queue_limit", "max_wait"})
    apart = frozenset({"confirm"})

    @property
    def confirmed(self) -> bool:
        return self.cleaned_data["confirm"] == "yes"


class ModelAddForm(ModelSetForm):
    name = Name("model")
    file = forms.CharField(required=False)  # a sha256, a file's name or a path: the operation resolves it

    apart = frozenset({"confirm", "name", "file"})


class Number(forms.Field):
    """A number as written (`1.5`, `1.5x`; with `percent`, `10` or `10%` is 0.1); the operation checks its range."""

    def __init__(self, label: str, percent: bool = False):
        super().__init__(label=label, required=False)
        self.percent = percent

    def to_python(self, value: Any) -> float | None:
        raw = str(value or "").strip()
        if not raw:
            return None
        try:
            number = float(raw.removesuffix("%" if self.percent else "x").strip())
        except ValueError:
            raise ValidationError(f"{self.label}: {raw[:20]!r} is not a number", code="invalid") from None
        if number != number or number in (float("inf"), float("-inf")):  # NaN, inf: no bound holds them
            raise ValidationError(f"{self.label}: {raw[:20]!r} is not a number", code="invalid")
        return number / 100 if self.percent else number


class RolloutStartForm(ButtonForm):
    """Roll out a change to a model (cluster/operations/rollouts.py): a new file, profile or engine (blank: as the
    model has it) on canary replicas, and the bounds it is judged by (blank: the operation's DEFAULTS)."""

    file = forms.CharField(required=False)  # a sha256, a file's name or a path: the operation resolves it
    profile = forms.CharField(required=False)
    engine = forms.CharField(required=False)
    memory = Size("memory", MEMORY)
    canary = Count("canary replicas", rollout_operations.CANARY)
    traffic = Number("traffic %", percent=True)
    shadow = Number("shadow %", percent=True)
    watch = Duration("watch", rollout_operations.WATCH)
    min_requests = Count("min requests", rollout_operations.MIN_REQUESTS)
    max_error_rate = Number("max error rate %", percent=True)
    max_ttft_ratio = Number("max TTFT ratio")
    max_tpot_ratio = Number("max TPOT ratio")

    renamed = {"watch": "watch_seconds", "memory": "memory_bytes"}

    @staticmethod
    def defaults() -> dict[str, str]:
        """The operation's DEFAULTS as the form's fields write them: 10 (%), 10m, 1.5."""
        d = rollout_operations.DEFAULTS
        return {"canary": str(d["canary"]), "traffic": f"{d['traffic'] * 100:g}",
            "shadow": f"{d['shadow'] * 100:g}", "watch": format_duration(
            d["watch_seconds"]), "min_requests": str(d["min_requests"]),
            "max_error_rate": f"{d['max_error_rate'] * 100:g}", "max_ttft_ratio": f"{d['max_ttft_ratio']:g}",
            "max_tpot_ratio": f"{d['max_tpot_ratio']:g}"}


class ReplicasRestartForm(ButtonForm):
    how = Choice("how", ("selected", "stale", "all"))
    replica = Listed()  # replica names, ticked; the operation says which it does not know


class ProfileSetForm(ButtonForm):
    name = forms.CharField(required=False)
    context_size = Count("context size", PROFILE_BOUNDS["context_size"])
    threads = Count("threads", PROFILE_BOUNDS["threads"])
    gpu_layers = Count("GPU layers", PROFILE_BOUNDS["gpu_layers"])
    batch_size = Count("batch size", PROFILE_BOUNDS["batch_size"])
    parallel = Count("parallel", PROFILE_BOUNDS["parallel"])
    extra_args = ShellWords("extra arguments")

    apart = frozenset({"name"})


class ProfileAddForm(ProfileSetForm):
    name = Name("profile")


class EngineSetForm(ButtonForm):
    name = forms.CharField(required=False)
    serves = Choices("capability", CAPABILITIES)


class EngineAddForm(EngineSetForm):
    name = Name("engine")
    kind = Choice("engine kind", sorted(DRIVERS), required=True)
    version = forms.CharField(required=False)
    device = Choice("device", EngineVersion.Device.values)
    binary = forms.CharField(required=False)
    command = forms.CharField(required=False)

    def clean_device(self) -> str:
        return self.cleaned_data["device"] or EngineVersion.Device.CPU


class MirrorImportForm(ButtonForm):
    path = forms.CharField(error_messages={"required": "path: the model file's path on the control-plane machine"})
    name = forms.CharField(required=False)  # blank: the file's own name


class MirrorUploadForm(ButtonForm):
    file = forms.FileField(allow_empty_file=True,  # the operation refuses an empty one, as over the API
                           error_messages={"required": "file: choose a model file to upload"})
    name = forms.CharField(required=False)


class KeySetForm(ButtonForm):
    """Change a key: what is filled in; `none` clears a limit or the budget, `never` the expiry, `all` the models;
    log_bodies `yes` or `no` (a new key's box: ticked, yes; unticked, not given, so off)."""

    name = forms.CharField(required=False)
    priority = Choice("priority", CLASSES)
    models = Names("model", every=("all",))
    rpm = Count("requests per minute", KEY_LIMIT, none=NONE)
    tpm = Count("tokens per minute", KEY_LIMIT, none=NONE)
    max_tokens = Count("max tokens per completion", KEY_LIMIT, none=NONE)
    max_concurrency = Count("max concurrency", CONCURRENCY, none=NONE)
    expires_days = Count("expires in days", EXPIRY_DAYS, none=("never",))
    budget = Budget(required=False)
    log_bodies = YesNo("log request and response bodies")

    renamed = {"expires_days": "expires_at"}
    apart = frozenset({"name", "budget"})

    def clean_expires_days(self) -> object:
        days = self.cleaned_data["expires_days"]
        return None if days is None else timezone.now() + timedelta(days=days)

    def changes(self) -> dict[str, Any]:
        """The operation's arguments: the budget's are its tokens and period."""
        return {**self.given(), **self.cleaned_data["budget"]}


class KeyCreateForm(KeySetForm):
    name = Name("key")

    def changes(self) -> dict[str, Any]:
        values = super().changes()
        values.setdefault("priority", DEFAULT_CLASS)
        return values


class UserAddForm(ButtonForm):
    name = forms.CharField(required=False)
    role = Choice("role", ROLES, required=True)
    password = forms.CharField(required=False, strip=False)  # blank: none, the API token alone

    def clean_name(self) -> str:
        try:
            return user_name(self.cleaned_data["name"])
        except OperationError as exc:
            raise _refused(exc) from None

    def clean_password(self) -> str | None:
        password = self.cleaned_data["password"] or None
        if password is not None:
            try:
                check_password(password)
            except OperationError as exc:
                raise _refused(exc) from None
        return password


class SettingsForm(ButtonForm):
    drain_grace_seconds = Count("drain grace (seconds)", DRAIN_GRACE)
    reconcile_interval_seconds = Count("reconcile interval (seconds)", RECONCILE_INTERVAL)
    min_resident_seconds = Count("minimum residency (seconds)", MIN_RESIDENT)
    queue_limit = Count("queue limit", QUEUE_LIMIT)
    max_wait_seconds = Count("max wait (seconds)", MAX_WAIT)
