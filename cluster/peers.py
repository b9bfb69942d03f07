"""Model files on every control plane.

Each control plane keeps its own mirror directory (MIRROR_DIR, files named by sha256) and says in the database
which files it holds, whole and checked (`FileCopy`). Its worker looks every LLMGW_MIRROR_SYNC seconds
(`sync_once`, from a thread of the worker's main process, so a long copy holds no task slot) and

- takes back what its disk has lost (a copy that is gone or of the wrong size: the row is deleted, an Event said),
- adopts what its disk holds and the database does not say (checked against the sha256 first),
- pulls each file it lacks from a control plane that holds it: `/mirror/<sha256>` as the agents download,
  resumed with Range where a partial copy was left, checked against the sha256 before it counts.

Until a file is here, `/mirror/<sha256>` streams it from a control plane that holds it (agents.mirror_views).
So a file imported through any control plane reaches every one within seconds of its size, and losing one
control plane, its disk included, loses no file another holds. Control planes know each other by the token each
keeps in its LLMGW_HOME (`control-plane-token`); they fetch from one another with it, over https where their URLs
say so, checking certificates against LLMGW_CONTROL_PLANE_CA (else the public CAs).

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
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import Count, Exists, OuterRef
from django.utils import timezone

from cluster import mirror
from cluster.errors import OperationError
from cluster.events import record
from cluster.models import ControlPlane, FileCopy, ModelFile, RevokedControlPlaneToken

log = logging.getLogger("llmgw.peers")
ALIVE = 60  # seconds: a control plane not heard from for longer is not asked for files
HEARTBEAT = 5.0  # seconds between a worker's heartbeats (its own thread: a long copy does not hold them up)
MISMATCH_PAUSE = 600.0  # seconds a peer that sent a file not matching its sha256 is not asked for it again
TIMEOUT = httpx.Timeout(60.0, connect=10.0)

_threads: list[threading.Thread] = []
_announced = float("-inf")  # when this process last wrote its row (monotonic)
_mismatched: dict[tuple[str, int], float] = {}  # (sha256, peer pk) -> when its copy failed the check
_unmatched: dict[str, tuple] = {}  # sha256 -> (inode, mtime, size) of a file on disk that failed the check
TOKEN_FILE = "control-plane-token"  # in LLMGW_HOME (llmgw.home.control_plane_token makes it)
_read: tuple[tuple, str] = ((), "")  # the token file as last read (path, inode, mtime, size), and its token
_said_removed = ""  # the token this process last said was revoked: said once, not at every heartbeat
_ca: tuple[tuple, ssl.SSLContext | None] = ((), None)  # LLMGW_CONTROL_PLANE_CA as last loaded


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
        raise PullFailed(f"LLMGW_CONTROL_PLANE_CA {cafile}: {getattr(exc, 'strerror', None) or exc}") from None
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


def held_here(model_file: ModelFile) -> None:
    """This control plane's mirror directory holds `model_file`, whole and checked (an import, a pull). A removed
    control plane records nothing: it counts it when it joins again (its look adopts what its disk holds)."""
    try:
        here = me()
    except Removed as exc:
        log.warning("%s; %s is not recorded as held here", exc, model_file.sha256[:12])
        return
    FileCopy.objects.get_or_create(file=model_file, control_plane=here, defaults={"verified_at": timezone.now()})


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


def sources(sha256: str) -> list[ControlPlane]:
    """The other control planes that hold the file and were heard from lately, the freshest first."""
    since = timezone.now() - timedelta(seconds=ALIVE)
    return list(ControlPlane.objects.filter(copies__file__sha256=sha256, seen_at__gte=since).exclude(url="")
                .exclude(token_hash=hash_token(token())).order_by("-seen_at"))


def alive(plane: ControlPlane) -> bool:
    return plane.seen_at >= timezone.now() - timedelta(seconds=ALIVE)


def listed():
    """Every control plane with how many files its mirror holds (`mirror ls`, the API, the dashboard)."""
    return ControlPlane.objects.annotate(files=Count("copies")).order_by("name", "pk")


def whole(model_file: ModelFile) -> bool:
    try:
        return model_file.path.stat().st_size == model_file.size
    except OSError:
        return False


class PullFailed(Exception):
    pass


class Mismatch(PullFailed):
    pass


def pull(model_file: ModelFile) -> str | None:
    """Copy `model_file` into this mirror from a control plane that holds it; the name of that one, or None when
    none could give it (or another process here is pulling it)."""
    for peer in sources(model_file.sha256):
        if time.monotonic() - _mismatched.get((model_file.sha256, peer.pk), float("-inf")) < MISMATCH_PAUSE:
            continue
        try:
            if not _fetch(peer, model_file):
                return None
        except Mismatch as exc:
            _mismatched[(model_file.sha256, peer.pk)] = time.monotonic()
            log.warning("pulling %s from %s: %s; not asked again for %d s", model_file.sha256[:12], peer.name, exc,
                        MISMATCH_PAUSE)
            continue
        except (httpx.HTTPError, OSError, PullFailed) as exc:
            log.warning("pulling %s from %s: %s", model_file.sha256[:12], peer.name, exc)
            continue
        with transaction.atomic():
            held_here(model_file)
            here = name()
            record("file.copied", f"control-plane:{here}", f"file {model_file.name} ({model_file.sha256[:12]}) "
                   f"copied to {here} from {peer.name}", subject=model_file.sha256[:12], source=peer.name)
        return peer.name
    return None


def _fetch(peer: ControlPlane, model_file: ModelFile) -> bool:
    """Download into `.pull-<sha256>` (resumed where an earlier pull stopped), check, and move into place. False
    when another process of this control plane holds the partial file, or has pulled the file meanwhile."""
    sha, size = model_file.sha256, model_file.size
    settings.MIRROR_DIR.mkdir(parents=True, exist_ok=True)
    part = settings.MIRROR_DIR / f".pull-{sha}"
    with open(part, "ab") as out:
        try:
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if whole(model_file) and FileCopy.objects.filter(file=model_file, control_plane__token_hash=hash_token(
                token())).exists():  # another process of this control plane was quicker
            part.unlink(missing_ok=True)
            return False
        have = out.tell()
        if have > size:
            out.truncate(0)
            have = 0
        if mirror.free_bytes() < size - have:
            raise PullFailed(f"{size - have} more bytes do not fit in {settings.MIRROR_DIR}")
        if have < size or size == 0:
            headers = {"Authorization": f"Bearer {token()}", **({"Range": f"bytes={have}-"} if have else {})}
            with httpx.stream("GET", f"{peer.url}/mirror/{sha}", headers=headers, timeout=TIMEOUT,
                              verify=verify()) as response:
                if response.status_code == 200:
                    out.truncate(0)
                    out.seek(0)
                elif response.status_code != 206 or not response.headers.get("content-range", "").startswith(
                        f"bytes {have}-"):
                    raise PullFailed(f"HTTP {response.status_code} from {peer.url}")
                for chunk in response.iter_bytes(mirror.CHUNK):
                    out.write(chunk)
            out.flush()
        got = mirror.sha256_of(part)
        if got != sha:
            part.unlink(missing_ok=True)
            raise Mismatch(f"sha256 mismatch: got {got}")
        os.chmod(part, 0o600)  # as an imported file is
        os.replace(part, model_file.path)
    return True


def sync_once() -> None:
    """One look (the module's doc): what this control plane's disk lost, holds, and lacks."""
    try:
        here = me()
    except Removed:
        return  # not one of the control planes now (its heartbeat says so)
    actor = f"control-plane:{here.name}"
    held = set(FileCopy.objects.filter(control_plane=here).values_list("file__sha256", flat=True))
    lacking = []
    for model_file in ModelFile.objects.all():
        on_disk = whole(model_file)
        if model_file.sha256 in held and not on_disk:
            with transaction.atomic():
                if FileCopy.objects.filter(file=model_file, control_plane=here).delete()[0]:
                    record("file.lost", actor, f"file {model_file.name} ({model_file.sha256[:12]}) is gone from "
                           f"the mirror of {here.name}", subject=model_file.sha256[:12])
            lacking.append(model_file)
        elif model_file.sha256 not in held and on_disk:
            if not _adopt(model_file):
                lacking.append(model_file)  # a pull replaces what failed the check
        elif not on_disk:
            lacking.append(model_file)
    for model_file in lacking:
        pull(model_file)


def _adopt(model_file: ModelFile) -> bool:
    """A file on disk the database does not say this control plane holds: held, once checked. One that fails the
    check is left where it is (a pull replaces it) and not read again until it changes."""
    try:
        st = model_file.path.stat()
    except OSError:
        return False
    seen = (st.st_ino, st.st_mtime_ns, st.st_size)
    if _unmatched.get(model_file.sha256) == seen:
        return False
    if mirror.sha256_of(model_file.path) == model_file.sha256:
        _unmatched.pop(model_file.sha256, None)
        held_here(model_file)
        return True
    _unmatched[model_file.sha256] = seen
    log.warning("%s in the mirror does not match its sha256: not counted as held here", model_file.sha256[:12])
    return False


def start() -> None:
    """From the worker's main process (once): its heartbeat every HEARTBEAT seconds, and its look every
    LLMGW_MIRROR_SYNC seconds (0: none), each on a daemon thread of its own."""
    if _threads:
        return
    _threads.append(threading.Thread(target=_every, args=(HEARTBEAT, _heartbeat), name="llmgw-peer", daemon=True))
    if settings.LLMGW_MIRROR_SYNC > 0:
        _threads.append(threading.Thread(target=_every, args=(settings.LLMGW_MIRROR_SYNC, sync_once),
                                         name="llmgw-mirror", daemon=True))
    for thread in _threads:
        thread.start()


def _heartbeat() -> None:
    """This control plane heard from; a new token made where one was asked for through another control plane."""
    global _said_removed
    try:
        if not getattr(_heartbeat, "retired", False):
            retire_former()
            _heartbeat.retired = True
        plane = me()
    except Removed as exc:
        if _said_removed != token():
            log.warning("%s", exc)
            _said_removed = token()
        return
    if plane.rotation_asked_at is not None:
        rotate_own(f"control-plane:{plane.name}")


def _every(seconds: float, work) -> None:
    while True:
        try:
            work()
        except Exception:  # the database or a peer away: the next round tries again
            log.exception("%s", work.__name__)
        finally:
            close_old_connections()
        time.sleep(seconds)
