"""The Django admin: a read-only view of every table. Changes go through the operations (the CLI, the REST API,
the dashboard), which validate, write an Event, kick the reconciler and tell the gateways; an edit here would
skip all of that (a replica's state, `serving_stopped`), so the admin may look and never change."""

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from rest_framework.authtoken.admin import TokenAdmin
from rest_framework.authtoken.models import TokenProxy

from cluster.models import ClusterSettings, EngineVersion, Event, Model, ModelFile, Node, Profile, Replica


class ReadOnly:
    """No add, change or delete: the pages show; a POST to them is refused (403)."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Node)
class NodeAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("name", "connected", "last_seen", "schedulable", "draining", "memory_bytes", "address")
    exclude = ("token_hash",)
    search_fields = ("name",)


@admin.register(Profile)
class ProfileAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("name", "context_size", "threads", "gpu_layers", "batch_size", "parallel", "updated_at")


@admin.register(EngineVersion)
class EngineVersionAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("name", "kind", "version", "device", "binary")


@admin.register(ModelFile)
class ModelFileAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("name", "sha256", "size", "format", "created_at")
    search_fields = ("name", "sha256")


@admin.register(Model)
class ModelAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("name", "file", "engine", "profile", "replicas", "removing", "placement_note")
    search_fields = ("name",)


@admin.register(Replica)
class ReplicaAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("name", "model", "node", "state", "restart", "port", "pid", "reason", "state_changed_at")
    list_filter = ("state", "restart")
    search_fields = ("name",)


@admin.register(ClusterSettings)
class ClusterSettingsAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("serving_stopped", "drain_grace_seconds", "reconcile_interval_seconds", "updated_at")
    exclude = ("engine_key", "previous_engine_key")


@admin.register(Event)
class EventAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("created_at", "kind", "actor", "subject", "message")
    list_filter = ("kind",)
    search_fields = ("subject", "message")


# Users and their API tokens too: `llmgw user add` gives a role and a token with an Event; `manage.py
# changepassword` sets a password.
for model, base in ((User, UserAdmin), (Group, GroupAdmin), (TokenProxy, TokenAdmin)):
    admin.site.unregister(model)
    admin.site.register(model, type(f"ReadOnly{base.__name__}", (ReadOnly, base), {}))
