"""Model files on every control plane.

Each control plane keeps its own mirror directory (MIRROR_DIR, files named by sha256) and says in the database
which files it holds, whole and checked (`FileCopy`). Its worker looks every LLMGW_MIRROR_SYNC seconds
(`sync_once`, from a thread of the worker's main process, so a long copy holds no task slot) and

- takes back what its disk has lost (a copy that is gone or of the wrong size: the row is deleted, an Event said),
- adopts what its disk holds and the database does not say (checked against the sha256 first),
- pulls each file it lacks from a control plane that holds it: `/mirror/<sha256>` as the agents download,
  resumed with Range where a partial copy was left, checked against the sha256 before it counts.

Until a file is here, `/mirror/<sha256>` streams it from a control plane that holds it (cluster.mirror.serving).
So a file imported through any control plane reaches every one within seconds of its size, and losing one
control plane, its disk included, loses no file another holds. The control planes fetch from one another with
their tokens (cluster.peers).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from datetime import timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cluster import peers
from cluster.events import record
from cluster.mirror import store
from cluster.models import ControlPlane, FileCopy, ModelFile

log = logging.getLogger("llmgw.peers")
MISMATCH_PAUSE = 600.0  # seconds a peer that sent a file not matching its sha256 is not asked for it again

_threads: list[threading.Thread] = []
_mismatched: dict[tuple[str, int], float] = {}  # (sha256, peer pk) -> when its copy failed the check
_unmatched: dict[str, tuple[int, int, int]] = {}  # sha256 -> (inode, mtime, size) of a file that failed the check


class PullFailed(Exception):
    pass


class Mismatch(PullFailed):
    pass


def held_here(model_file: ModelFile) -> None:
    """This control plane's mirror directory holds `model_file`, whole and checked (an import, a pull). A removed
    control plane records nothing: it counts it when it joins again (its look adopts what its disk holds)."""
    try:
        here = peers.me()
    except peers.Removed as exc:
        log.warning("%s; %s is not recorded as held here", exc, model_file.sha256[:12])
        return
    FileCopy.objects.get_or_create(file=model_file, control_plane=here, defaults={"verified_at": timezone.now()})


def sources(sha256: str) -> list[ControlPlane]:
    """The other control planes that hold the file and were heard from lately, the freshest first."""
    since = timezone.now() - timedelta(seconds=peers.ALIVE)
    return list(ControlPlane.objects.filter(copies__file__sha256=sha256, seen_at__gte=since).exclude(url="")
                .exclude(token_hash=peers.hash_token(peers.token())).order_by("-seen_at"))


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
        except (httpx.HTTPError, OSError, PullFailed, peers.Unverifiable) as exc:
            log.warning("pulling %s from %s: %s", model_file.sha256[:12], peer.name, exc)
            continue
        with transaction.atomic():
            held_here(model_file)
            here = peers.name()
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
        if store.whole(model_file) and FileCopy.objects.filter(file=model_file, control_plane__token_hash=(
                peers.hash_token(peers.token()))).exists():  # another process of this control plane was quicker
            part.unlink(missing_ok=True)
            return False
        have = out.tell()
        if have > size:
            out.truncate(0)
            have = 0
        if store.free_bytes() < size - have:
            raise PullFailed(f"{size - have} more bytes do not fit in {settings.MIRROR_DIR}")
        if have < size or size == 0:
            headers = {"Authorization": f"Bearer {peers.token()}", **({"Range": f"bytes={have}-"} if have else {})}
            with httpx.stream("GET", f"{peer.url}/mirror/{sha}", headers=headers, timeout=peers.TIMEOUT,
                              verify=peers.verify()) as response:
                if response.status_code == 200:
                    out.truncate(0)
                    out.seek(0)
                elif response.status_code != 206 or not response.headers.get("content-range", "").startswith(
                        f"bytes {have}-"):
                    raise PullFailed(f"HTTP {response.status_code} from {peer.url}")
                for chunk in response.iter_bytes(store.CHUNK):
                    out.write(chunk)
            out.flush()
        got = store.sha256_of(part)
        if got != sha:
            part.unlink(missing_ok=True)
            raise Mismatch(f"sha256 mismatch: got {got}")
        os.chmod(part, 0o600)  # as an imported file is
        os.replace(part, model_file.path)
    return True


def sync_once() -> None:
    """One look (the module's doc): what this control plane's disk lost, holds, and lacks."""
    try:
        here = peers.me()
    except peers.Removed:
        return  # not one of the control planes now (its heartbeat says so)
    actor = f"control-plane:{here.name}"
    held = set(FileCopy.objects.filter(control_plane=here).values_list("file__sha256", flat=True))
    lacking = []
    for model_file in ModelFile.objects.all():
        on_disk = store.whole(model_file)
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
    if store.sha256_of(model_file.path) == model_file.sha256:
        _unmatched.pop(model_file.sha256, None)
        held_here(model_file)
        return True
    _unmatched[model_file.sha256] = seen
    log.warning("%s in the mirror does not match its sha256: not counted as held here", model_file.sha256[:12])
    return False


def start() -> None:
    """From the worker's main process (once, after cluster.peers.start): its look every LLMGW_MIRROR_SYNC seconds
    (0: none), on a daemon thread of its own."""
    if not _threads and settings.LLMGW_MIRROR_SYNC > 0:
        _threads.append(peers.every(settings.LLMGW_MIRROR_SYNC, sync_once, "llmgw-mirror"))
