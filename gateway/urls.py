"""Where each /v1/ and /metrics path goes, and the gateway's ASGI application built on it."""

from gateway import views
from gateway.handler import GatewayHandler, View
from gateway.metrics_view import metrics_view
from gateway.surfaces import SURFACES

EXACT: dict[str, View] = {
    **{f"/v1/{path}": views.surface_view(path) for path in SURFACES},  # each API (gateway/surfaces.py)
    "/v1/models": views.models_list,
    "/metrics": metrics_view,
}
MODEL_DETAIL = "/v1/models/"


def resolve(path: str) -> tuple[View, dict[str, str]]:
    """The view for a path and its arguments; anything else under /v1 or /metrics (/v1x, /v1/nope, /metrics/) is
    the gateway's JSON 404."""
    view = EXACT.get(path)
    if view is not None:
        return view, {}
    if path.startswith(MODEL_DETAIL) and len(path) > len(MODEL_DETAIL):
        return views.model_detail, {"model": path[len(MODEL_DETAIL):]}
    return views.not_found, {}


def application() -> GatewayHandler:
    return GatewayHandler(resolve)
