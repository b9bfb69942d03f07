"""REST API under /api/v1/: serializers parse and show, `cluster.operations` changes state. Nothing else writes.

`router` and `StatusView` are what `cluster.api_urls` mounts; `exception_handler` is DRF's EXCEPTION_HANDLER.
"""

from rest_framework import routers

from cluster.api import schema  # noqa: F401  (registers the bearer token scheme with drf-spectacular)
from cluster.api.errors import exception_handler
from cluster.api.views import (
    ApiKeyViewSet,
    EngineViewSet,
    EventViewSet,
    ModelFileViewSet,
    NodeViewSet,
    ProfileViewSet,
    ReplicaViewSet,
    ServedModelViewSet,
    StatusView,
    SystemViewSet,
    UsageViewSet,
    UserViewSet,
)

__all__ = ["StatusView", "exception_handler", "router"]


class Router(routers.DefaultRouter):
    # Names may hold dots (qwen2.5-7b): no `.json` format suffixes to confuse them with.
    include_format_suffixes = False


router = Router(trailing_slash=True)
router.register("nodes", NodeViewSet, basename="node")
router.register("models", ServedModelViewSet, basename="model")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("profiles", ProfileViewSet, basename="profile")
router.register("engines", EngineViewSet, basename="engine")
router.register("model-files", ModelFileViewSet, basename="model-file")
router.register("events", EventViewSet, basename="event")
router.register("users", UserViewSet, basename="user")
router.register("keys", ApiKeyViewSet, basename="key")
router.register("usage", UsageViewSet, basename="usage")
router.register("system", SystemViewSet, basename="system")
