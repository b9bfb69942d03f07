"""`manage.py llmgw …`: each subcommand parses, calls one operation, prints."""

from __future__ import annotations

import json
import time

from django.conf import settings
from django.core.management.base import CommandError, CommandParser
from django.db.models import Count, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from cluster import operations
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica
from llmgw.cli.output import age, as_json, size, table

CLI_ACTOR = "cli"


class OneLineParser(CommandParser):
    """Argument errors are one line and exit code 1, like every other error."""

    def error(self, message):
        raise CommandError(f"{self.prog}: {message}")


def parse_size_arg(text: str) -> int:
    from agents.facts import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def server_url() -> str:
    import socket

    return settings.LLMGW_PUBLIC_URL or f"http://{socket.gethostname()}:8000"


# node


def node_add(o, out):
    node, token = operations.add_node(o["name"], CLI_ACTOR)
    server = o["server"] or server_url()
    out.write(f"node {node.name} added; its token (shown once): {token}\n")
    out.write(f"on that machine, run:\n  python manage.py llmgw agent --server {server} --token {token}\n")


def node_remove(o, out):
    operations.remove_node(o["name"], CLI_ACTOR, force=o["force"])
    out.write(f"node {o['name']} removed\n")


def node_token(o, out):
    node, token = operations.reset_node_token(o["name"], CLI_ACTOR)
    server = o["server"] or server_url()
    out.write(f"node {node.name}: new token (shown once; the old one no longer works): {token}\n")
    out.write(f"  python manage.py llmgw agent --server {server} --token {token}\n")


def nodes_list(o, out):
    now = timezone.now()
    nodes = Node.objects.annotate(
        running=Count("replicas", filter=Q(replicas__state__in=Replica.RUNNING)),
        left=Count("replicas", filter=~Q(replicas__state__in=Replica.TERMINAL)),
    )
    used = dict(
        Replica.objects.filter(state__in=Replica.RUNNING | {Replica.State.STOPPING}, node__isnull=False)
        .values_list("node_id")
        .annotate(n=_sum("memory_bytes"))
        .values_list("node_id", "n")
    )
    rows, data = [], []
    for n in nodes:
        alive = n.is_alive(now)
        status = "connected" if alive else ("never connected" if n.last_seen is None else "disconnected")
        drain = n.drain_state(n.left)
        if drain and n.drain_force and drain != "drained":
            drain += " (forced)"
        flags = [f for f, on in ((drain, bool(drain)), ("unschedulable", not n.schedulable)) if on]
        if n.drain_note and drain.startswith("blocked"):
            flags.append(f"- {n.drain_note}")
        gpus = ", ".join(size(g["memory_bytes"]) for g in n.gpus) or "-"
        engines = ", ".join(sorted(n.engines)) or "-"
        mem = f"{size(used.get(n.pk, 0))} / {size(n.memory_bytes)}"
        rows.append([n.name, status, age(n.last_seen, now), mem, gpus, n.running, engines, " ".join(flags)])
        data.append(
            {
                "name": n.name,
                "status": status,
                "last_seen": n.last_seen,
                "memory_used_bytes": used.get(n.pk, 0),
                "memory_bytes": n.memory_bytes,
                "gpus": n.gpus,
                "replicas": n.running,
                "engines": n.engines,
                "schedulable": n.schedulable,
                "draining": n.draining,
                "drain": n.drain_state(n.left) or None,
                "drain_force": n.drain_force,
                "drain_note": n.drain_note,
                "address": n.address,
            }
        )
    if o.get("json"):
        return as_json(data, out)
    table(["NAME", "STATUS", "SEEN", "MEMORY USED", "GPUS", "REPLICAS", "ENGINES", "FLAGS"], rows, out)


def _sum(field):
    from django.db.models import Sum

    return Sum(field)


# mirror


