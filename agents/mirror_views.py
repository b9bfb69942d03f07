"""`/mirror/<sha256>`: model files for agents, with HTTP Range so an interrupted download resumes. The agents'
second door on the server, beside their stream (agents.consumers). What a request is given, from here or from
another control plane, is cluster.mirror.serving's to say; this door lets it in and answers it."""

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse

from cluster import peers
from cluster.mirror import serving
from cluster.reports import node_for_token
from cluster.roles import can_change


def _allowed(request: HttpRequest) -> str | None:
    """Who may fetch: agents with their node token ("node"), the other control planes with theirs ("peer"),
    people who may change the cluster ("user"). Viewers do not fetch model files."""
    auth = request.headers.get("Authorization", "")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if bearer and node_for_token(bearer) is not None:
        return "node"
    if bearer and peers.is_peer(bearer):
        return "peer"
    return "user" if can_change(request.user) else None


async def mirror_file(request: HttpRequest, sha256: str) -> HttpResponseBase:
    who = await sync_to_async(_allowed)(request)
    if who is None:
        return JsonResponse({"detail": "a node token, or a login with the operator or admin role, is needed"}, status=401)
    served = await serving.serve(sha256, request.headers.get("Range", ""), relay=who != "peer")
    if isinstance(served, serving.Missing):
        return JsonResponse({"detail": served.detail}, status=404)
    if isinstance(served, serving.Unsatisfiable):
        refused = HttpResponse(status=416)
        refused["Content-Range"] = f"bytes */{served.size}"
        return refused
    if isinstance(served, serving.Relayed):
        relayed = StreamingHttpResponse(served.body, status=served.status, content_type="application/octet-stream")
        for name, value in served.headers.items():
            relayed[name] = value
        relayed["X-Llmgw-Mirror"] = served.peer
        return relayed
    span = served.span
    response = StreamingHttpResponse(serving.read(served.path, span), status=206 if span.partial else 200,
                                     content_type="application/octet-stream")
    response["Content-Length"] = str(span.length)
    response["Accept-Ranges"] = "bytes"
    response["X-Sha256"] = served.sha256
    if span.partial:
        response["Content-Range"] = span.content_range
    return response
