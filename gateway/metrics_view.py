"""`/metrics` in Prometheus format: with LLMGW_METRICS_TOKEN as a bearer token when it is set, else any
llmgw API token (from `llmgw user add`). This process's series, and the fleet's replicas by state from the
database (gateway/metrics.py)."""

import hmac
import logging

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError
from prometheus_client import CONTENT_TYPE_LATEST

from cluster.queries import replicas_by_state
from gateway.errors import error_response
from gateway.http import Answer, Request
from gateway.metrics import exposition

log = logging.getLogger("llmgw.gateway")


def _token_ok(token: str) -> bool:
    if settings.LLMGW_METRICS_TOKEN:
        return hmac.compare_digest(token, settings.LLMGW_METRICS_TOKEN)
    from rest_framework.authtoken.models import Token

    return Token.objects.filter(key=token, user__is_active=True).exists()


async def metrics_view(request: Request) -> Answer:
    header = request.header("authorization")
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    replicas = await database_sync_to_async(_read)(token) if token else None
    if replicas is None:
        return error_response(401, "invalid_api_key", "metrics need `Authorization: Bearer <token>`")
    return Answer(exposition(replicas), content_type=CONTENT_TYPE_LATEST)


def _read(token: str) -> dict[str, dict[str, int]] | None:
    """The fleet's replicas by state for a good token (one trip to a thread for both), else None."""
    if not _token_ok(token):
        return None
    try:
        return replicas_by_state()
    except DatabaseError as exc:  # the database away (a failover): this process's own series still go out
        log.warning("metrics: no replicas by state, the database is away: %s", exc)
        return {}
