from django.contrib import admin

from cluster.models import ClusterSettings, EngineVersion, Event, Model, ModelFile, Node, Profile, Replica


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "connected", "last_seen", "schedulable", "draining", "memory_bytes", "address")
    exclude = ("token_hash",)
    search_fields = ("name",)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = ("name", "context_size", "threads", "gpu_layers", "batch_size", "parallel", "updated_at")


@admin.register(EngineVersion)
class EngineVersionAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "version", "device", "binary")


@admin.register(ModelFile)
class ModelFileAdmin(admin.ModelAdmin):
    list_display = ("name", "sha256", "size", "format", "created_at")
    search_fields = ("name", "sha256")


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ("name", "file", "engine", "profile", "replicas", "removing", "placement_note")
    search_fields = ("name",)


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("name", "model", "node", "state", "restart", "port", "pid", "reason", "state_changed_at")
    list_filter = ("state", "restart")
    search_fields = ("name",)


@admin.register(ClusterSettings)
class ClusterSettingsAdmin(admin.ModelAdmin):
    list_display = ("serving_stopped", "drain_grace_seconds", "reconcile_interval_seconds", "updated_at")
    exclude = ("engine_key", "previous_engine_key")


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "kind", "actor", "subject", "message")
    list_filter = ("kind",)
    search_fields = ("subject", "message")

    def has_change_permission(self, request, obj=None):
        return False  # the log is append-only

    def has_delete_permission(self, request, obj=None):
        return False
