"""Control planes (cluster/peers.py): forgotten, or given a new token. Listing them is a read (`peers.listed`).

A new token is made by the control plane that keeps it, since it lives in that one's LLMGW_HOME: where the command
runs on it, at once; for another, the command asks and that one's worker makes it at its next heartbeat. Its old
token works until then, so nothing fetching with it is cut off midway by a token the others already refuse while
it still shows the old one; `remove` is what cuts a control plane off at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from cluster import peers
from cluster.errors import Conflict, NotFound
from cluster.events import record
from cluster.models import ControlPlane, FileCopy, ModelFile, RevokedControlPlaneToken


@dataclass(frozen=True)
class Removal:
    name: str
    files: int  # copies it held, forgotten with it
    orphaned: list[str]  # names of the files it alone held: now on no control plane the others can fetch from
    alive: bool  # heard from lately: it still runs, and is cut off from the others' mirrors


@dataclass(frozen=True)
class Rotation:
    plane: ControlPlane
    now: bool  # made at once (the command ran on it); else asked, for its worker's next heartbeat


def _named(name: str) -> ControlPlane:
    planes = list(peers.listed().filter(name=name)[:3])
    if not planes:
        raise NotFound(f"no control plane named {name!r} (see llmgw control-plane list)")
    if len(planes) > 1:
        raise Conflict(f"several control planes are named {name!r} ({', '.join(p.url or 'no URL' for p in planes)}): "
                       "give each its own LLMGW_CONTROL_PLANE_NAME")
    return planes[0]


def remove_control_plane(name: str, actor: str, force: bool = False) -> Removal:
    """Forget a control plane: its token no longer opens /mirror (revoked, so it cannot record itself again), and
    what it said it held goes. The one the command runs on only with `force`: it would cut its own mirror off."""
    plane = _named(name)
    if peers.is_this(plane) and not force:
        raise Conflict(f"control plane {name} is the one this runs on: removed, it could no longer fetch model files "
                       "from the others nor they from it; stop it and remove it from another control plane, or "
                       "give --force")
    with transaction.atomic():
        held = list(FileCopy.objects.filter(control_plane=plane).values_list("file_id", flat=True))
        elsewhere = FileCopy.objects.exclude(control_plane=plane).values("file_id")
        orphaned = sorted(ModelFile.objects.filter(pk__in=held).exclude(pk__in=elsewhere)
                          .values_list("name", flat=True))
        if not ControlPlane.objects.filter(pk=plane.pk, token_hash=plane.token_hash).delete()[0]:
            raise Conflict(f"control plane {name} was removed or given a new token meanwhile")
        RevokedControlPlaneToken.objects.get_or_create(token_hash=plane.token_hash, defaults={"name": plane.name})
        alive = peers.alive(plane)
        record("control_plane.removed", actor, f"control plane {name} removed: its token no longer opens /mirror; "
               f"the {len(held)} file(s) it held forgotten", subject=name, files=len(held), orphaned=orphaned,
               alive=alive)
    return Removal(name=name, files=len(held), orphaned=orphaned, alive=alive)


def rotate_control_plane_token(name: str, actor: str) -> Rotation:
    """A new token for a control plane, made by that control plane (the module's doc). Run on a removed one, under
    its own name: it joins again under a new token."""
    try:
        plane = _named(name)
    except NotFound:
        if name != peers.name() or peers.is_peer(peers.token()):
            raise
        return Rotation(peers.listed().get(pk=peers.rotate_own(actor).pk), now=True)
    if peers.is_this(plane):
        return Rotation(peers.listed().get(pk=peers.rotate_own(actor).pk), now=True)
    with transaction.atomic():
        if not ControlPlane.objects.filter(pk=plane.pk, token_hash=plane.token_hash).update(
                rotation_asked_at=timezone.now()):
            raise Conflict(f"control plane {name} was removed or given a new token meanwhile")
        record("control_plane.token_asked", actor, f"control plane {name}: a new token asked for; its worker makes it "
               "at its next heartbeat, and its old token works until then", subject=name)
    return Rotation(peers.listed().get(pk=plane.pk), now=False)
