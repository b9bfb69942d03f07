"""Every change an operator can make, one function each. The CLI, the REST API and the dashboard call these.

Each validates (raising OperationError with a one-line message, changing nothing), changes state in one
transaction, writes an Event, and kicks the reconciler after commit.
"""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q
from rest_framework.authtoken.models import Token

from cluster import mirror
from cluster.events import kick_reconciler, record
from cluster.roles import ROLES
from cluster.models import NAME_RE, ClusterSettings, EngineVersion, Model, ModelFile, Node, Profile, Replica

GGUF_ENGINES = ("llama.cpp", "xllamacpp")
DEFAULT_PROFILE = "default"


class OperationError(Exception):
    """A refused operation; the message is one line an operator can act on."""


class NotFound(OperationError):
    pass


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not re.match(NAME_RE, name):
        raise OperationError(
            f"invalid {kind} name {name!r}: use lower-case letters, digits, '.', '_' or '-' (at most 63)"
        )


def _get(model_cls, kind: str, name: str):
    try:
        return model_cls.objects.get(name=name)
    except model_cls.DoesNotExist:
        raise NotFound(f"no {kind} named {name!r}") from None


def _check_count(label: str, value, minimum: int = 0, maximum: int = 2**31 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise OperationError(f"{label} must be a whole number from {minimum} to {maximum}, not {value!r}")
    return value


MAX_REPLICAS = 1000
MAX_MEMORY = 2**50  # a PiB: anything above is a typo


# Nodes


def add_node(name: str, actor: str) -> tuple[Node, str]:
    _check_name("node", name)
    token = Node.new_token()
    with transaction.atomic():
        if Node.objects.filter(name=name).exists():
            raise OperationError(f"a node named {name!r} already exists")
        node = Node.objects.create(name=name, token_hash=Node.hash_token(token))
        record("node.added", actor, f"node {name} added", subject=name)
    return node, token


def reset_node_token(name: str, actor: str) -> tuple[Node, str]:
    token = Node.new_token()
    with transaction.atomic():
        node = _get(Node, "node", name)
        node.token_hash = Node.hash_token(token)
        node.save(update_fields=["token_hash"])
        record("node.token_reset", actor, f"node {name}: new agent token", subject=name)
    _notify_node(node.pk, "agent.close")
    return node, token


def remove_node(name: str, actor: str, force: bool = False) -> None:
    with transaction.atomic():
        node = _get(Node, "node", name)
        running = list(node.replicas.exclude(state__in=Replica.TERMINAL).values_list("name", flat=True))
        if running and not force:
            raise OperationError(
                f"node {name} still has {len(running)} replica(s) ({', '.join(running[:5])}); "
                "scale them away first or use --force"
            )
        for replica_name in running:
            record("replica.failed", actor, f"replica {replica_name} lost: node {name} removed", subject=replica_name)
        node.replicas.exclude(state__in=Replica.TERMINAL).update(
            state=Replica.State.FAILED, reason=f"node {name} removed"
        )
        node_pk = node.pk
        node.delete()
        record("node.removed", actor, f"node {name} removed", subject=name, replicas=running)
        kick_reconciler()
    _notify_node(node_pk, "agent.close")


def _notify_node(node_pk: int, message_type: str) -> None:
    from cluster.reconciler import notify_nodes

    notify_nodes([node_pk], message_type)


# Mirror


def _check_import_path(source: Path, actor: str) -> None:
    """The CLI runs on the server with its owner's rights; over the API and the dashboard (actor `user:…`),
    a path must lie in one of LLMGW_IMPORT_DIRS, or any file the server can read would be up for grabs."""
    if not actor.startswith("user:"):
        return
    roots = [Path(d).resolve() for d in settings.LLMGW_IMPORT_DIRS]
    resolved = source.resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots) or "none (set LLMGW_IMPORT_DIRS)"
        raise OperationError(f"imports by path must come from the import directories: {allowed}")


def import_model_file(path: str, actor: str, name: str | None = None) -> tuple[ModelFile, bool]:
    source = Path(path).expanduser()
    _check_import_path(source, actor)
    if not source.exists():
        raise NotFound(f"no such file: {path}")
    if not source.is_file():
        raise OperationError(f"not a regular file: {path}")
    return _import(source, actor, name or source.name, shown=path)