def mirror_import(o, out):
    model_file, created = operations.import_model_file(o["path"], CLI_ACTOR, name=o["name"])
    what = "imported" if created else "already in the mirror"
    facts = model_file.gguf
    extra = (
        f"; GGUF {facts.get('architecture', '?')}, {facts.get('block_count', '?')} layers, "
        f"context {facts.get('context_length', '?')}"
        if model_file.format == "gguf"
        else "; not GGUF"
    )
    out.write(f"{model_file.name} {what}: sha256 {model_file.sha256}, {size(model_file.size)}{extra}\n")


def mirror_list(o, out):
    files = ModelFile.objects.annotate(used_by=Count("models"))
    if o.get("json"):
        return as_json(
            [{"sha256": f.sha256, "name": f.name, "size": f.size, "format": f.format, "gguf": f.gguf} for f in files],
            out,
        )
    rows = [
        [f.sha256[:12], f.name, size(f.size), f.format, f.gguf.get("architecture", "-"), f.used_by] for f in files
    ]
    table(["SHA256", "NAME", "SIZE", "FORMAT", "ARCH", "MODELS"], rows, out)


# status


def status(o, out):
    s = operations.cluster_status()
    if o.get("json"):
        return as_json(s, out)
    stopped = s["serving"] == "stopped"
    out.write(
        "llmgw: STOPPED (every model held at zero replicas; /v1/ answers 503 until `llmgw start`)\n"
        if stopped
        else "llmgw: serving\n"
    )
    out.write(f"nodes: {s['nodes']['connected']} connected of {s['nodes']['total']}\n")
    states = s["replicas"]
    order = [st for st in Replica.State.values if st in states]
    shown = ", ".join(f"{states[st]} {st}" for st in order) or "none"
    out.write(f"replicas: {shown}\n")
    out.write(f"models: {len(s['models'])}\n")
    for m in s["models"]:
        note = " (removing)" if m["removing"] else (f" - {m['placement_note']}" if m["placement_note"] else "")
        out.write(f"  {m['name']}: {m['ready']}/{m['replicas']} ready{note}\n")


def system_stop(o, out):
    operations.stop_serving(CLI_ACTOR)
    out.write("llmgw stopped: every model goes to zero replicas and /v1/ answers 503 until `llmgw start`\n")


def system_start(o, out):
    operations.start_serving(CLI_ACTOR)
    out.write("llmgw started: models are placed again; watch with: llmgw ctl replicas\n")


def service_cmd(o, out):
    from llmgw.cli.service import service

    service(o, out)


def system_restart(o, out):
    from cluster import system

    out.write("restarting llmgw: every agent, then web, beat and worker processes; engines keep serving\n")
    out.flush()

    def report(line: str) -> None:
        out.write(f"  {line}\n")
        out.flush()

    result = system.restart_system(CLI_ACTOR, report, agent_timeout=o["timeout"], process_timeout=o["timeout"])
    if "timeout" in {*result["agents"].values(), *result["processes"].values()}:
        raise CommandError("some parts did not come back; see above and `llmgw ctl events`")


# user


def user_add(o, out):
    user, token = operations.add_user(o["name"], o["role"], CLI_ACTOR, password=o["password"])
    out.write(f"user {user.username} added as {o['role']}; API token (shown once): {token}\n")
    if not o["password"]:
        out.write("no password set: give --password to let this user log in to the dashboard\n")


# ctl: models


def models_list(o, out):
    models = Model.objects.select_related("file", "engine", "profile").annotate(
        ready=Count("replica_set", filter=Q(replica_set__state=Replica.State.READY)),
        running=Count("replica_set", filter=Q(replica_set__state__in=Replica.RUNNING)),
    )
    rows, data = [], []
    for m in models:
        note = "removing" if m.removing else m.placement_note
        rows.append(
            [m.name, m.file.name, m.engine.name, m.profile.name, m.replicas, m.ready, size(m.memory_estimate()), note]
        )
        data.append(
            {
                "name": m.name,
                "file": m.file.sha256,
                "engine": m.engine.name,
                "profile": m.profile.name,
                "replicas": m.replicas,
                "ready": m.ready,
                "running": m.running,
                "memory_bytes": m.memory_estimate(),
                "removing": m.removing,
                "note": m.placement_note,
            }
        )
    if o.get("json"):
        return as_json(data, out)
    table(["NAME", "FILE", "ENGINE", "PROFILE", "WANT", "READY", "MEMORY", "NOTE"], rows, out)


