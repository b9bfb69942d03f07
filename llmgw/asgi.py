import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
# settings, loaded by get_asgi_application, find this module being imported: a web process, which keeps a pool
# of PostgreSQL connections (LLMGW_DB_POOL: it answers every agent's reports)

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from agents.consumers import AgentConsumer  # noqa: E402
from cluster import control, system  # noqa: E402
from dashboard.consumers import dashboard_socket  # noqa: E402
from gateway.handler import http_router  # noqa: E402
from gateway.runtime import lifespan  # noqa: E402
from gateway.urls import application as gateway_application  # noqa: E402

control.start("web", system.successor_started)  # register with the control plane; obey `llmgw restart`

application = ProtocolTypeRouter(
    {
        "http": http_router(django_asgi_app, gateway_application()),
        "websocket": URLRouter(
            [
                path("ws/agent/", AgentConsumer.as_asgi()),
                path("ws/dashboard/", dashboard_socket()),  # the browser's: same origin, the session's user
            ]
        ),
        # the server's start and stop: a stopping web process finishes the gateway's books (usage, reservations,
        # slots) before it exits. uvicorn says it; daphne has no lifespan of its own: llmgw.web says it for daphne
        "lifespan": lifespan,
    }
)

# What the process has made by now (Django, every app, the URL tree) lives as long as the process: out of the
# collector's sight, so a full collection no longer walks it (measured: 93 ms pauses in a web process under load,
# bench/admission.py; a few ms after)
gc.collect()
gc.freeze()
