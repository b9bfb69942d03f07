"""Nodes: added (with the token their agent dials in with), given a new token, removed."""

from __future__ import annotations

import shlex

from django.db import transaction
from django.utils import timezone

from cluster import notify
from cluster.errors import Conflict
from cluster.events import kick_reconciler, record
from cluster.models import Node, Replica
from cluster.operations.validation import check_name, created, get_named


def agent_command(server: str, token: str) -> str:
    """What to run on a node for its agent: the token in the environment, where `ps` does not show it to every
    user of the machine (the `llmgw` program of `pip install llmgw`, or of the wheel built from a checkout)."""
    return f"LLMGW_AGENT_TOKEN={shlex.quote(token)} llmgw agent --server {shlex.quote(server)}"


def add_node(name: str, actor: str) -> tuple[Node, str]:
    check_name("node", name)
    token = Node.new_token()
    with transaction.atomic():
        if Node.objects.filter(name=name).exists():
            raise Conflict(f"a node named {name!r} already exists")
        node = created(f"a node named {name!r} already exists",
                       lambda: Node.objects.create(name=name, token_hash=Node.hash_token(token)))
        record("node.added", actor, f"node {name} added", subject=name)
    return node, token


def reset_node_token(name: str, actor: str) -> tuple[Node, str]:
    token = Node.new_token()
    with transaction.atomic():
        node = get_named(Node, "node", name)
        node.token_hash = Node.hash_token(token)
        node.save(update_fields=["token_hash"])
        record("node.token_reset", actor, f"node {name}: new agent token", subject=name)
    notify.close_agent_streams([node.pk])
    return node, token


def remove_node(name: str, actor: str, force: bool = False) -> None:
    now = timezone.now()
    with transaction.atomic():
        node = get_named(Node, "node", name)
        running = list(node.replicas.exclude(state__in=Replica.TERMINAL).values_list("name", "state"))
        if running and not force:
            raise Conflict(
                f"node {name} still has {len(running)} replica(s) ({', '.join(n for n, _ in running[:5])}); "
                "scale them away first or use --force"
            )
        failed = []
        for replica_name, state in running:  # each from the state it was read in: one that ended meanwhile stays so
            if Replica.objects.filter(name=replica_name, node=node, state=state).update(
                state=Replica.State.FAILED, reason=f"node {name} removed", state_changed_at=now
            ):
                record("replica.failed", actor, f"replica {replica_name} lost: node {name} removed",
                       subject=replica_name)
                failed.append(replica_name)
        node_pk = node.pk
        if not Node.objects.filter(pk=node_pk, name=name).delete()[0]:
            raise Conflict(f"node {name} was removed meanwhile")
        record("node.removed", actor, f"node {name} removed", subject=name, replicas=failed)
        kick_reconciler()
    notify.close_agent_streams([node_pk])



def replicas_stopped_on_purpose(names: list[str], actor: str, why: str) -> list[str]:
    """Replicas whose engines were stopped on purpose on their node (`llmgw up` stopping): stopped, not failed,
    whether or not the node's agent comes back to say so. Returns those it changed."""
    now = timezone.now()
    changed = []
    with transaction.atomic():
        for name, state in Replica.objects.filter(name__in=names, state__in=Replica.RUNNING).values_list("name", "state"):
            if Replica.objects.filter(name=name, state=state).update(state=Replica.State.STOPPED, reason=why[:500],
                                                                      state_changed_at=now):
                record("replica.stopped", actor, f"replica {name} stopped: {why}", subject=name)
                changed.append(name)
        if changed:
            kick_reconciler()
    return changed
