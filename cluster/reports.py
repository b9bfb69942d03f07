"""The server's side of the agent stream: what an agent reports changes replicas; what it is told to run.

Each write an agent's word makes is tried again, whole, while SQLite says the database is locked
(cluster.dblock): a lock held long elsewhere delays a report, never loses it, and so never gets its node marked
lost."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from cluster.dblock import retry_on_lock
from cluster.events import kick_reconciler, record
from cluster.models import ClusterSettings, Event, Model, ModelFile, Node, Replica, Rollout
from ground import protocol

log = logging.getLogger("llmgw.agents")
S = Replica.State
FORWARD: dict[str, int] = {S.PENDING: 0, S.DOWNLOADING: 1, S.STARTING: 2, S.READY: 3}
FACTS_EVENT_INTERVAL = 60  # seconds: at most one `node.facts` Event per node this often


def node_for_token(token: str) -> Node | None:
    if not token:
        return None
    return Node.objects.filter(token_hash=Node.hash_token(token)).first()


@retry_on_lock
def connected(node: Node, address: str, stream: str = "") -> None:
    """The node's agent stream `stream` (its channel name) is up, from `address`: it takes the node over from any
    older stream. `node` is the row its token was just read as: where it was last seen decides whether the
    gateways reload (a newer stream of the same node racing this one at most reloads them once more)."""
    with transaction.atomic():
        if not Node.objects.filter(pk=node.pk).update(connected=True, last_seen=timezone.now(), address=address,
                                                      stream=stream):
            return  # removed meanwhile: its stream is closed by the removal
        # where gateways dial its engines (unless it advertises an address): a route moves only if it has replicas
        moved = node.address != address and _has_replicas(node.pk)
        record("node.connected", f"agent:{node.name}", f"node {node.name} connected from {address}", subject=node.name)
        kick_reconciler(routing=moved)
    node.connected, node.address, node.stream = True, address, stream


def _has_replicas(node_pk: int) -> bool:
    return Replica.objects.filter(node_id=node_pk).exclude(state__in=Replica.TERMINAL).exists()


def _of_stream(node_pk: int, stream: str | None):
    """The node's row, if `stream` is the stream that connected last (None: whichever it is)."""
    rows = Node.objects.filter(pk=node_pk)
    return rows if stream is None else rows.filter(stream=stream)


def _alive(node_pk: int, stream: str | None, now, name: str = "") -> None:
    """The node's stream said something: the node is seen now, and connected again (an Event) if it had been
    marked disconnected for its silence. An older stream's word changes neither: a newer one speaks for the
    node. In the caller's transaction."""
    rows = _of_stream(node_pk, stream)
    if rows.filter(connected=True).update(last_seen=now):
        return
    if rows.filter(connected=False).update(connected=True, last_seen=now):
        name = name or Node.objects.filter(pk=node_pk).values_list("name", flat=True).first() or f"#{node_pk}"
        record("node.connected", f"agent:{name}", f"node {name} connected again: its agent reports", subject=name)
        kick_reconciler(routing=False)


@retry_on_lock
def disconnected(node_pk: int, stream: str | None = None) -> None:
    """The node's stream `stream` closed: the node is disconnected, unless a newer stream has taken it over."""
    with transaction.atomic():
        node = Node.objects.filter(pk=node_pk).first()
        if node is None or not _of_stream(node_pk, stream).filter(connected=True).update(connected=False):
            return
        record("node.disconnected", f"agent:{node.name}", f"node {node.name}: agent stream closed", subject=node.name)
        kick_reconciler(routing=False)  # its engines go on serving: no route moves until the reconciler moves one


@retry_on_lock
def hello(node_pk: int, facts: object, replicas: list[protocol.ReplicaStatus], stream: str | None = None) -> None:
    now = timezone.now()
    clean = _clean_facts(facts)
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_pk)
        changed = node.facts != clean
        moved = (node.facts or {}).get("advertise_address") != clean.get("advertise_address") and _has_replicas(node.pk)
        node.facts = clean
        node.memory_bytes = clean["memory_bytes"]
        node.save(update_fields=["facts", "memory_bytes"])
        _alive(node.pk, stream, now, node.name)
        if changed:
            # At most one Event per node and interval: an agent saying hello with new facts again and again
            # (a bug, or a stolen token) must not flood the log. The facts themselves are always kept.
            since = now - timedelta(seconds=FACTS_EVENT_INTERVAL)
            if not Event.objects.filter(kind="node.facts", subject=node.name, created_at__gte=since).exists():
                engines = ", ".join(f"{k} {v}".strip() for k, v in sorted(clean["engines"].items())) or "none"
                record(
                    "node.facts",
                    f"agent:{node.name}",
                    f"node {node.name}: {clean['cpu_count']} CPUs, {clean['memory_bytes'] / 1024**3:.1f} GiB "
                    f"offered, {len(clean['gpus'])} GPU(s), engines: {engines}",
                    subject=node.name,
                )
            kick_reconciler(routing=moved)
        if replicas:  # in the same transaction: a bad replica list refuses the whole hello
            _statuses(node, replicas, full=False, now=now)