def import_uploaded_file(uploaded, actor: str, name: str | None = None) -> tuple[ModelFile, bool]:
    """A model file sent in a request (a Django UploadedFile: the dashboard's upload, the API's multipart POST)."""
    import tempfile

    name = name or Path(uploaded.name or "").name
    if hasattr(uploaded, "temporary_file_path"):  # large uploads: already spooled to disk by Django
        return _import(Path(uploaded.temporary_file_path()), actor, name, shown=name)
    with tempfile.NamedTemporaryFile(prefix="llmgw-upload-") as tmp:
        for chunk in uploaded.chunks():
            tmp.write(chunk)
        tmp.flush()
        return _import(Path(tmp.name), actor, name, shown=name)


def _import(source: Path, actor: str, name: str, shown: str) -> tuple[ModelFile, bool]:
    if not (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name):
        raise OperationError("a file name must be 1 to 255 characters without '/'")
    gguf = {}
    fmt = "other"
    try:
        if mirror.is_gguf(source):
            try:
                gguf = mirror.gguf_facts(source)
            except mirror.NotGGUF as exc:
                raise OperationError(str(exc)) from None
            fmt = "gguf"
        sha, size, _ = mirror.store(source)
    except OSError as exc:
        raise OperationError(f"cannot import {shown}: {exc.strerror or exc}") from None
    with transaction.atomic():
        existing = ModelFile.objects.filter(sha256=sha).first()
        if existing:
            return existing, False
        model_file = ModelFile.objects.create(sha256=sha, name=name, size=size, format=fmt, gguf=gguf)
        record(
            "file.imported", actor, f"file {model_file.name} ({sha[:12]}, {size} bytes) imported", subject=sha[:12]
        )
    return model_file, True


def resolve_file(ref: str, actor: str) -> ModelFile:
    """A sha256 (or a unique prefix of 8+ hex digits), a file name in the mirror, or a path to import."""
    ref = (ref or "").strip()
    if not ref:
        raise OperationError("name a model file: a sha256, a file name in the mirror, or a path")
    if re.fullmatch(r"[0-9a-f]{8,64}", ref):
        matches = list(ModelFile.objects.filter(sha256__startswith=ref)[:2])
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise OperationError(f"sha256 prefix {ref} matches several files; give more digits")
    by_name = list(ModelFile.objects.filter(name=ref)[:2])
    if len(by_name) == 1:
        return by_name[0]
    if len(by_name) > 1:
        raise OperationError(f"several files are named {ref!r}; give the sha256")
    if "/" in ref or Path(ref).exists():
        return import_model_file(ref, actor)[0]
    raise NotFound(f"no model file {ref!r} in the mirror (give a sha256, a file name, or a path to import)")


# Profiles

PROFILE_FIELDS = ("context_size", "threads", "gpu_layers", "batch_size", "parallel", "extra_args")
PROFILE_MAXIMA = {"context_size": 10_000_000, "threads": 4096, "batch_size": 1_000_000, "parallel": 1024}


def _profile_values(values: dict) -> dict:
    clean = {}
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
            if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= 100_000:
                raise OperationError(f"gpu_layers must be -1 (all) or a layer count, not {value!r}")
            clean[key] = value
        else:
            clean[key] = _check_count(key.replace("_", " "), value, 1, PROFILE_MAXIMA.get(key, 2**31 - 1))
    return clean


def add_profile(name: str, actor: str, **values) -> Profile:
    _check_name("profile", name)
    clean = _profile_values(values)
    with transaction.atomic():
        if Profile.objects.filter(name=name).exists():
            raise OperationError(f"a profile named {name!r} already exists")
        profile = Profile.objects.create(name=name, **clean)
        record("profile.added", actor, f"profile {name} added: {profile.args()}", subject=name)
    return profile


def set_profile(name: str, actor: str, **values) -> Profile:
    clean = _profile_values(values)
    with transaction.atomic():
        profile = _get(Profile, "profile", name)
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
        profile = _get(Profile, "profile", name)
        if name == DEFAULT_PROFILE:
            raise OperationError("the default profile cannot be removed (models use it when none is named)")
        users = list(profile.models.values_list("name", flat=True))
        if users:
            raise OperationError(f"profile {name} is used by model(s) {', '.join(users)}")
        profile.delete()
        record("profile.removed", actor, f"profile {name} removed", subject=name)


