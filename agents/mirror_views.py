"""`/mirror/<sha256>`: model files for agents, with HTTP Range so an interrupted download resumes. The agents'
second door on the server, beside their stream (agents.consumers)."""

import asyncio
import re

from asgiref.sync import sync_to_async
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from cluster.models import ModelFile
from cluster.reports import node_for_token
from cluster.roles import can_change

CHUNK = 1024 * 1024
RANGE_RE = re.compile(r"^bytes=([0-9]{1,19})-([0-9]{0,19})$", re.ASCII)  # 19 digits hold any file size


def _allowed(request) -> bool:
    """Agents with their node token; people who may change the cluster. Viewers do not fetch model files."""
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and node_for_token(auth[7:].strip()) is not None:
        return True
    return can_change(request.user)


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


async def mirror_file(request, sha256: str):
    if not await sync_to_async(_allowed)(request):
        return JsonResponse({"detail": "a node token, or a login with the operator or admin role, is needed"}, status=401)
    model_file = await ModelFile.objects.filter(sha256=sha256).afirst()
    if model_file is None or not model_file.path.exists():
        return JsonResponse({"detail": f"no file {sha256} in the mirror"}, status=404)
    size = model_file.path.stat().st_size
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
