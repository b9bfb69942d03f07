"""What a GET of `/mirror/<sha256>` is given, as the view (agents.mirror_views) answers it: the bytes its Range
asks for from this control plane's copy, or, while this one does not hold the file yet, another's answer relayed
as it comes (cluster.mirror.sync pulls it here meanwhile)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from asgiref.sync import sync_to_async

from cluster import peers
from cluster.mirror import store, sync
from cluster.models import ModelFile

log = logging.getLogger("llmgw.peers")
CHUNK = 1024 * 1024
RANGE_RE = re.compile(r"^bytes=([0-9]{1,19})-([0-9]{0,19})$", re.ASCII)  # 19 digits hold any file size
RELAYED = ("Content-Length", "Content-Range", "Accept-Ranges", "X-Sha256")  # a peer's headers passed on


@dataclass(frozen=True)
class Span:
    """Bytes `start` to `end` (both in; `end` is start - 1 for none) of a file of `size` bytes; `partial` where a
    Range asked for them (206), else the whole file (200)."""

    start: int
    end: int
    size: int
    partial: bool

    @property
    def length(self) -> int:
        return max(0, self.end - self.start + 1)

    @property
    def content_range(self) -> str:
        return f"bytes {self.start}-{self.end}/{self.size}"


@dataclass(frozen=True)
class Missing:
    """No such file, or held by no control plane that answers (404)."""

    detail: str


@dataclass(frozen=True)
class Unsatisfiable:
    """A Range this file has no bytes for (416, `Content-Range: bytes */size`)."""

    size: int


@dataclass(frozen=True)
class Local:
    """The bytes of `span` from this control plane's copy."""

    path: Path
    sha256: str
    span: Span


@dataclass(frozen=True)
class Relayed:
    """Another control plane's answer (200, 206 or 416), its headers named in RELAYED and its body passed on."""

    peer: str
    status: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]


Served = Missing | Unsatisfiable | Local | Relayed


def byte_range(requested: str, size: int) -> Span | None:
    """The Range rule: no header, the whole file; `bytes=first-` or `bytes=first-last` (cut at the end), those
    bytes; None where nothing can be given: another form, a first byte past the end (of an empty file too), or
    a range backwards."""
    if not requested:
        return Span(0, size - 1, size, partial=False)
    match = RANGE_RE.match(requested.strip())
    first = int(match.group(1)) if match else size
    last = int(match.group(2)) if match and match.group(2) else size - 1
    if first >= size or last < first:
        return None
    return Span(first, min(last, size - 1), size, partial=True)


async def serve(sha256: str, requested: str, relay: bool) -> Served:
    """What a GET of the file with the Range header `requested` ("" for none) is given. A file not here (yet) comes
    from a control plane that holds it, unless `relay` is False: a peer's own request is not passed on (no
    loops)."""
    model_file = await ModelFile.objects.filter(sha256=sha256).afirst()
    if model_file is None:
        return Missing(f"no file {sha256} in the mirror")
    if not await asyncio.to_thread(store.whole, model_file):
        relayed = await from_peer(sha256, requested) if relay else None
        return relayed or Missing(f"file {sha256} is on no control plane that answers")
    span = byte_range(requested, model_file.size)
    return Unsatisfiable(model_file.size) if span is None else Local(model_file.path, sha256, span)


async def read(path: Path, span: Span) -> AsyncIterator[bytes]:
    """The span's bytes from the file, in chunks of CHUNK, each read off the event loop."""
    with open(path, "rb") as f:
        f.seek(span.start)
        left = span.length
        while left > 0:
            data = await asyncio.to_thread(f.read, min(CHUNK, left))
            if not data:
                break
            left -= len(data)
            yield data


async def from_peer(sha256: str, requested: str) -> Relayed | None:
    """The file from the first control plane that holds it and answers, as it answers; None when none does."""
    headers = {"Authorization": f"Bearer {peers.token()}"}
    if requested:
        headers["Range"] = requested
    try:
        await sync_to_async(peers.announce)()  # known to the others by its token before it shows it
        verify = peers.verify()
    except (peers.Removed, peers.Unverifiable) as exc:  # removed: the others would refuse its token anyway
        log.warning("not streaming %s from another control plane: %s", sha256[:12], exc)
        return None
    for peer in await sync_to_async(sync.sources)(sha256):
        client = httpx.AsyncClient(timeout=peers.TIMEOUT, verify=verify)
        try:
            upstream = await client.send(client.build_request("GET", f"{peer.url}/mirror/{sha256}", headers=headers),
                                         stream=True)
        except httpx.HTTPError:
            await client.aclose()
            continue
        if upstream.status_code not in (200, 206, 416):
            await upstream.aclose()
            await client.aclose()
            continue
        passed = {name: upstream.headers[name] for name in RELAYED if name in upstream.headers}
        return Relayed(peer.name, upstream.status_code, passed, _relayed(client, upstream))
    return None


async def _relayed(client: httpx.AsyncClient, upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw(CHUNK):
            yield chunk
    finally:
        await upstream.aclose()
        await client.aclose()