# Engines


def add_engine(
    name: str,
    kind: str,
    actor: str,
    version: str = "",
    device: str = EngineVersion.Device.CPU,
    binary: str = "",
    command: str = "",
) -> EngineVersion:
    from agents.engines import DRIVERS

    _check_name("engine", name)
    if kind not in DRIVERS:
        raise OperationError(f"unknown engine kind {kind!r} (known: {', '.join(sorted(DRIVERS))})")
    if device not in EngineVersion.Device.values:
        raise OperationError(f"device must be cpu or gpu, not {device!r}")
    if kind == "command" and not command.strip():
        raise OperationError("a command engine needs --command, e.g. '{python} server.py --port {port}'")
    if command:
        try:
            DRIVERS["command"].check_template(command)
        except ValueError as exc:
            raise OperationError(str(exc)) from None
    with transaction.atomic():
        if EngineVersion.objects.filter(name=name).exists():
            raise OperationError(f"an engine named {name!r} already exists")
        engine = EngineVersion.objects.create(
            name=name, kind=kind, version=version, device=device, binary=binary, command=command
        )
        record("engine.added", actor, f"engine {name} ({kind} {version}, {device}) added", subject=name)
    return engine


# Models


def _model_values(values: dict, actor: str) -> dict:
    clean = {}
    if "replicas" in values and values["replicas"] is not None:
        clean["replicas"] = _check_count("replicas", values["replicas"], 0, MAX_REPLICAS)
    if values.get("engine") is not None:
        clean["engine"] = _get(EngineVersion, "engine", values["engine"])
    if values.get("profile") is not None:
        clean["profile"] = _get(Profile, "profile", values["profile"])
    if "memory_bytes" in values:
        memory = values["memory_bytes"]
        clean["memory_bytes"] = None if memory in (None, 0) else _check_count("memory", memory, 1, MAX_MEMORY)
    if values.get("nodes") is not None:
        nodes = values["nodes"]
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise OperationError("nodes must be a list of node names")
        for node_name in nodes:
            _check_name("node", node_name)
        clean["nodes"] = sorted(set(nodes))
    if values.get("wait_seconds") is not None:
        clean["wait_seconds"] = _check_count("wait seconds", values["wait_seconds"], 0, 3600)
    if values.get("file") is not None:  # last: a path is imported, and everything else must be valid first
        clean["file"] = resolve_file(values["file"], actor)
    return clean


def _check_engine_file(engine: EngineVersion, model_file: ModelFile) -> None:
    if engine.kind in GGUF_ENGINES and model_file.format != "gguf":
        raise OperationError(f"file {model_file.name} is not GGUF; engine {engine.name} ({engine.kind}) needs GGUF")


def add_model(
    name: str,
    actor: str,
    file: str,
    engine: str,
    profile: str = "default",
    replicas: int = 1,
    memory_bytes: int | None = None,
    nodes: list[str] | None = None,
    wait_seconds: int | None = None,
) -> Model:
    _check_name("model", name)
    existing = Model.objects.filter(name=name).first()
    if existing:
        state = " (it is being removed)" if existing.removing else ""
        raise OperationError(f"a model named {name!r} already exists{state}")
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
            },
            actor,
        )
        _check_engine_file(clean["engine"], clean["file"])
        if Model.objects.filter(name=name).exists():
            raise OperationError(f"a model named {name!r} already exists")
        model = Model.objects.create(name=name, **clean)
        record(
            "model.added",
            actor,
            f"model {name} added: {model.file.name} on {model.engine.name}, profile {model.profile.name}, "
            f"{model.replicas} replica(s), {model.memory_estimate()} bytes each",
            subject=name,
        )
        kick_reconciler()
    return model


