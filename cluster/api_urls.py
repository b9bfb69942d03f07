from django.urls import path

from cluster.api import StatusView, router
from cluster.api.views import EngineKeyRotateView, RestartNoSlashView, RestartView

urlpatterns = [
    path("status/", StatusView.as_view(), name="status"),
    path("restart/", RestartView.as_view(), name="restart"),
    path("restart", RestartNoSlashView.as_view()),
    path("engine-key/rotate/", EngineKeyRotateView.as_view(), name="engine-key-rotate"),
    *router.urls,
]
