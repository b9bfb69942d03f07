"""/api/v1/: the REST API of both apps (cluster.api, gateway.api) on one router, so the API root lists them all."""

from rest_framework import routers

from cluster.api import urls as cluster_api
from gateway import api as gateway_api


class Router(routers.DefaultRouter):
    # Names may hold dots (qwen2.5-7b): no `.json` format suffixes to confuse them with.
    include_format_suffixes = False


router = Router(trailing_slash=True)
for prefix, viewset, basename in (*cluster_api.ROUTES, *gateway_api.ROUTES):
    router.register(prefix, viewset, basename=basename)

urlpatterns = [*cluster_api.urlpatterns, *router.urls]
