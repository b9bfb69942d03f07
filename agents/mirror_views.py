"""`/mirror/<sha256>`: model files for agents, with HTTP Range so an interrupted download resumes. The agents'
second door on the server, beside their stream (agents.consumers). A file this control plane does not hold yet
is streamed from one that does (cluster/peers.py), Range and all."""

import asyncio
import logging
import re

import httpx
from asgiref.sync import sync_to_async
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from cluster import peers
from cluster.models import ModelFile
from cluster.reports import node_for_token
from cluster.roles import can_change

log = logging.getLogger("llmgw.peers")
CHUNK = 1024 * 1024
RANGE_RE = re.compile(r"^bytes=([0-9]{1,19})-([0-9]{0,19})$", re.ASCII)  # 19 digits hold any file size


def _allowed(request) -> str | None:
    """Who may fetch: agents with their node token ("node"), the other control planes with theirs ("peer"),
    people who may change the cluster ("user"). Viewers do not fetch model files."""
    auth = request.headers.get("Authorization", "")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if bearer and node_for_token(bearer) is not None:
        return "node"
    if bearer and peers.is_peer(bearer):
        return "peer"
    return "user" if can_change(request.user) else None


async def _chunks(path, start: int, length: int):
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left > 0:
            data = await asyncio.to_thread(f.read, min(CHUNK, left))
            if not data:
                break
            left -= len(data)
            yield data


RELAYED = ("Content-Length", "Content-Range", "Accept-Ranges", "X-Sha256")


async def _relayed(client: httpx.AsyncClient, upstream: httpx.Response):
    try:
        async for chunk in upstream.aiter_raw(CHUNK):
            yield chunk
    finally:
        await upstream.aclose()
        await client.aclose()


async def _from_peer(request, sha256: str):
    """The file from the first control plane that holds it and answers, as it answers; None when none does."""
    headers = {"Authorization": f"Bearer {peers.token()}"}
    if request.headers.get("Range"):
        headers["Range"] = request.headers["Range"]
    try:
        await sync_to_async(peers.announce)()  # known to the others by its token before it shows it
        verify = peers.verify()
    except (peers.Removed, peers.PullFailed) as exc:  # removed: the others would refuse its token anyway
        log.warning("not streaming %s from another control plane: %s", sha256[:12], exc)
        return None
    for peer in await sync_to_async(peers.sources)(sha256):
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
        response = StreamingHttpResponse(_relayed(client, upstream), status=upstream.status_code,
                                         content_type="application/octet-stream")
        for name in RELAYED:
            if name in upstream.headers:
                response[name] = upstream.headers[name]
        response["X-Llmgw-Mirror"] = peer.name
        return response
    return None


async def mirror_file(request, sha256: str):
    who = await sync_to_async(_allowed)(request)
    if who is None:
        return JsonResponse({"detail": "a node token, or a login with the operator or admin role, is needed"}, status=401)
    model_file = await ModelFile.objects.filter(sha256=sha256).afirst()
    if model_file is None:
        return JsonResponse({"detail": f"no file {sha256} in the mirror"}, status=404)
    if not await asyncio.to_thread(peers.whole, model_file):
        # not here (yet): from a control plane that holds it; a peer's own request is not passed on (no loops)
        relayed = await _from_peer(request, sha256) if who != "peer" else None
        if relayed is not None:
            return relayed
        return JsonResponse({"detail": f"file {sha256} is on no control plane that answers"}, status=404)
    size = model_file.size
    start, end, status = 0, size - 1, 200
    requested = request.headers.get("Range", "")
    if requested:
        match = RANGE_RE.match(requested.strip())
        first = int(match.group(1)) if match else size
        last = int(match.group(2)) if match and match.group(2) else size - 1
        if first >= size or last < first:  # unreadable, past the end (of an empty file too), or backwards
            response = HttpResponse(status=416)
            response["Content-Range"] = f"bytes */{size}"
            return response
        start, end, status = first, min(last, size - 1), 206
    length = max(0, end - start + 1)
    response = StreamingHttpResponse(
        _chunks(model_file.path, start, length), status=status, content_type="application/octet-stream"
    )
    response["Content-Length"] = str(length)
    response["Accept-Ranges"] = "bytes"
    response["X-Sha256"] = sha256
    if status == 206:
        response["Content-Range"] = f"bytes {start}-{end}/{size}"
    return response
