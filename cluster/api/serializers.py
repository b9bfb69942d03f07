"""The API's serializers: output ones show a row, input ones (strict: unknown fields refused) parse a request."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from agents.engines import DRIVERS
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica
from cluster.roles import ROLES
from gateway.models import ApiKey

INT_MAX = 2**31 - 1  # PostgreSQL's integer: a bigger number must be a 400 here, not a database error
BIGINT_MAX = 2**63 - 1


class StrictSerializer(serializers.Serializer):
    """An input serializer that refuses fields it does not know, so a typo is not silently ignored."""

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({k: ["unknown field"] for k in unknown})
        return attrs


# Nodes


class NodeSerializer(serializers.ModelSerializer):
    connected = serializers.SerializerMethodField(help_text="the agent is connected and was heard from lately")
    drain = serializers.SerializerMethodField(
        help_text="null (not draining), draining, blocked (a replica has nowhere else to go: see drain_note) "
        "or drained (nothing left on it)"
    )
    replica_count = serializers.IntegerField(read_only=True, help_text="replicas on the node that are not over")

    class Meta:
        model = Node
        fields = [
            "name",
            "address",
            "connected",
            "last_seen",
            "schedulable",
            "draining",
            "drain",
            "drain_force",
            "drain_note",
            "memory_bytes",
            "facts",
            "replica_count",
            "created_at",
        ]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_connected(self, node: Node) -> bool:
        return node.is_alive()

    @extend_schema_field(
        serializers.ChoiceField(choices=["draining", "blocked", "drained"], allow_null=True),
    )
    def get_drain(self, node: Node) -> str | None:
        return node.drain_state(node.replica_count) or None


class NodeCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=63)


class NewNodeSerializer(NodeSerializer):
    token = serializers.CharField(read_only=True, help_text="the agent's token; shown this once")
    agent_command = serializers.CharField(read_only=True, help_text="run this on the node to start its agent")

    class Meta(NodeSerializer.Meta):
        fields = NodeSerializer.Meta.fields + ["token", "agent_command"]
        read_only_fields = fields


# Models


class ModelFileRefSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelFile
        fields = ["sha256", "name"]
        read_only_fields = fields


STATES = Replica.State.values


class ServedModelSerializer(serializers.ModelSerializer):
    file = ModelFileRefSerializer(read_only=True)
    engine = serializers.CharField(source="engine.name", read_only=True)
    profile = serializers.CharField(source="profile.name", read_only=True)
    memory_bytes = serializers.SerializerMethodField(help_text="per replica: the operator's figure, else estimated")
    memory_estimated = serializers.SerializerMethodField(help_text="memory_bytes is an estimate from the file")
    counting = serializers.IntegerField(
        source="n_counting", read_only=True, help_text="replicas counting toward `replicas` now"
    )
    replica_states = serializers.SerializerMethodField(help_text="number of replicas in each state")
    nodes = serializers.ListField(child=serializers.CharField(), read_only=True, help_text="allowed nodes; empty: any")

    class Meta:
        model = Model
        fields = [
            "name",
            "file",
            "engine",
            "profile",
            "replicas",
            "memory_bytes",
            "memory_estimated",
            "nodes",
            "wait_seconds",
            "removing",
            "placement_note",
            "counting",
            "replica_states",
            "created_at",
        ]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.INT64)
    def get_memory_bytes(self, model: Model) -> int:
        return model.memory_estimate()

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_memory_estimated(self, model: Model) -> bool:
        return not model.memory_bytes

    @extend_schema_field(serializers.DictField(child=serializers.IntegerField()))
    def get_replica_states(self, model: Model) -> dict:
        return {s: getattr(model, f"n_{s}") for s in STATES}


class ServedModelUpdateSerializer(StrictSerializer):
    file = serializers.CharField(
        required=False, help_text="a sha256 (or 8+ hex digits of one), a file name in the mirror, or a path"
    )
    engine = serializers.CharField(required=False, help_text="engine name, e.g. llama.cpp")
    profile = serializers.CharField(required=False)
    replicas = serializers.IntegerField(required=False, min_value=0, max_value=INT_MAX)
    memory_bytes = serializers.IntegerField(
        required=False, min_value=0, max_value=BIGINT_MAX, allow_null=True, help_text="per replica; null or 0: estimate"
    )
    nodes = serializers.ListField(
        required=False, child=serializers.CharField(), help_text="node names allowed; empty: any"
    )
    wait_seconds = serializers.IntegerField(required=False, min_value=0, max_value=INT_MAX)


class ServedModelCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=63)
    file = serializers.CharField(help_text="a sha256 (or 8+ hex digits of one), a file name in the mirror, or a path")
    engine = serializers.CharField(help_text="engine name, e.g. llama.cpp")
    profile = serializers.CharField(default="default")
    replicas = serializers.IntegerField(min_value=0, max_value=INT_MAX, default=1)
    memory_bytes = serializers.IntegerField(
        min_value=0, max_value=BIGINT_MAX, allow_null=True, default=None, help_text="per replica; null: estimate"
    )
    nodes = serializers.ListField(child=serializers.CharField(), default=list, help_text="node names; empty: any")
    wait_seconds = serializers.IntegerField(min_value=0, max_value=INT_MAX, allow_null=True, default=None)


# Replicas


class ReplicaSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    node = serializers.CharField(source="node.name", read_only=True, allow_null=True)
    stale = serializers.SerializerMethodField(
        help_text="why it no longer matches what it would start with now (profile edited, engine version, "
        "engine key, model file), or null; `POST /api/v1/restart/` with stale: true replaces it"
    )

    class Meta:
        model = Replica
        fields = [
            "name",
            "model",
            "node",
            "gpu_index",
            "state",
            "restart",
            "stale",
            "port",
            "pid",
            "reason",
            "memory_bytes",
            "snapshot",
            "created_at",
            "state_changed_at",
            "download_done",
            "download_total",
        ]
        read_only_fields = fields


    @extend_schema_field(OpenApiTypes.STR)
    def get_stale(self, replica: Replica) -> str | None:
        from cluster.models import ClusterSettings
        from cluster.operations import staleness

        cluster = self.context.get("cluster")
        if cluster is None:
            cluster = self.context["cluster"] = ClusterSettings.load()
        return staleness(replica, replica.model, cluster)


class ReplicaDetailSerializer(ReplicaSerializer):
    class Meta(ReplicaSerializer.Meta):
        fields = ReplicaSerializer.Meta.fields + ["log_tail"]
        read_only_fields = fields


# Profiles


class ProfileSerializer(serializers.ModelSerializer):
    extra_args = serializers.ListField(child=serializers.CharField(), read_only=True)

    class Meta:
        model = Profile
        fields = ["name", "context_size", "threads", "gpu_layers", "batch_size", "parallel", "extra_args", "updated_at"]
        read_only_fields = fields


class ProfileUpdateSerializer(StrictSerializer):
    context_size = serializers.IntegerField(required=False, min_value=1, max_value=INT_MAX)
    threads = serializers.IntegerField(required=False, min_value=1, max_value=INT_MAX, allow_null=True)
    gpu_layers = serializers.IntegerField(
        required=False, min_value=-1, max_value=INT_MAX, allow_null=True, help_text="-1: all"
    )
    batch_size = serializers.IntegerField(required=False, min_value=1, max_value=INT_MAX, allow_null=True)
    parallel = serializers.IntegerField(required=False, min_value=1, max_value=INT_MAX)
    extra_args = serializers.ListField(
        required=False,
        child=serializers.CharField(trim_whitespace=False),
        help_text="more engine arguments, one word each",
    )


class ProfileCreateSerializer(ProfileUpdateSerializer):
    name = serializers.CharField(max_length=63)


# Engines


class EngineSerializer(serializers.ModelSerializer):
    class Meta:
        model = EngineVersion
        fields = ["name", "kind", "version", "device", "binary", "command", "updated_at"]
        read_only_fields = fields


class EngineCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=63)
    kind = serializers.ChoiceField(choices=sorted(DRIVERS))
    version = serializers.CharField(max_length=64, allow_blank=True, default="")
    device = serializers.ChoiceField(choices=EngineVersion.Device.choices, default=EngineVersion.Device.CPU)
    binary = serializers.CharField(
        max_length=500, allow_blank=True, default="", help_text="path on the nodes; empty: found on PATH"
    )
    command = serializers.CharField(
        allow_blank=True,
        default="",
        trim_whitespace=False,
        help_text="the command kind's template, e.g. '{python} server.py --port {port} --model {model_path}'",
    )


# Model files


class ModelFileSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelFile
        fields = ["sha256", "name", "size", "format", "gguf", "created_at"]
        read_only_fields = fields


class ModelFileImportSerializer(StrictSerializer):
    path = serializers.CharField(required=False, help_text="a file on the server (in LLMGW_IMPORT_DIRS), copied into the mirror")
    file = serializers.FileField(required=False, help_text="or the file itself, sent as multipart/form-data")
    name = serializers.CharField(max_length=255, required=False, help_text="default: the file's name")

    def validate(self, data):
        data = super().validate(data)
        if ("path" in data) == ("file" in data):
            raise serializers.ValidationError("give either path (a file on the server) or file (an upload)")
        return data


# Events


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = ["id", "created_at", "kind", "actor", "subject", "message", "data"]
        read_only_fields = fields


# Status and users


class StatusNodesSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    connected = serializers.IntegerField()


class StatusModelSerializer(serializers.Serializer):
    name = serializers.CharField()
    replicas = serializers.IntegerField()
    ready = serializers.IntegerField()
    removing = serializers.BooleanField()
    placement_note = serializers.CharField()


class StatusSerializer(serializers.Serializer):
    serving = serializers.ChoiceField(choices=["serving", "stopped"])
    nodes = StatusNodesSerializer()
    models = StatusModelSerializer(many=True)
    replicas = serializers.DictField(child=serializers.IntegerField(), help_text="replicas not over, by state")


class SystemRestartSerializer(serializers.Serializer):
    queued = serializers.BooleanField()
    watch = serializers.CharField(help_text="where the restart's steps appear, as Events")


class UserCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=ROLES)
    password = serializers.CharField(
        required=False, write_only=True, trim_whitespace=False, help_text="for the dashboard; none: API token only"
    )


class NewUserSerializer(serializers.Serializer):
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=ROLES)
    token = serializers.CharField(help_text="the API token; shown this once")


# Client keys and usage (the gateway's)

KEY_STATES = ["active", "revoked", "expired"]


class ApiKeySerializer(serializers.ModelSerializer):
    models = serializers.ListField(
        source="allowed_models",
        child=serializers.CharField(),
        read_only=True,
        help_text="models it may use; empty: all",
    )
    state = serializers.SerializerMethodField(help_text="active, revoked or expired")

    class Meta:
        model = ApiKey
        fields = [
            "name",
            "prefix",
            "models",
            "rpm",
            "tpm",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "state",
            "created_at",
        ]
        read_only_fields = fields

    # A plain string in the schema: an enum named `state` would collide with the replicas' states.
    @extend_schema_field(OpenApiTypes.STR)
    def get_state(self, key: ApiKey) -> str:
        if key.revoked_at is not None:
            return "revoked"
        return "active" if key.active else "expired"


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the key for `Authorization: Bearer`; shown this once")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]
        read_only_fields = fields


class ApiKeyCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=63)
    models = serializers.ListField(child=serializers.CharField(), default=list, help_text="model names; empty: all")
    rpm = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, default=None, help_text="requests per minute; null: no limit"
    )
    tpm = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, default=None, help_text="tokens per minute; null: no limit"
    )
    expires_at = serializers.DateTimeField(allow_null=True, default=None, help_text="null: never")


class UsageSerializer(serializers.Serializer):
    key = serializers.CharField()
    model = serializers.CharField()
    hour = serializers.DateTimeField(help_text="the start of the hour")
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()


# Restart and drain


class RestartSerializer(StrictSerializer):
    replicas = serializers.ListField(child=serializers.CharField(), default=list, help_text="replica names")
    models = serializers.ListField(child=serializers.CharField(), default=list, help_text="every replica of these")
    all = serializers.BooleanField(default=False, help_text="every replica")
    stale = serializers.BooleanField(
        default=False, help_text="only stale replicas (of those named; of all when none is named)"
    )


class RestartSkippedSerializer(serializers.Serializer):
    name = serializers.CharField()
    why = serializers.CharField(help_text="e.g. already queued for restart")


class RestartQueuedSerializer(serializers.Serializer):
    queued = serializers.ListField(child=serializers.CharField(), help_text="replicas queued for restart")
    skipped = RestartSkippedSerializer(many=True, help_text="replicas for which there was nothing to do")


class NodeDrainSerializer(StrictSerializer):
    force = serializers.BooleanField(
        default=False, help_text="a replica with nowhere else to go drains and stops instead of staying"
    )


class EngineKeyRotatedSerializer(serializers.Serializer):
    fingerprint = serializers.CharField(help_text="of the new key; replicas' snapshots name their key by it")
    stale = serializers.IntegerField(help_text="running replicas still on the old key until restarted")


class ClusterSettingsSerializer(serializers.Serializer):
    drain_grace_seconds = serializers.IntegerField(help_text="how long a draining replica gets for requests in flight")
    reconcile_interval_seconds = serializers.IntegerField(help_text="how often the reconciler runs")
    serving_stopped = serializers.BooleanField(help_text="llmgw stop is in effect (change it with system stop/start)")
    engine_key_fingerprint = serializers.CharField(help_text="of the current engine key")


class ClusterSettingsUpdateSerializer(StrictSerializer):
    drain_grace_seconds = serializers.IntegerField(required=False, min_value=0, max_value=86400)
    reconcile_interval_seconds = serializers.IntegerField(required=False, min_value=1, max_value=3600)


class EngineKeyShownSerializer(serializers.Serializer):
    engine_key = serializers.CharField(help_text="the key every engine requires")
    fingerprint = serializers.CharField()
