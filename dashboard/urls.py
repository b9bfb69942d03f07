from django.urls import path

from dashboard import rollouts, views

app_name = "dashboard"

urlpatterns = [
    path("", views.page, {"page": "overview"}, name="overview"),
    *[path(f"{p}/", views.page, {"page": p}, name=p) for p in views.PAGES if p != "overview"],
    path("system/stop/", views.system_stop, name="system-stop"),
    path("system/start/", views.system_start, name="system-start"),
    path("system/restart/", views.system_restart, name="system-restart"),
    path("nodes/add/", views.node_add, name="node-add"),
    path("nodes/<str:name>/drain/", views.node_drain, name="node-drain"),
    path("nodes/<str:name>/undrain/", views.node_undrain, name="node-undrain"),
    path("nodes/<str:name>/remove/", views.node_remove, name="node-remove"),
    path("nodes/<str:name>/token/", views.node_token, name="node-token"),
    path("models/add/", views.model_add, name="model-add"),
    path("models/<str:name>/set/", views.model_set, name="model-set"),
    path("models/<str:name>/restart/", views.model_restart, name="model-restart"),
    path("models/<str:name>/remove/", views.model_remove, name="model-remove"),
    path("models/<str:name>/rollout/", rollouts.rollout, name="rollout"),
    path("models/<str:name>/rollout/start/", rollouts.rollout_start, name="rollout-start"),
    path("models/<str:name>/rollout/promote/", rollouts.rollout_promote, name="rollout-promote"),
    path("models/<str:name>/rollout/abort/", rollouts.rollout_abort, name="rollout-abort"),
    path("replicas/restart/", views.replicas_restart, name="replicas-restart"),
    path("profiles/add/", views.profile_add, name="profile-add"),
    path("profiles/set/", views.profile_set, name="profile-set"),
    path("profiles/<str:name>/remove/", views.profile_remove, name="profile-remove"),
    path("engines/add/", views.engine_add, name="engine-add"),
    path("engines/set/", views.engine_set, name="engine-set"),
    path("mirror/import/", views.mirror_import, name="mirror-import"),
    path("mirror/upload/", views.mirror_upload, name="mirror-upload"),
    path("mirror/control-planes/<str:name>/remove/", views.control_plane_remove, name="control-plane-remove"),
    path("mirror/control-planes/<str:name>/token/", views.control_plane_token, name="control-plane-token"),
    path("keys/create/", views.key_create, name="key-create"),
    path("keys/set/", views.key_set, name="key-set"),
    path("keys/<str:name>/revoke/", views.key_revoke, name="key-revoke"),
    path("usage/csv/", views.usage_csv, name="usage-csv"),
    path("users/add/", views.user_add, name="user-add"),
    path("settings/set/", views.settings_set, name="settings-set"),
    path("settings/engine-key/", views.engine_key_show, name="engine-key-show"),
    path("settings/engine-key/rotate/", views.engine_key_rotate, name="engine-key-rotate"),
]
