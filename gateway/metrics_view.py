"""`/metrics` in Prometheus format: with LLMGW_METRICS_TOKEN as a bearer token when it is set, else any
llmgw API token (from `llmgw user add`)."""

import hmac

from channels.db import database_sync_to_async
from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import error_response
from gateway.http import Answer, Request


def _token_ok(token: str) -> bool:
    if settings.LLMGW_METRICS_TOKEN:
        return hmac.compare_digest(token, settings.LLMGW_METRICS_TOKEN)
    from rest_framework.authtoken.models import Token

    return Token.objects.filter(key=token, user__is_active=True).exists()


async def metrics_view(request: Request) -> Answer:
    header = request.header("authorization")
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not token or not await database_sync_to_async(_token_ok)(token):
        return error_response(401, "invalid_api_key", "metrics need `Authorization: Bearer <token>`")
    return Answer(generate_latest(), content_type=CONTENT_TYPE_LATEST)
