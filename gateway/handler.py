"""The ASGI handler for /v1/ and /metrics: Django's, with none of the dashboard's middleware.

Sessions, CSRF, the auth user and messages are for browsers; the gateway authenticates every request with its
own keys. Skipping them keeps each sync middleware's thread hop off the gateway's hot path.
"""

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response

GATEWAY_PREFIXES = ("/v1/", "/metrics")


class GatewayHandler(ASGIHandler):
    def load_middleware(self, is_async=False):
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)


def http_router(django_app, gateway_app):
    async def route(scope, receive, send):
        path = scope.get("path", "")
        app = gateway_app if path.startswith(GATEWAY_PREFIXES) or path == "/v1" else django_app
        return await app(scope, receive, send)

    return route