def model_add(o, out):
    model = operations.add_model(
        o["name"],
        CLI_ACTOR,
        file=o["file"],
        engine=o["engine"],
        profile=o["profile"],
        replicas=o["replicas"],
        memory_bytes=parse_size_arg(o["memory"]) if o["memory"] else None,
        nodes=o["nodes"] or [],
        wait_seconds=o["wait"],
    )
    out.write(
        f"model {model.name} added: {model.replicas} replica(s) of {model.file.name} on {model.engine.name}, "
        f"{size(model.memory_estimate())} each; watch with: llmgw ctl replicas --model {model.name}\n"
    )


def model_set(o, out):
    values = {
        k: o[k] for k in ("replicas", "engine", "profile", "file", "nodes") if o.get(k) is not None
    }
    if o.get("wait") is not None:
        values["wait_seconds"] = o["wait"]
    if o.get("memory") is not None:
        values["memory_bytes"] = 0 if o["memory"] in ("auto", "0") else parse_size_arg(o["memory"])
    if not values:
        raise CommandError("nothing to change: give --replicas, --profile, --engine, --file, --memory, --nodes or --wait")
    model = operations.set_model(o["name"], CLI_ACTOR, **values)
    out.write(f"model {model.name}: {model.replicas} replica(s), profile {model.profile.name}, engine {model.engine.name}\n")


def model_remove(o, out):
    operations.remove_model(o["name"], CLI_ACTOR)
    out.write(f"model {o['name']} removed: its replicas are stopping; watch with: llmgw ctl replicas\n")


# ctl: replicas


def replica_note(r: Replica, stale: str | None = None) -> str:
    notes = []
    if r.restart != Replica.Restart.NONE and r.state not in Replica.TERMINAL:
        notes.append(f"(restart {r.restart})")
    if stale:
        notes.append(f"(stale: {stale})")
    if r.state == Replica.State.DOWNLOADING and r.download_total:
        notes.append(f"{100 * r.download_done // r.download_total}% of {size(r.download_total)}")
    if r.reason:
        notes.append(r.reason)
    return " ".join(notes)


def replicas_list(o, out):
    from cluster.models import ClusterSettings

    cluster = ClusterSettings.load()
    qs = Replica.objects.select_related("model__profile", "model__engine", "model__file", "node")
    if o.get("model"):
        if not Model.objects.filter(name=o["model"]).exists():
            raise CommandError(f"no model named {o['model']!r}")
        qs = qs.filter(model__name=o["model"])
    if o.get("node"):
        if not Node.objects.filter(name=o["node"]).exists():
            raise CommandError(f"no node named {o['node']!r}")
        qs = qs.filter(node__name=o["node"])
    if not o.get("all"):
        qs = qs.exclude(state__in=Replica.TERMINAL) | qs.filter(
            state=Replica.State.FAILED, state_changed_at__gte=timezone.now() - timezone.timedelta(minutes=10)
        )
    now = timezone.now()
    qs = qs.order_by("model__name", "created_at")
    if o.get("json"):
        return as_json(
            [
                {
                    "name": r.name,
                    "model": r.model.name,
                    "node": r.node.name if r.node else None,
                    "state": r.state,
                    "restart": r.restart,
                    "stale": operations.staleness(r, r.model, cluster),
                    "port": r.port,
                    "pid": r.pid,
                    "reason": r.reason,
                    "created_at": r.created_at,
                }
                for r in qs
            ],
            out,
        )
    rows = [
        [r.name, r.model.name, r.node.name if r.node else "-", r.state, r.port or "-", age(r.created_at, now),
         replica_note(r, operations.staleness(r, r.model, cluster))]
        for r in qs
    ]
    table(["NAME", "MODEL", "NODE", "STATE", "PORT", "AGE", "NOTE"], rows, out)


