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
keeps in its LLMGW_HOME (`control-plane-token`); they fetch from one another with it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import Count
from django.utils import timezone

from cluster import mirror
from cluster.events import record
from cluster.models import ControlPlane, FileCopy, ModelFile

log = logging.getLogger("llmgw.peers")
ALIVE = 60  # seconds: a control plane not heard from for longer is not asked for files
HEARTBEAT = 5.0  # seconds between a worker's heartbeats (its own thread: a long copy does not hold them up)
MISMATCH_PAUSE = 600.0  # seconds a peer that sent a file not matching its sha256 is not asked for it again
TIMEOUT = httpx.Timeout(60.0, connect=10.0)

_threads: list[threading.Thread] = []
_announced = float("-inf")  # when this process last wrote its row (monotonic)
_mismatched: dict[tuple[str, int], float] = {}  # (sha256, peer pk) -> when its copy failed the check
_unmatched: dict[str, tuple] = {}  # sha256 -> (inode, mtime, size) of a file on disk that failed the check


def token() -> str:
    return settings.CONTROL_PLANE_TOKEN


def hash_token(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def is_peer(value: str) -> bool:
    """A token another control plane (or this one) fetches model files with."""
    return bool(value) and value.startswith("lcp_") and ControlPlane.objects.filter(token_hash=hash_token(value)).exists()


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
    """This control plane's row, made or brought up to date (name, address, last seen)."""
    global _announced
    values = {"name": name(), "url": settings.LLMGW_CONTROL_PLANE_URL, "seen_at": timezone.now()}
    plane = ControlPlane.objects.update_or_create(token_hash=hash_token(token()), defaults=values)[0]
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
    """This control plane's mirror directory holds `model_file`, whole and checked (an import, a pull)."""
    FileCopy.objects.get_or_create(file=model_file, control_plane=me(), defaults={"verified_at": timezone.now()})


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
            with httpx.stream("GET", f"{peer.url}/mirror/{sha}", headers=headers, timeout=TIMEOUT) as response:
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
    here = me()
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
    if not getattr(_heartbeat, "retired", False):
        retire_former()
        _heartbeat.retired = True
    me()


def _every(seconds: float, work) -> None:
    while True:
        try:
            work()
        except Exception:  # the database or a peer away: the next round tries again
            log.exception("%s", work.__name__)
        finally:
            close_old_connections()
        time.sleep(seconds)
