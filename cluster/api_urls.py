from django.urls import path

from cluster.api import StatusView, router
from cluster.api.views import EngineKeyRotateView, EngineKeyView, RestartNoSlashView, RestartView, SettingsView

urlpatterns = [
    path("status/", StatusView.as_view(), name="status"),
    path("restart/", RestartView.as_view(), name="restart"),
    path("restart", RestartNoSlashView.as_view()),
    path("settings/", SettingsView.as_view(), name="settings"),
    path("engine-key/", EngineKeyView.as_view(), name="engine-key"),
    path("engine-key/rotate/", EngineKeyRotateView.as_view(), name="engine-key-rotate"),
    *router.urls,
]
