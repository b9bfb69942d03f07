"""The control planes: how each knows itself and the others.

Every control plane has a row (ControlPlane: its name, the URL the others reach it at, when it was last heard
from), kept up to date by its worker's heartbeat (`start`) and by a web process before it fetches from another
(`announce`). Control planes know each other by the token each keeps in its LLMGW_HOME (`control-plane-token`);
they fetch model files from one another with it (cluster.mirror), over https where their URLs say so, checking
certificates against LLMGW_CONTROL_PLANE_CA (else the public CAs).

A token is revoked when its control plane is removed or given a new one (cluster.operations.control_planes): the
hash goes to RevokedControlPlaneToken, so no process still holding it can record it again. A new token is made
by the control plane that keeps it (`rotate_own`): at once where the command runs on it, else by its worker at its
next heartbeat. Every process reads the token file again when it changes, so the whole control plane shows the new
token from its next request on; a download under way was let in when it began and goes on to its end.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import Count, Exists, OuterRef
from django.utils import timezone

from cluster.errors import OperationError
from cluster.events import record
from cluster.models import ControlPlane, RevokedControlPlaneToken

log = logging.getLogger("llmgw.peers")
ALIVE = 60  # seconds: a control plane not heard from for longer is not asked for files
HEARTBEAT = 5.0  # seconds between a worker's heartbeats (its own thread: a long copy does not hold them up)
TIMEOUT = httpx.Timeout(60.0, connect=10.0)

_threads: list[threading.Thread] = []
_announced = float("-inf")  # when this process last wrote its row (monotonic)
TOKEN_FILE = "control-plane-token"  # in LLMGW_HOME (llmgw.home.control_plane_token makes it)
_read: tuple[tuple, str] = ((), "")  # the token file as last read (path, inode, mtime, size), and its token
_said_removed = ""  # the token this process last said was revoked: said once, not at every heartbeat
_retired = False  # whether this process's heartbeat has retired this control plane's former rows (once)
_ca: tuple[tuple, ssl.SSLContext | None] = ((), None)  # LLMGW_CONTROL_PLANE_CA as last loaded


class Unverifiable(Exception):
    """LLMGW_CONTROL_PLANE_CA cannot be read: no peer is fetched from, rather than one unchecked."""


class Removed(Exception):
    """This control plane's token was revoked (`llmgw control-plane remove`): it is not recorded under it again."""


def token() -> str:
    """This control plane's token as its file in LLMGW_HOME holds it now, read again whenever the file changes (a
    new token written there is what every process of this control plane shows from then on); where there is no
    file, the one the settings read at start."""
    global _read
    path = Path(settings.LLMGW_HOME) / TOKEN_FILE
    try:
        st = path.stat()
        seen = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
        if _read[0] != seen:
            _read = (seen, path.read_text().strip())
    except OSError:
        return settings.CONTROL_PLANE_TOKEN
    return _read[1] or settings.CONTROL_PLANE_TOKEN