# ctl: profiles and engines


def _profile_values(o) -> dict:
    values = {}
    for key in ("context_size", "threads", "gpu_layers", "batch_size", "parallel"):
        if o.get(key) is not None:
            values[key] = o[key]
    if o.get("extra") is not None:
        import shlex

        values["extra_args"] = shlex.split(o["extra"])
    return values


def profiles_list(o, out):
    profiles = Profile.objects.annotate(used_by=Count("models"))
    if o.get("json"):
        return as_json([{"name": p.name, **p.args(), "models": p.used_by} for p in profiles], out)
    rows = [
        [p.name, p.context_size, p.threads or "auto", p.gpu_layers if p.gpu_layers is not None else "-",
         p.batch_size or "-", p.parallel, " ".join(p.extra_args) or "-", p.used_by]
        for p in profiles
    ]
    table(["NAME", "CONTEXT", "THREADS", "GPU LAYERS", "BATCH", "PARALLEL", "EXTRA", "MODELS"], rows, out)


def profile_add(o, out):
    profile = operations.add_profile(o["name"], CLI_ACTOR, **_profile_values(o))
    out.write(f"profile {profile.name} added\n")


def profile_set(o, out):
    values = _profile_values(o)
    if not values:
        raise CommandError("nothing to change: give --context-size, --threads, --gpu-layers, --batch-size, --parallel or --extra")
    profile = operations.set_profile(o["name"], CLI_ACTOR, **values)
    out.write(f"profile {profile.name} edited; running replicas keep their arguments until restarted\n")


def profile_remove(o, out):
    operations.remove_profile(o["name"], CLI_ACTOR)
    out.write(f"profile {o['name']} removed\n")


def engines_list(o, out):
    engines = EngineVersion.objects.annotate(used_by=Count("models"))
    if o.get("json"):
        return as_json([{**e.spec(), "models": e.used_by} for e in engines], out)
    rows = [[e.name, e.kind, e.version or "-", e.device, e.binary or e.command or "(on PATH)", e.used_by] for e in engines]
    table(["NAME", "KIND", "VERSION", "DEVICE", "BINARY / COMMAND", "MODELS"], rows, out)


def engine_add(o, out):
    engine = operations.add_engine(
        o["name"], o["kind"], CLI_ACTOR, version=o["version"], device=o["device"], binary=o["binary"], command=o["command"]
    )
    out.write(f"engine {engine.name} ({engine.kind}, {engine.device}) added\n")


# ctl: keys and usage


def _when(text: str | None, flag: str):
    if not text:
        return None
    from datetime import date, datetime, time as dtime

    when = parse_datetime(text)
    if when is None:
        try:
            when = datetime.combine(date.fromisoformat(text), dtime.min)
        except ValueError:
            raise CommandError(f"{flag} wants a date like 2026-12-31 or 2026-12-31T18:00:00Z, not {text!r}") from None
    return timezone.make_aware(when) if timezone.is_naive(when) else when


def keys_create(o, out):
    key, secret = operations.create_key(
        o["name"], CLI_ACTOR, models=o["models"] or [], rpm=o["rpm"], tpm=o["tpm"],
        expires_at=_when(o["expires"], "--expires"),
    )
    out.write(f"key {key.name} created; the key (shown once, keep it): {secret}\n")


def keys_list(o, out):
    from gateway.models import ApiKey

    keys = ApiKey.objects.all()
    now = timezone.now()
    data = [
        {
            "name": k.name, "prefix": k.prefix, "models": k.allowed_models, "rpm": k.rpm, "tpm": k.tpm,
            "expires_at": k.expires_at, "revoked_at": k.revoked_at, "last_used_at": k.last_used_at,
        }
        for k in keys
    ]
    if o.get("json"):
        return as_json(data, out)
    rows = [
        [k.name, k.prefix + "…", ", ".join(k.allowed_models) or "all", k.rpm or "-", k.tpm or "-",
         f"{k.expires_at:%Y-%m-%d %H:%M}" if k.expires_at else "never",
         "revoked" if k.revoked_at else ("expired" if k.expires_at and k.expires_at <= now else "active"),
         age(k.last_used_at, now) + (" ago" if k.last_used_at else "")]
        for k in keys
    ]
    table(["NAME", "PREFIX", "MODELS", "RPM", "TPM", "EXPIRES", "STATE", "LAST USED"], rows, out)