def _clean_facts(facts: object) -> protocol.Facts:
    if not isinstance(facts, dict):
        raise ValueError("facts must be an object")
    # Anything an agent sends wrong is a ValueError: the stream ignores the message instead of dying on it.
    try:
        gpus: list[protocol.Gpu] = [
            {"index": int(g.get("index", i)), "name": str(g.get("name", "")), "memory_bytes": int(g["memory_bytes"])}
            for i, g in enumerate(facts.get("gpus") or [])
        ]
        port_range = facts.get("port_range") or [20000, 20999]
        clean: protocol.Facts = {
            "hostname": str(facts.get("hostname", "")),
            "cpu_count": max(0, int(facts.get("cpu_count") or 0)),
            "memory_bytes": max(0, int(facts.get("memory_bytes") or 0)),
            "memory_total_bytes": max(0, int(facts.get("memory_total_bytes") or 0)),
            "gpus": gpus,
            "engines": {str(k): str(v or "") for k, v in (facts.get("engines") or {}).items()},
            "port_range": [int(port_range[0]), int(port_range[1])],
            "agent_version": str(facts.get("agent_version", "")),
        }
    except (AttributeError, IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed facts: {exc}") from None
    if not 1 <= clean["port_range"][0] <= clean["port_range"][1] <= 65535:
        raise ValueError(f"port_range {clean['port_range']} is not LOW <= HIGH within 1-65535")
    if facts.get("cpu_total_count") is not None:  # an agent of before --cpus does not say it
        try:
            clean["cpu_total_count"] = max(0, int(facts["cpu_total_count"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed facts: cpu_total_count: {exc}") from None
    address = str(facts.get("advertise_address") or "").strip()
    if address:
        if not protocol.is_address(address):
            raise ValueError(f"advertise_address {address[:100]!r} is not an IP address or host name")
        clean["advertise_address"] = address
    sizes = (clean["memory_bytes"], clean["memory_total_bytes"], *(g["memory_bytes"] for g in gpus))
    if not all(0 <= n < 2**63 for n in sizes):
        raise ValueError("memory sizes must be between 0 and 2**63 - 1")
    return clean


@retry_on_lock
def seen(node_pk: int, stream: str | None = None) -> None:
    """A report that says what the last one did: the node is alive, nothing else changed."""
    with transaction.atomic():
        _alive(node_pk, stream, timezone.now())


@retry_on_lock
def report(node_pk: int, statuses: list[protocol.ReplicaStatus], full: bool, stream: str | None = None) -> bool:
    """Apply an agent's report (from its stream `stream`). Returns True when the node's desired list is to be
    sent again (`_statuses`)."""
    now = timezone.now()
    with transaction.atomic():
        node = Node.objects.filter(pk=node_pk).first()
        if node is None:
            return False
        _alive(node_pk, stream, now, node.name)
        return _statuses(node, statuses, full, now)


UNHEARD = timedelta(seconds=10)  # a replica placed this long ago and not in its agent's full report: not told


def _statuses(node: Node, statuses: list[protocol.ReplicaStatus], full: bool, now) -> bool:
    """The replicas' states as the agent reports them (`full`: the list is all it runs); in the caller's
    transaction. True when the node's desired list is to be sent again: a replica left it, or one placed on the
    node UNHEARD ago or more is not in the agent's full report (the message telling it was lost on its way: the
    channel layer drops what waits past its expiry). A stream applies an unchanged report whole every 30 s
    (agents.consumers), so a lost message is made good within about that."""
    if not all(isinstance(s, dict) for s in statuses):
        raise ValueError("each replica status must be an object")
    terminal_change = False
    any_change = False
    actor = f"agent:{node.name}"
    rows = {r.name: r for r in Replica.objects.filter(node_id=node.pk).exclude(state__in=Replica.TERMINAL)}
    seen = set()
    for status in statuses:
        replica = rows.get(str(status.get("name")))
        if replica is None:
            continue  # not ours (any more): it is not in the desired list, so the agent stops it
        seen.add(replica.name)
        change = _apply(replica, status, now, actor)
        any_change |= change is not None
        terminal_change |= change in Replica.TERMINAL
    untold = []
    if full:
        for replica in rows.values():
            if replica.name not in seen and replica.state == S.STOPPING:
                if _set(replica, S.STOPPED, now, reason=replica.reason):
                    record("replica.stopped", actor, f"replica {replica.name} stopped", subject=replica.name)
                    any_change = terminal_change = True
            elif replica.name not in seen and replica.state == S.PENDING and now - replica.state_changed_at >= UNHEARD:
                untold.append(replica.name)
    if untold:
        log.warning("node %s does not run %s, placed on it %d s ago or more: its desired list sent again",
                    node.name, ", ".join(sorted(untold)), UNHEARD.seconds)
    if any_change:
        kick_reconciler()
    return terminal_change or bool(untold)


class _Raced(Exception):
    """The replica's state changed since it was read (the reconciler, an operation): decide again from the row."""


def _apply(replica: Replica, status: protocol.ReplicaStatus, now, actor: str) -> str | None:
    """The transition the agent's word asks for, decided from the replica's state as it is when written: each
    write is conditional on the state it was decided from, so a state the reconciler wrote meanwhile
    (`draining`, `stopping`) is never overwritten by a decision made before it."""
    for _ in range(5):
        try:
            return _transition(replica, status, now, actor)
        except _Raced:
            fresh = Replica.objects.filter(pk=replica.pk).exclude(state__in=Replica.TERMINAL).first()
            if fresh is None:
                return None  # over meanwhile (stopped, failed): nothing the agent says changes that
            replica = fresh
    log.warning("%s: replica %s kept changing under its report; the next report applies it", actor, replica.name)
    return None


def _set(replica: Replica, state: str, now, **fields) -> bool:
    """Move the replica from the state it was read in to `state`; False (nothing written) if it is no longer in
    that state."""
    updated = Replica.objects.filter(pk=replica.pk, state=replica.state).update(
        state=state, state_changed_at=now, **fields
    )
    if updated:
        replica.state, replica.state_changed_at = state, now
        for key, value in fields.items():
            setattr(replica, key, value)
    return bool(updated)


def _move(replica: Replica, state: str, now, **fields) -> None:
    if not _set(replica, state, now, **fields):
        raise _Raced()


def _transition(replica: Replica, status: protocol.ReplicaStatus, now, actor: str) -> str | None:
    """Move the replica as the agent says, where the lifecycle allows. Returns the new state if it changed."""
    new = status.get("state")
    if new not in protocol.AGENT_STATES:
        log.warning("%s reported unknown state %r for %s", actor, new, replica.name)
        return None
    extra: dict[str, int] = {}
    pid = status.get("pid")
    if pid and pid != replica.pid:
        extra["pid"] = int(pid)
        if not 0 < extra["pid"] < 2**31:  # the column's range; Linux pids stay far below it
            raise ValueError(f"pid {extra['pid']} out of range")
    if replica.state == S.STOPPING:
        if new in (S.STOPPED, S.FAILED):
            _move(replica, S.STOPPED, now, **extra)
            record("replica.stopped", actor, f"replica {replica.name} stopped", subject=replica.name)
            return S.STOPPED
        return None
    if new == S.STOPPED and status.get("on_purpose") is True:
        # stopped on purpose on the node (`llmgw up` stopping, `service stop --engines`): stopped, not a crash
        reason = str(status.get("reason") or "stopped on purpose on its node")[:500]
        _move(replica, S.STOPPED, now, reason=reason, **extra)
        record("replica.stopped", actor, f"replica {replica.name} stopped: {reason}", subject=replica.name)
        return S.STOPPED
    if new == S.FAILED or (new == S.STOPPED and replica.state != S.STOPPING):
        reason = str(status.get("reason") or "engine stopped without being asked")[:500]
        _move(replica, S.FAILED, now, reason=reason, log_tail=str(status.get("log_tail") or "")[-8000:], **extra)
        if replica.rollout_id is not None:  # a canary's engine: its rollout is rolled back, its model not held back
            Rollout.objects.filter(pk=replica.rollout_id).update(failures=F("failures") + 1)
        else:
            _back_off(replica.model_id, now)
            _promotion_failed(replica)
        record("replica.failed", actor, f"replica {replica.name} failed: {reason}", subject=replica.name)
        return S.FAILED
    if replica.state == S.DRAINING:
        return None  # a draining replica stays draining until it is stopped
    if FORWARD.get(new, -1) <= FORWARD.get(replica.state, -1):
        if extra:
            Replica.objects.filter(pk=replica.pk).exclude(state__in=Replica.TERMINAL).update(**extra)
        return None  # no going back (an adopted engine re-checking its health stays ready)
    _move(replica, new, now, reason="", **extra)
    if new == S.READY and replica.rollout_id is None:
        Model.objects.filter(pk=replica.model_id).update(failures=0, backoff_until=None)
    where = f" on port {replica.port}" if new == S.STARTING else ""
    record(f"replica.{new}", actor, f"replica {replica.name} {new}{where}", subject=replica.name)
    return new


def _promotion_failed(replica: Replica) -> None:
    """A replica's engine that failed on the new settings of its model's rollout being promoted: counted on the
    rollout, whose promotion goes back (cluster/operations/rollouts.py)."""
    rollout = Rollout.objects.filter(model_id=replica.model_id, state=Rollout.State.PROMOTING).select_related(
        "file", "profile", "engine").first()
    if rollout is not None and rollout.runs_new(replica.snapshot):
        Rollout.objects.filter(pk=rollout.pk, state=Rollout.State.PROMOTING).update(failures=F("failures") + 1)


def _back_off(model_id: int, now) -> None:
    model = Model.objects.select_for_update().get(pk=model_id)
    model.failures += 1
    delay = min(settings.LLMGW_BACKOFF_CAP, settings.LLMGW_BACKOFF_BASE * 2 ** (model.failures - 1))
    model.backoff_until = now + timedelta(seconds=delay)
    model.save(update_fields=["failures", "backoff_until"])


@retry_on_lock
def progress(node_pk: int, name: str, done: int, total: int) -> None:
    """Download progress; the first word of it moves a pending replica to downloading, however fast the rest is."""
    if not (0 <= int(done) < 2**63 and 0 <= int(total) < 2**63):
        raise ValueError(f"progress {done}/{total} out of range")
    with transaction.atomic():
        replica = Replica.objects.select_for_update().filter(node_id=node_pk, name=name).first()
        if replica is None:
            return
        replica.download_done, replica.download_total = int(done), int(total)
        fields = ["download_done", "download_total"]
        if replica.state == S.PENDING:
            replica.state, replica.state_changed_at = S.DOWNLOADING, timezone.now()
            fields += ["state", "state_changed_at"]
            node = replica.node
            assert node is not None  # read by its node
            record("replica.downloading", f"agent:{node.name}", f"replica {replica.name} downloading",
                   subject=replica.name)
        replica.save(update_fields=fields)


def desired(node_pk: int, mirror_base: str) -> protocol.Desired:
    """The complete list of replicas this node should run, with all it needs to run each."""
    rows = list(
        Replica.objects.filter(node_id=node_pk, state__in=Replica.RUNNING)
        .select_related("model__file", "model__engine", "model__profile")
        .order_by("name")
    )
    replicas: list[protocol.DesiredReplica] = []
    if not rows:  # a node with nothing to run (a new one): no key to read
        return {"type": "desired", "replicas": replicas}
    cluster = ClusterSettings.load()
    files = ModelFile.objects.in_bulk({(r.snapshot or {}).get("file") for r in rows} - {None}, field_name="sha256")
    # During a key rotation a replica keeps the key it started with (the snapshot's fingerprint names it).
    keys = {ClusterSettings.fingerprint(k): k for k in (cluster.engine_key, cluster.previous_engine_key) if k}
    for r in rows:
        if r.port is None:  # never: the reconciler takes a replica its port as it places it; not the node's others
            log.warning("replica %s is placed without a port: not sent to its agent", r.name)
            continue
        # A replica runs what it was started with; a new engine key or profile reaches it by restart.
        snap = r.snapshot or {}
        model_file = r.model.file
        if snap.get("file") and snap["file"] != model_file.sha256:  # a canary's, or its model's before a change
            model_file = files.get(snap["file"]) or model_file
        replicas.append(
            {
                "name": r.name,
                "model": r.model.name,
                "engine": snap.get("engine") or r.model.engine.spec(),
                "args": snap.get("args") or r.model.profile.args(),
                "file": {
                    "sha256": model_file.sha256,
                    "name": model_file.name,
                    "size": model_file.size,
                    "url": f"{mirror_base.rstrip('/')}/mirror/{model_file.sha256}",
                },
                "port": r.port,
                "gpu_index": r.gpu_index,
                "engine_key": keys.get(snap.get("engine_key") or "", cluster.engine_key),
            }
        )
    return {"type": "desired", "replicas": replicas}