def hash_token(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _revoked(hashed: str) -> bool:
    return RevokedControlPlaneToken.objects.filter(token_hash=hashed).exists()


def is_peer(value: str) -> bool:
    """A token another control plane (or this one) fetches model files with: recorded, and not revoked."""
    if not (value and value.startswith("lcp_")):
        return False
    revoked = RevokedControlPlaneToken.objects.filter(token_hash=OuterRef("token_hash"))
    return ControlPlane.objects.filter(token_hash=hash_token(value)).exclude(Exists(revoked)).exists()


def is_this(plane: ControlPlane) -> bool:
    """Whether `plane` is the control plane this process belongs to (the one a command runs on)."""
    return plane.token_hash == hash_token(token())


def verify() -> ssl.SSLContext | bool:
    """What a peer's https certificate is checked against: LLMGW_CONTROL_PLANE_CA (a PEM file of the CA that signed
    the control planes' certificates; read again when it changes), else the public CAs httpx knows (certifi's,
    or SSL_CERT_FILE's). Never unchecked."""
    global _ca
    cafile = settings.LLMGW_CONTROL_PLANE_CA
    if not cafile:
        return True
    try:
        st = os.stat(cafile)
        seen = (cafile, st.st_ino, st.st_mtime_ns, st.st_size)
        if _ca[0] != seen:
            _ca = (seen, ssl.create_default_context(cafile=cafile))
    except (OSError, ssl.SSLError) as exc:
        raise Unverifiable(f"LLMGW_CONTROL_PLANE_CA {cafile}: {getattr(exc, 'strerror', None) or exc}") from None
    assert _ca[1] is not None
    return _ca[1]


def name() -> str:
    """LLMGW_CONTROL_PLANE_NAME, else this host's name with the port of LLMGW_CONTROL_PLANE_URL (two control
    planes on one host stay apart)."""
    if settings.LLMGW_CONTROL_PLANE_NAME:
        return settings.LLMGW_CONTROL_PLANE_NAME
    try:
        port = urlsplit(settings.LLMGW_CONTROL_PLANE_URL).port if settings.LLMGW_CONTROL_PLANE_URL else None
    except ValueError:
        port = None
    host = socket.gethostname()
    return f"{host}:{port}" if port else host


def me() -> ControlPlane:
    """This control plane's row, made or brought up to date (name, address, last seen). Removed where its token
    was revoked: a row is never made again for a revoked token, even by a process that read it just before."""
    global _announced
    hashed = hash_token(token())
    values = {"name": name(), "url": settings.LLMGW_CONTROL_PLANE_URL, "seen_at": timezone.now()}
    plane = ControlPlane.objects.filter(token_hash=hashed).first()
    if plane is not None:
        ControlPlane.objects.filter(pk=plane.pk).update(**values)
        for field, value in values.items():
            setattr(plane, field, value)
    else:
        removed = Removed(f"control plane {values['name']} was removed (its token no longer opens /mirror): "
                          f"`llmgw control-plane token {values['name']}` on this machine makes it a new one")
        if _revoked(hashed):
            raise removed
        plane = ControlPlane.objects.get_or_create(token_hash=hashed, defaults=values)[0]
        if _revoked(hashed):  # revoked between the two looks: the row just made goes again
            ControlPlane.objects.filter(pk=plane.pk).delete()
            raise removed
    _announced = time.monotonic()
    return plane


def announce() -> None:
    """`me`, unless this process said so lately: what a web process does before it fetches from a peer."""
    if time.monotonic() - _announced > HEARTBEAT:
        me()


def retire_former() -> None:
    """Rows of this same control plane (its name and address) under another token: its LLMGW_HOME made anew, a
    lost disk. What they said it held is gone with them."""
    here = me()
    with transaction.atomic():
        former = list(ControlPlane.objects.filter(name=here.name, url=here.url).exclude(pk=here.pk)
                      .select_for_update())
        for plane in former:
            plane.delete()
            record("control_plane.replaced", f"control-plane:{here.name}", f"control plane {here.name} started "
                   "with a new token (a new LLMGW_HOME): its former record and the files it said it held forgotten",
                   subject=here.name)


def new_token() -> str:
    return "lcp_" + secrets.token_urlsafe(32)  # as llmgw.home.control_plane_token makes the first


def rotate_own(actor: str) -> ControlPlane:
    """A new token for this control plane: its record moved to it and the former one revoked, in one transaction
    that writes the new token file in LLMGW_HOME before it commits (the former file is put back should the commit
    fail). A removed control plane joins again under it. Under a lock on LLMGW_HOME, so that two rotations here (a
    command, and the worker's heartbeat obeying one asked for elsewhere) run one after the other."""
    home = Path(settings.LLMGW_HOME)
    if not home.is_dir():
        raise OperationError(f"no LLMGW_HOME at {home}: this control plane's token is kept there")
    lock = os.open(home, os.O_RDONLY)  # the directory itself: no lock file to own
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        former, new, here = token(), new_token(), name()
        try:
            with transaction.atomic():
                plane = ControlPlane.objects.select_for_update().filter(token_hash=hash_token(former)).first()
                if plane is not None:
                    ControlPlane.objects.filter(pk=plane.pk).update(token_hash=hash_token(new), rotation_asked_at=None)
                RevokedControlPlaneToken.objects.get_or_create(token_hash=hash_token(former),
                                                               defaults={"name": plane.name if plane else here})
                said = "a new token; the former one no longer opens /mirror" if plane else (
                    "a new token, and joins the control planes again (it had been removed)")
                record("control_plane.token_rotated", actor, f"control plane {here}: {said}", subject=here)
                _write_token(home, new)
        except BaseException:
            if token() == new:
                _write_token(home, former)
            raise
    except OSError as exc:
        raise OperationError(f"cannot write a new token to {home / TOKEN_FILE}: {exc.strerror or exc} (run this as "
                             "the user the control plane runs as)") from None
    finally:
        os.close(lock)
    return me()


def _write_token(home: Path, value: str) -> None:
    """The token file replaced whole (mode 0600, its owner kept): a process reading it sees the former token or the
    new one."""
    fd, temporary = tempfile.mkstemp(dir=home, prefix=f".{TOKEN_FILE}.")
    try:
        with os.fdopen(fd, "w") as out:
            try:
                owner = (home / TOKEN_FILE).stat()
                if os.geteuid() == 0 and owner.st_uid != 0:  # root's command: the file stays the units' user's
                    os.fchown(out.fileno(), owner.st_uid, owner.st_gid)
            except FileNotFoundError:
                pass
            out.write(value)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, home / TOKEN_FILE)
    finally:
        Path(temporary).unlink(missing_ok=True)


def alive(plane: ControlPlane) -> bool:
    return plane.seen_at >= timezone.now() - timedelta(seconds=ALIVE)


def listed():
    """Every control plane with how many files its mirror holds (`mirror ls`, the API, the dashboard)."""
    return ControlPlane.objects.annotate(files=Count("copies")).order_by("name", "pk")


def start() -> None:
    """From the worker's main process (once): its heartbeat every HEARTBEAT seconds, on a daemon thread of its own
    (the mirror's look has its own: cluster.mirror.sync.start)."""
    if not _threads:
        _threads.append(every(HEARTBEAT, _heartbeat, "llmgw-peer"))


def every(seconds: float, work: Callable[[], object], thread_name: str) -> threading.Thread:
    """`work` now and every `seconds` after, on a daemon thread started here."""
    thread = threading.Thread(target=_every, args=(seconds, work), name=thread_name, daemon=True)
    thread.start()
    return thread


def _heartbeat() -> None:
    """This control plane heard from; a new token made where one was asked for through another control plane."""
    global _said_removed, _retired
    try:
        if not _retired:
            retire_former()
            _retired = True
        plane = me()
    except Removed as exc:
        if _said_removed != token():
            log.warning("%s", exc)
            _said_removed = token()
        return
    if plane.rotation_asked_at is not None:
        rotate_own(f"control-plane:{plane.name}")


def _every(seconds: float, work: Callable[[], object]) -> None:
    while True:
        try:
            work()
        except Exception:  # the database or a peer away: the next round tries again
            log.exception("%s", work.__name__)
        finally:
            close_old_connections()
        time.sleep(seconds)
