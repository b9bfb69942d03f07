"""The cluster's REST API routes: `ROUTES` (viewsets for the router) and `urlpatterns` (the plain views), which
llmgw.api_urls mounts beside the gateway's (gateway.api)."""

from django.urls import path

from cluster.api import schema  # noqa: F401  (registers the bearer token scheme with drf-spectacular)
from cluster.api.rollouts import RolloutViewSet
from cluster.api.views import (
    ControlPlaneViewSet,
    EngineKeyRotateView,
    EngineKeyView,
    EngineViewSet,
    EventViewSet,
    LoginView,
    MeView,
    ModelFileViewSet,
    NodeViewSet,
    ProfileViewSet,
    ReplicaViewSet,
    RestartNoSlashView,
    RestartView,
    ServedModelViewSet,
    SettingsView,
    StatusView,
    SystemViewSet,
    UserViewSet,
)

ROUTES = [
    ("nodes", NodeViewSet, "node"),
    ("models", ServedModelViewSet, "model"),
    ("replicas", ReplicaViewSet, "replica"),
    ("profiles", ProfileViewSet, "profile"),
    ("engines", EngineViewSet, "engine"),
    ("model-files", ModelFileViewSet, "model-file"),
    ("control-planes", ControlPlaneViewSet, "control-plane"),
    ("events", EventViewSet, "event"),
    ("rollouts", RolloutViewSet, "rollout"),
    ("users", UserViewSet, "user"),
    ("system", SystemViewSet, "system"),
]

urlpatterns = [
    path("status/", StatusView.as_view(), name="status"),
    path("me/", MeView.as_view(), name="api-me"),
    path("login/", LoginView.as_view(), name="api-login"),
    path("restart/", RestartView.as_view(), name="restart"),
    path("restart", RestartNoSlashView.as_view()),
    path("settings/", SettingsView.as_view(), name="settings"),
    path("engine-key/", EngineKeyView.as_view(), name="engine-key"),
    path("engine-key/rotate/", EngineKeyRotateView.as_view(), name="engine-key-rotate"),
]