def keys_revoke(o, out):
    operations.revoke_key(o["name"], CLI_ACTOR)
    out.write(f"key {o['name']} revoked\n")


def usage_list(o, out):
    rows = operations.usage_report(key=o["key"], model=o["model"], since=_when(o["since"], "--since"))
    if o.get("json"):
        return as_json(rows, out)
    table(
        ["HOUR", "KEY", "MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS"],
        [[f"{r['hour']:%Y-%m-%d %H:00}", r["key"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"]] for r in rows],
        out,
    )


# ctl: engine key


def engine_key_show(o, out):
    from cluster.models import ClusterSettings

    out.write(ClusterSettings.load().engine_key + "\n")


def engine_key_rotate(o, out):
    from cluster.models import ClusterSettings

    cluster = operations.rotate_engine_key(CLI_ACTOR)
    fingerprint = ClusterSettings.fingerprint(cluster.engine_key)
    out.write(
        f"engine key rotated (fingerprint {fingerprint}); running replicas keep the old key until restarted: "
        "llmgw ctl restart --stale\n"
    )


# ctl: settings


def settings_show_or_set(o, out):
    from cluster.models import ClusterSettings

    if o["drain_grace"] is not None or o["reconcile_interval"] is not None:
        cluster = operations.set_settings(
            CLI_ACTOR, drain_grace_seconds=o["drain_grace"], reconcile_interval_seconds=o["reconcile_interval"]
        )
    else:
        cluster = ClusterSettings.load()
    shown = {
        "drain_grace_seconds": cluster.drain_grace_seconds,
        "reconcile_interval_seconds": cluster.reconcile_interval_seconds,
        "serving_stopped": cluster.serving_stopped,
        "engine_key_fingerprint": ClusterSettings.fingerprint(cluster.engine_key),
    }
    if o["json"]:
        out.write(json.dumps(shown) + "\n")
        return
    for key, value in shown.items():
        out.write(f"{key.replace('_', ' ')}: {value}\n")


# ctl: restart and drain


def restart(o, out):
    queued = operations.restart_replicas(
        CLI_ACTOR, replicas=o["replicas"], models=o["model"] or [], all=o["all"], stale=o["stale"]
    )
    for name, why in queued.skipped.items():
        out.write(f"{name}: {why}; nothing to do\n")
    out.write(f"{len(queued)} replica(s) queued for restart; watch with: llmgw ctl replicas\n")


def drain(o, out):
    node = operations.drain_node(o["name"], CLI_ACTOR, force=o["force"])
    forced = "; forced: a replica with nowhere else to go drains and stops" if node.drain_force else ""
    out.write(
        f"node {node.name} draining: its replicas are replaced elsewhere, one at a time per model{forced}; "
        "watch with: llmgw ctl nodes\n"
    )


def undrain(o, out):
    operations.undrain_node(o["name"], CLI_ACTOR)
    out.write(f"node {o['name']} undrained: it takes new replicas again\n")


# ctl: events


def events_list(o, out):
    qs = Event.objects.all()
    if o.get("kind"):
        qs = qs.filter(kind__startswith=o["kind"])
    if o.get("subject"):
        qs = qs.filter(subject=o["subject"])
    if o.get("since"):
        since = parse_datetime(o["since"])
        if since is None:
            raise CommandError(f"--since wants an ISO date and time such as 2026-11-29T12:00:00Z, not {o['since']!r}")
        if timezone.is_naive(since):
            since = timezone.make_aware(since)
        qs = qs.filter(created_at__gte=since)
    events = list(qs.order_by("-id")[: o["limit"]])[::-1]
    if o.get("json"):
        if o.get("follow"):
            raise CommandError("--json and --follow do not go together")
        return as_json([{"id": e.pk, "at": e.created_at, "kind": e.kind, "actor": e.actor, "subject": e.subject,
                         "message": e.message, "data": e.data} for e in events], out)
    for e in events:
        _print_event(e, out)
    if not o.get("follow"):
        return
    last = events[-1].pk if events else (Event.objects.order_by("-id").values_list("id", flat=True).first() or 0)
    try:
        while True:
            time.sleep(1)
            for e in qs.filter(pk__gt=last).order_by("id"):
                _print_event(e, out)
                last = e.pk
            out.flush()
    except KeyboardInterrupt:
        return


def _print_event(e: Event, out) -> None:
    out.write(f"{e.created_at:%Y-%m-%d %H:%M:%S}  {e.kind:<20} {e.actor:<16} {e.message}\n")


def build(parser) -> None:
    """The whole `llmgw` command tree."""
    from llmgw.cli.agent import agent as agent_cmd
    from llmgw.cli.up import up

    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")

    p = sub.add_parser("up", help="run the whole system on this machine (web, worker, beat, agent, embedded Valkey)")
    p.add_argument("--port", type=int, default=8000, help="where web listens (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address web binds (default 127.0.0.1)")
    p.add_argument("--server", choices=("daphne", "uvicorn"), default=None,
                   help="the web server (default LLMGW_WEB_SERVER, else uvicorn)")
    p.add_argument("--no-demo", action="store_true", help="do not define the SmolLM2 demo model on first run")
    p.add_argument("--no-agent", action="store_true", help="run no local agent (a control-plane-only machine)")
    p.add_argument("--agent-memory", default=None, help="RAM the local agent offers, e.g. 4GiB (default: all)")
    p.set_defaults(func=up)

    p = sub.add_parser("agent", help="run this machine's agent")
    p.add_argument("--server", required=True, help="the control plane's URL, e.g. http://10.0.0.1:8000")
    p.add_argument("--token", default="", help="the node token from `llmgw node add` (or LLMGW_AGENT_TOKEN)")
    p.add_argument("--state-dir", default=None, help="where engines are recorded and files cached")
    p.add_argument("--memory", default=None, help="RAM to offer, e.g. 8GiB (default: all of it)")
    p.add_argument("--gpus", default=None, help="GPUs to offer: sizes like 24GiB,24GiB, or none (default: nvidia-smi)")
    p.add_argument("--port-range", default="20000-20999", help="ports engines may listen on (default 20000-20999)")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL (default 10)")
    p.set_defaults(func=agent_cmd)

    node = sub.add_parser("node", help="add or remove nodes").add_subparsers(
        dest="node_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = node.add_parser("add", help="add a node; prints its token and agent command")
    p.add_argument("name")
    p.add_argument("--server", default="", help="the URL agents dial, for the printed command")
    p.set_defaults(func=node_add)
    p = node.add_parser("remove", help="remove a node")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="even if it still has replicas (they are replaced elsewhere)")
    p.set_defaults(func=node_remove)
    p = node.add_parser("token", help="give a node a new token (the old one stops working)")
    p.add_argument("name")
    p.add_argument("--server", default="")
    p.set_defaults(func=node_token)
    p = node.add_parser("list", help="list nodes (same as ctl nodes)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=nodes_list)

    mirror = sub.add_parser("mirror", help="model files").add_subparsers(
        dest="mirror_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = mirror.add_parser("import", help="add a model file to the mirror")
    p.add_argument("path")
    p.add_argument("--name", default=None, help="name to list it by (default: the file's name)")
    p.set_defaults(func=mirror_import)
    p = mirror.add_parser("list", help="list model files")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=mirror_list)

    p = sub.add_parser("status", help="the cluster's summary")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=status)

    p = sub.add_parser("stop", help="stop serving: every model to zero replicas, /v1/ answers 503")
    p.set_defaults(func=system_stop)
    p = sub.add_parser("start", help="serve again after stop")
    p.set_defaults(func=system_start)
    svc = sub.add_parser("service", help="this machine's llmgw systemd units").add_subparsers(
        dest="action", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    for action, text in (("status", "each unit's state"), ("start", "start units in dependency order"),
                         ("stop", "stop units in reverse order"), ("restart", "stop, then start")):
        p = svc.add_parser(action, help=text)
        p.add_argument("parts", nargs="*", metavar="PART",
                       help="web, worker, beat, agent (default: every installed one)")
        if action in ("stop", "restart"):
            p.add_argument("--engines", action="store_true", help="also stop the engines the agent started")
        p.set_defaults(func=service_cmd)
    p = svc.add_parser("install", help="write and enable the systemd units")
    p.add_argument("--role", choices=["control", "agent", "all"], default="control",
                   help="control: web, worker, beat; agent: the agent; all: both (default control)")
    p.add_argument("--server", default=None, help="the control plane's URL (for the agent unit)")
    p.add_argument("--user", default=None, help="the user the units run as (default: the one running sudo)")
    p.add_argument("--host", default="0.0.0.0", help="where web listens (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="web's port (default 8000)")
    p.add_argument("--web-server", choices=["uvicorn", "daphne"], default=None, help="default LLMGW_WEB_SERVER")
    p.set_defaults(func=service_cmd)

    p = sub.add_parser("restart", help="restart every agent, then the control plane; engines keep serving")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds each part may take to come back (default 60)")
    p.set_defaults(func=system_restart)

    user = sub.add_parser("user", help="users").add_subparsers(
        dest="user_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = user.add_parser("add", help="add a user; prints an API token")
    p.add_argument("name")
    p.add_argument("--role", required=True, choices=operations.ROLES)
    p.add_argument("--password", default=None, help="for the dashboard (at least 8 characters)")
    p.set_defaults(func=user_add)

    ctl = sub.add_parser("ctl", help="look at and change the cluster").add_subparsers(
        dest="ctl_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = ctl.add_parser("nodes", help="list nodes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=nodes_list)
    p = ctl.add_parser("models", help="list models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=models_list)
    p = ctl.add_parser("replicas", help="list replicas")
    p.add_argument("--model", default=None)
    p.add_argument("--node", default=None)
    p.add_argument("--all", action="store_true", help="include stopped and old failed replicas")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=replicas_list)
    p = ctl.add_parser("profiles", help="list profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=profiles_list)
    p = ctl.add_parser("engines", help="list engines")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=engines_list)
    p = ctl.add_parser("events", help="the event log, oldest first")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--kind", default=None, help="only kinds starting with this, e.g. replica.")
    p.add_argument("--subject", default=None)
    p.add_argument("--since", default=None, help="ISO date and time")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=events_list)

    model = ctl.add_parser("model", help="add, change or remove a model").add_subparsers(
        dest="model_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = model.add_parser("add", help="define a model")
    p.add_argument("name")
    p.add_argument("--file", required=True, help="sha256 (or 8+ digit prefix), file name in the mirror, or a path")
    p.add_argument("--engine", required=True, help="engine name, see ctl engines")
    p.add_argument("--profile", default="default")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--memory", default=None, help="memory per replica, e.g. 6GiB (default: estimated)")
    p.add_argument("--nodes", nargs="+", default=None, help="only these nodes")
    p.add_argument("--wait", type=int, default=None, help="seconds the gateway waits for a replica")
    p.set_defaults(func=model_add)
    p = model.add_parser("set", help="change a model")
    p.add_argument("name")
    p.add_argument("--replicas", type=int)
    p.add_argument("--profile")
    p.add_argument("--engine")
    p.add_argument("--file")
    p.add_argument("--memory", help="e.g. 6GiB, or auto")
    p.add_argument("--nodes", nargs="*")
    p.add_argument("--wait", type=int)
    p.set_defaults(func=model_set)
    p = model.add_parser("remove", help="stop all its replicas and remove it")
    p.add_argument("name")
    p.set_defaults(func=model_remove)

    profile = ctl.add_parser("profile", help="add, change or remove a profile").add_subparsers(
        dest="profile_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    for action, func in (("add", profile_add), ("set", profile_set)):
        p = profile.add_parser(action, help=f"{action} a profile")
        p.add_argument("name")
        p.add_argument("--context-size", type=int)
        p.add_argument("--threads", type=int)
        p.add_argument("--gpu-layers", type=int)
        p.add_argument("--batch-size", type=int)
        p.add_argument("--parallel", type=int)
        p.add_argument("--extra", help="extra engine flags, as one quoted string")
        p.set_defaults(func=func)
    p = profile.add_parser("remove", help="remove an unused profile")
    p.add_argument("name")
    p.set_defaults(func=profile_remove)

    key = ctl.add_parser("engine-key", help="the key every engine requires").add_subparsers(
        dest="key_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = key.add_parser("show", help="print the engine key (to talk to an engine directly)")
    p.set_defaults(func=engine_key_show)
    p = key.add_parser("rotate", help="a new engine key; running replicas keep the old one until restarted")
    p.set_defaults(func=engine_key_rotate)

    p = ctl.add_parser("settings", help="show or change the cluster settings (drain grace, reconcile interval)")
    p.add_argument("--drain-grace", type=int, default=None, metavar="SECONDS",
                   help="how long a draining replica gets for requests in flight")
    p.add_argument("--reconcile-interval", type=int, default=None, metavar="SECONDS",
                   help="how often the reconciler runs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=settings_show_or_set)

    p = ctl.add_parser(
        "restart", help="replace replicas without taking them out of service first (one at a time per model)"
    )
    p.add_argument("replicas", nargs="*", metavar="REPLICA")
    p.add_argument("--model", action="append", default=None, help="every replica of this model (repeatable)")
    p.add_argument("--all", action="store_true", help="every replica")
    p.add_argument("--stale", action="store_true", help="only replicas started with older settings")
    p.set_defaults(func=restart)
    p = ctl.add_parser("drain", help="move a node's replicas elsewhere; it takes no new ones")
    p.add_argument("name", metavar="NODE")
    p.add_argument("--force", action="store_true", help="a replica with nowhere else to go drains and stops")
    p.set_defaults(func=drain)
    p = ctl.add_parser("undrain", help="let a drained node take replicas again")
    p.add_argument("name", metavar="NODE")
    p.set_defaults(func=undrain)

    keys = ctl.add_parser("keys", help="client keys for /v1/").add_subparsers(
        dest="keys_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = keys.add_parser("create", help="create a key; prints it once")
    p.add_argument("name")
    p.add_argument("--models", nargs="+", default=None, help="only these models (default: all)")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=int, default=None, help="tokens per minute")
    p.add_argument("--expires", default=None, help="date (and time) it stops working")
    p.set_defaults(func=keys_create)
    p = keys.add_parser("list", help="list keys")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=keys_list)
    p = keys.add_parser("revoke", help="revoke a key")
    p.add_argument("name")
    p.set_defaults(func=keys_revoke)

    p = ctl.add_parser("usage", help="tokens per key, model and hour")
    p.add_argument("--key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--since", default=None, help="date (and time)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=usage_list)

    engine = ctl.add_parser("engine", help="add an engine").add_subparsers(
        dest="engine_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = engine.add_parser("add", help="add an engine version")
    p.add_argument("name")
    p.add_argument("--kind", required=True, help="llama.cpp, xllamacpp, vllm or command")
    p.add_argument("--version", default="")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--binary", default="", help="path to the engine binary on the nodes (default: on PATH)")
    p.add_argument("--command", default="", help="for kind command: a template with {port}, {model_path}, …")
    p.set_defaults(func=engine_add)