def set_model(name: str, actor: str, **values) -> Model:
    with transaction.atomic():
        model = _get(Model, "model", name)
        clean = _model_values(values, actor)
        if model.removing:
            raise OperationError(f"model {name} is being removed")
        engine = clean.get("engine", model.engine)
        model_file = clean.get("file", model.file)
        _check_engine_file(engine, model_file)
        changed = {k: v for k, v in clean.items() if getattr(model, k) != v}
        if not changed:
            return model
        for key, value in changed.items():
            setattr(model, key, value)
        model.save(update_fields=list(changed))
        shown = ", ".join(f"{k}={getattr(v, 'name', v)}" for k, v in changed.items())
        record("model.edited", actor, f"model {name} edited: {shown}", subject=name)
        kick_reconciler()
    return model


def remove_model(name: str, actor: str) -> Model:
    with transaction.atomic():
        model = _get(Model, "model", name)
        if model.removing:
            return model
        model.removing = True
        model.save(update_fields=["removing"])
        record("model.removing", actor, f"model {name} removed: its replicas are stopping", subject=name)
        kick_reconciler()
    return model


# Users


def add_user(name: str, role: str, actor: str, password: str | None = None) -> tuple[User, str]:
    if role not in ROLES:
        raise OperationError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if not re.fullmatch(r"[\w.@+-]{1,150}", name or ""):
        raise OperationError(f"invalid user name {name!r}")
    if password is not None and len(password) < 8:
        raise OperationError("a password needs at least 8 characters")
    with transaction.atomic():
        if User.objects.filter(username=name).exists():
            raise OperationError(f"a user named {name!r} already exists")
        user = User(username=name, is_staff=role == "admin", is_superuser=role == "admin")
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()
        try:
            user.full_clean(exclude=["password"])
        except ValidationError as exc:
            raise OperationError("; ".join(m for ms in exc.message_dict.values() for m in ms)) from None
        user.save()
        user.groups.add(Group.objects.get_or_create(name=role)[0])
        token = Token.objects.create(user=user)
        record("user.added", actor, f"user {name} added as {role}", subject=name)
    return user, token.key


# Status


def cluster_status() -> dict:
    from django.utils import timezone

    settings_row = ClusterSettings.load()
    now = timezone.now()
    nodes = list(Node.objects.all())
    alive = [n for n in nodes if n.is_alive(now)]
    by_state = dict(
        Replica.objects.exclude(state__in=Replica.TERMINAL)
        .values_list("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )
    models = Model.objects.annotate(
        ready=Count("replica_set", filter=Q(replica_set__state=Replica.State.READY)),
    ).values("name", "replicas", "ready", "removing", "placement_note")
    return {
        "serving": "stopped" if settings_row.serving_stopped else "serving",
        "nodes": {"total": len(nodes), "connected": len(alive)},
        "models": list(models),
        "replicas": by_state,
    }


# Client keys (the gateway's)


def create_key(
    name: str,
    actor: str,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    expires_at=None,
) -> tuple["ApiKey", str]:
    """A new client key for /v1/. The secret is returned once and stored only as a hash."""
    from django.utils import timezone

    from gateway.models import ApiKey

    _check_name("key", name)
    models = sorted(set(models or []))
    for model_name in models:
        _check_name("model", model_name)
    if rpm is not None:
        _check_count("rpm", rpm, 1)
    if tpm is not None:
        _check_count("tpm", tpm, 1)
    if expires_at is not None and expires_at <= timezone.now():
        raise OperationError(f"the expiry {expires_at:%Y-%m-%d %H:%M} is in the past")
    secret = ApiKey.new_secret()
    with transaction.atomic():
        if ApiKey.objects.filter(name=name).exists():
            raise OperationError(f"a key named {name!r} already exists")
        key = ApiKey.objects.create(
            name=name,
            prefix=secret[:14],
            key_hash=ApiKey.hash(secret),
            allowed_models=models,
            rpm=rpm,
            tpm=tpm,
            expires_at=expires_at,
        )
        limits = ", ".join(
            part
            for part in (
                f"models {', '.join(models)}" if models else "all models",
                f"{rpm} requests/min" if rpm else "",
                f"{tpm} tokens/min" if tpm else "",
                f"expires {expires_at:%Y-%m-%d %H:%M}" if expires_at else "",
            )
            if part
        )
        record("key.created", actor, f"key {name} ({key.prefix}…) created: {limits}", subject=name)
        _gateways_reload()
    return key, secret


def revoke_key(name: str, actor: str) -> "ApiKey":
    from django.utils import timezone

    from gateway.models import ApiKey

    with transaction.atomic():
        key = _get(ApiKey, "key", name)
        if key.revoked_at is not None:
            raise OperationError(f"key {name} is already revoked")
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        record("key.revoked", actor, f"key {name} ({key.prefix}…) revoked", subject=name)
        _gateways_reload()
    return key


def _gateways_reload() -> None:
    from gateway.runtime import notify_change

    notify_change()


def usage_report(key: str | None = None, model: str | None = None, since=None) -> list[dict]:
    """Tokens per key, model and hour, newest first."""
    from gateway.models import ApiKey, Usage

    rows = Usage.objects.select_related("key")
    if key:
        if not ApiKey.objects.filter(name=key).exists():
            raise NotFound(f"no key named {key!r}")
        rows = rows.filter(key__name=key)
    if model:
        rows = rows.filter(model=model)
    if since:
        rows = rows.filter(hour__gte=since.replace(minute=0, second=0, microsecond=0))
    return [
        {
            "key": r.key.name,
            "model": r.model,
            "hour": r.hour,
            "requests": r.requests,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
        }
        for r in rows.order_by("-hour", "key__name", "model")[:5000]
    ]


# The system: stop and start serving


def stop_serving(actor: str) -> ClusterSettings:
    """Every model to zero replicas, /v1/ answers 503 system_stopped; no model's definition changes."""
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        if cluster.serving_stopped:
            raise OperationError("llmgw is already stopped")
        cluster.serving_stopped = True
        cluster.save(update_fields=["serving_stopped", "updated_at"])
        record("system.stopped", actor, "serving stopped: every model goes to zero replicas; /v1/ answers 503")
        kick_reconciler()
    return cluster


def start_serving(actor: str) -> ClusterSettings:
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        if not cluster.serving_stopped:
            raise OperationError("llmgw is already serving")
        cluster.serving_stopped = False
        cluster.save(update_fields=["serving_stopped", "updated_at"])
        record("system.started", actor, "serving started: every model is placed again as it asks")
        kick_reconciler()
    return cluster


def set_settings(actor: str, drain_grace_seconds: int | None = None, reconcile_interval_seconds: int | None = None) -> ClusterSettings:
    """Change the cluster settings given (None: leave as is): how long a drain waits for requests in flight,
    and how often the reconciler runs."""
    values = {}
    if drain_grace_seconds is not None:
        values["drain_grace_seconds"] = _check_count("drain grace (seconds)", drain_grace_seconds, 0, 86400)
    if reconcile_interval_seconds is not None:
        values["reconcile_interval_seconds"] = _check_count("reconcile interval (seconds)", reconcile_interval_seconds, 1, 3600)
    if not values:
        raise OperationError("name a setting to change: drain grace or reconcile interval")
    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        changed = {k: v for k, v in values.items() if getattr(cluster, k) != v}
        for k, v in changed.items():
            setattr(cluster, k, v)
        if changed:
            cluster.save(update_fields=[*changed, "updated_at"])
            said = ", ".join(f"{k.replace('_seconds', '').replace('_', ' ')} {v}s" for k, v in changed.items())
            record("settings.changed", actor, f"settings changed: {said}", **changed)
            kick_reconciler()
    return cluster


# Restart and drain


class RestartQueued(list):
    """The names of the replicas queued for restart, with `skipped`: name -> why nothing was done for it
    (already queued, being replaced, not stale, ...). Replicas picked by --model, --all or --stale that are
    not running (draining, stopping, unplaced) are left out silently; ones named are always accounted for."""

    def __init__(self, queued=(), skipped: dict[str, str] | None = None):
        super().__init__(queued)
        self.skipped = dict(skipped or {})


def staleness(replica: Replica, model: Model, cluster_settings: ClusterSettings) -> str | None:
    """Why a running replica no longer matches what it would start with now, or None.

    "profile edited", "engine version", "engine key", "model file" (comma-separated when several): its
    start-time snapshot against the model's profile arguments, engine, file and the current engine key.
    Only placed replicas that count (pending to ready) can be stale; a restart is what makes them current.
    """
    snap = replica.snapshot or {}
    if not snap or replica.node_id is None or replica.state not in Replica.COUNTING:
        return None
    why = []
    if "args" in snap and snap["args"] != model.profile.args():
        why.append("profile edited")
    if "engine" in snap and snap["engine"] != model.engine.spec():
        why.append("engine version")
    if "engine_key" in snap and snap["engine_key"] != ClusterSettings.fingerprint(cluster_settings.engine_key):
        why.append("engine key")
    if "file" in snap and snap["file"] != model.file.sha256:
        why.append("model file")
    return ", ".join(why) or None


def _not_restartable(replica: Replica) -> str:
    """Why queuing this replica for restart would do nothing ('' if it would not)."""
    if replica.restart == Replica.Restart.QUEUED:
        return "already queued for restart"
    if replica.restart == Replica.Restart.REPLACING:
        return "already being replaced"
    if replica.model.removing:
        return "its model is being removed"
    if replica.state in (Replica.State.DRAINING, Replica.State.STOPPING):
        return f"already {replica.state}"
    if replica.node_id is None:
        return "not placed yet: it starts with the current settings when it is"
    return ""


def _names_list(label: str, value) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise OperationError(f"{label} must be a list of names")
    return list(dict.fromkeys(value))


def restart_replicas(
    actor: str, replicas=(), models=(), all: bool = False, stale: bool = False  # noqa: A002 (the CLI's --all)
) -> RestartQueued:
    """Queue replicas for restart: each is replaced without leaving service first (the reconciler places a
    replacement beside it, then drains it), one at a time per model.

    `replicas` by name, every replica of `models`, `all` of them, or with `stale` only the stale ones (of
    those named, or of all when none is named). An unknown name is an error and queues nothing; a replica
    already queued or being replaced is a no-op, reported in `skipped`."""
    replicas = _names_list("replicas", replicas)
    models = _names_list("models", models)
    if not (replicas or models or all or stale):
        raise OperationError("name replicas, --model, --all or --stale")
    with transaction.atomic():
        if ClusterSettings.load().serving_stopped:
            raise OperationError(
                "llmgw is stopped: nothing runs to restart (on start, replicas use the current settings)"
            )
        rows = Replica.objects.select_related("model__profile", "model__engine", "model__file").exclude(
            state__in=Replica.TERMINAL
        )
        chosen: dict[int, Replica] = {}
        if replicas:
            found = {r.name: r for r in Replica.objects.filter(name__in=replicas).select_related(
                "model__profile", "model__engine", "model__file"
            )}
            unknown = [name for name in replicas if name not in found]
            if unknown:
                raise NotFound(f"no replica named {', '.join(repr(n) for n in unknown)}; nothing queued")
            over = [found[name] for name in replicas if found[name].state in Replica.TERMINAL]
            if over:
                shown = ", ".join(f"{r.name} is {r.state}" for r in over)
                raise OperationError(f"only running replicas can be restarted: {shown}; nothing queued")
            chosen.update((r.pk, r) for r in found.values())
        if models:
            known = set(Model.objects.filter(name__in=models).values_list("name", flat=True))
            unknown = [name for name in models if name not in known]
            if unknown:
                raise NotFound(f"no model named {', '.join(repr(n) for n in unknown)}; nothing queued")
            chosen.update((r.pk, r) for r in rows.filter(model__name__in=models))
        if all or (stale and not replicas and not models):
            chosen.update((r.pk, r) for r in rows)
        cluster = ClusterSettings.load()
        named = set(replicas)
        queued: list[str] = []
        skipped: dict[str, str] = {}
        for r in sorted(chosen.values(), key=lambda r: (r.model.name, r.name)):
            why_not = _not_restartable(r)
            if why_not:
                if r.name in named or r.restart != Replica.Restart.NONE:
                    skipped[r.name] = why_not
                continue
            why_stale = staleness(r, r.model, cluster)
            if stale and why_stale is None:
                if r.name in named:
                    skipped[r.name] = "not stale"
                continue
            claimed = Replica.objects.filter(
                pk=r.pk, restart=Replica.Restart.NONE, state__in=Replica.COUNTING, node__isnull=False
            ).update(restart=Replica.Restart.QUEUED)
            if not claimed:
                skipped[r.name] = "changed meanwhile; look again with: llmgw ctl replicas"
                continue
            queued.append(r.name)
            stale_note = f" (stale: {why_stale})" if why_stale else ""
            record(
                "replica.restart_queued", actor, f"replica {r.name} queued for restart{stale_note}", subject=r.name
            )
        if queued:
            kick_reconciler()
    return RestartQueued(queued, skipped)


def drain_node(name: str, actor: str, force: bool = False) -> Node:
    """The node takes no new replicas; its replicas are replaced elsewhere like a restart (one at a time per
    model, the replacement first). One with nowhere else to go keeps serving and the drain says it is
    blocked, unless `force`: then it drains (in-flight requests finish, up to the grace) and stops."""
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            raise NotFound(f"no node named {name!r}")
        if node.draining:
            if force and not node.drain_force:
                node.drain_force = True
                node.save(update_fields=["drain_force"])
                record(
                    "node.drain_forced", actor,
                    f"node {name} drain forced: a replica with nowhere else to go drains and stops", subject=name,
                )
                kick_reconciler()
                return node
            hint = "" if node.drain_force else "; --force stops the replicas that have nowhere else to go"
            raise OperationError(f"node {name} is already draining{hint}")
        count = node.replicas.filter(state__in=Replica.COUNTING).count()
        node.draining, node.drain_force, node.drain_note = True, force, ""
        node.save(update_fields=["draining", "drain_force", "drain_note"])
        message = (
            f"node {name} draining: it takes no new replicas; its {count} replica(s) are replaced elsewhere, "
            "one at a time per model, each serving until its replacement is ready"
        )
        if force:
            message += "; forced: a replica with nowhere else to go drains and stops"
        record("node.draining", actor, message, subject=name, force=force)
        kick_reconciler()
    return node


def undrain_node(name: str, actor: str) -> Node:
    """The node takes replicas again. Replicas still waiting to be moved off it stay where they are."""
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            raise NotFound(f"no node named {name!r}")
        if not node.draining:
            raise OperationError(f"node {name} is not draining")
        moving = node.replicas.filter(restart=Replica.Restart.REPLACING, state__in=Replica.COUNTING)
        kept = sorted(moving.values_list("name", flat=True))
        # Being replaced only because of the drain: they stay (a replacement already placed is then surplus).
        moving.update(restart=Replica.Restart.NONE)
        node.draining, node.drain_force, node.drain_note = False, False, ""
        node.save(update_fields=["draining", "drain_force", "drain_note"])
        message = f"node {name} undrained: it takes new replicas again"
        if kept:
            message += f"; {', '.join(kept)} stay(s) on it instead of moving"
        record("node.undrained", actor, message, subject=name)
        kick_reconciler()
    return node


def rotate_engine_key(actor: str) -> ClusterSettings:
    """A new engine key for replicas started from now on. Running replicas keep the old one until they are
    restarted (`restart --stale`); the gateway and the agents use each replica's own key meanwhile, so only
    one rotation at a time: refused while a replica still runs with the key before the current one."""
    import secrets

    with transaction.atomic():
        cluster = ClusterSettings.objects.select_for_update().get(pk=ClusterSettings.load().pk)
        running = Replica.objects.exclude(state__in=Replica.TERMINAL)
        if cluster.previous_engine_key:
            older = list(
                running.filter(snapshot__engine_key=ClusterSettings.fingerprint(cluster.previous_engine_key))
                .order_by("name")
                .values_list("name", flat=True)
            )
            if older:
                shown = ", ".join(older[:5]) + (", …" if len(older) > 5 else "")
                raise OperationError(
                    f"{len(older)} replica(s) still use the engine key before the current one ({shown}); "
                    "restart them first: llmgw ctl restart --stale"
                )
        keeping = running.filter(snapshot__engine_key=ClusterSettings.fingerprint(cluster.engine_key)).count()
        cluster.previous_engine_key = cluster.engine_key
        cluster.engine_key = "lek_" + secrets.token_urlsafe(32)
        cluster.save(update_fields=["engine_key", "previous_engine_key", "updated_at"])
        record(
            "engine_key.rotated",
            actor,
            f"engine key rotated: new replicas get the new key; {keeping} running replica(s) keep the old one "
            "until restarted (the gateway uses it for them meanwhile); restart them with: llmgw ctl restart --stale",
            stale=keeping,
        )
        kick_reconciler()
    return cluster
