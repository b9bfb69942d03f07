"""The API's serializers: output ones show a row, input ones (strict: unknown fields refused) parse a request."""

from __future__ import annotations

import re

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from cluster import peers, queries
from cluster.api.base import NameField, StrictSerializer, UserNameField
from cluster.models import ControlPlane, EngineVersion, Event, FileCopy, ModelFile, Node, Profile, Replica
from cluster.operations import MIN_PASSWORD, PROFILE_BOUNDS
from cluster.operations.validation import DRAIN_GRACE, MAX_WAIT, MIN_RESIDENT, QUEUE_LIMIT, RECONCILE_INTERVAL
from cluster.roles import ROLES
from ground.engines import CAPABILITIES, DRIVERS

# Nodes


class NodeListSerializer(serializers.ListSerializer):
    """A page of nodes: the memory their replicas hold is read once for the page, not once per node."""

    def to_representation(self, data):
        nodes = list(data.all() if hasattr(data, "all") else data)
        assert self.child is not None  # a list serializer is made with its child
        self.child.context["memory"] = queries.memory_in_use(nodes)
        return super().to_representation(nodes)


class NodeSerializer(serializers.ModelSerializer):
    connected = serializers.SerializerMethodField(help_text="the agent is connected and was heard from lately")
    drain = serializers.SerializerMethodField(
        help_text="null (not draining), draining, blocked (a replica has nowhere else to go: see drain_note) "
        "or drained (nothing left on it)"
    )
    replica_count = serializers.IntegerField(read_only=True, help_text="replicas on the node that are not over")
    memory_used_bytes = serializers.SerializerMethodField(
        help_text="RAM its replicas hold (placed until their engine has stopped), as placement counts it"
    )
    gpu_memory_used_bytes = serializers.SerializerMethodField(help_text="memory its replicas hold on each GPU, by index")
    cpus = serializers.SerializerMethodField(help_text="CPU cores its agent offers (--cpus may lower its count); 0: "
                                             "not said, not counted")
    cpus_used = serializers.SerializerMethodField(help_text="CPU cores its replicas' engine threads take, as placement "
                                                  "counts them")

    class Meta:
        model = Node
        list_serializer_class = NodeListSerializer
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
            "memory_used_bytes",
            "gpu_memory_used_bytes",
            "cpus",
            "cpus_used",
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
    def get_drain(self, node: queries.NodeWithCount) -> str | None:
        return node.drain_state(node.replica_count) or None

    def _memory(self, node: Node):
        memory = self.context.get("memory")  # a page's, from NodeListSerializer
        if memory is None:
            memory = self.context["memory"] = queries.memory_in_use([node])
        return memory

    @extend_schema_field(OpenApiTypes.INT64)
    def get_memory_used_bytes(self, node: Node) -> int:
        return self._memory(node).ram(node.pk)

    @extend_schema_field(serializers.ListField(child=serializers.IntegerField()))
    def get_gpu_memory_used_bytes(self, node: Node) -> list[int]:
        return self._memory(node).gpus(node.pk, len(node.gpus))

    @extend_schema_field(OpenApiTypes.INT)
    def get_cpus(self, node: Node) -> int:
        return node.cpus

    @extend_schema_field(OpenApiTypes.INT)
    def get_cpus_used(self, node: Node) -> int:
        return self._memory(node).cores(node.pk)


AGENT_URL = r"^https?://[^\x00-\x20\x7f/?#]+(/[^\x00-\x20\x7f?#]*)?$"  # the same to Python and to the schema


@extend_schema_field({"type": "string", "pattern": AGENT_URL, "maxLength": 2000})
class AgentServerField(serializers.CharField):
    """The URL a node's agent dials, for the agent command shown: http(s)://host[:port][/path]."""

    def __init__(self, **kwargs):
        super().__init__(required=False, max_length=2000, help_text="the URL agents dial, for agent_command (default:"
                         " LLMGW_PUBLIC_URL, else the URL this request came to)", **kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if not re.fullmatch(AGENT_URL, value):
            raise serializers.ValidationError("an http:// or https:// URL, such as http://llmgw.example:8000")
        return value.rstrip("/")


class NodeCreateSerializer(StrictSerializer):
    name = NameField()
    server = AgentServerField()


class NodeTokenSerializer(StrictSerializer):
    server = AgentServerField()


class NewNodeTokenSerializer(serializers.Serializer):
    name = serializers.CharField()
    token = serializers.CharField(help_text="the agent's new token; shown this once (the old one no longer works)")
    agent_command = serializers.CharField(help_text="run this on the node to start its agent")


class NewNodeSerializer(NodeSerializer):
    token = serializers.CharField(read_only=True, help_text="the agent's token; shown this once")
    agent_command = serializers.CharField(read_only=True, help_text="run this on the node to start its agent")

    class Meta(NodeSerializer.Meta):
        fields = NodeSerializer.Meta.fields + ["token", "agent_command"]
        read_only_fields = fields


# Replicas


class ReplicaSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    node = serializers.CharField(source="node.name", read_only=True, allow_null=True)
    stale = serializers.SerializerMethodField(
        help_text="why it no longer matches what it would start with now (profile edited, engine version, "
        "engine key, model file), or null; `POST /api/v1/restart/` with stale: true replaces it"
    )
    canary = serializers.SerializerMethodField(
        help_text="a canary of its model's rollout: it runs the rollout's settings and takes its share of the traffic")

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
            "canary",
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


    def get_canary(self, replica: Replica) -> bool:
        return replica.rollout_id is not None

    @extend_schema_field({"type": "string", "nullable": True})
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
    context_size = serializers.IntegerField(required=False, **PROFILE_BOUNDS["context_size"].limits)
    threads = serializers.IntegerField(required=False, allow_null=True, **PROFILE_BOUNDS["threads"].limits)
    gpu_layers = serializers.IntegerField(required=False, allow_null=True, help_text="-1: all",
                                         **PROFILE_BOUNDS["gpu_layers"].limits)
    batch_size = serializers.IntegerField(required=False, allow_null=True, **PROFILE_BOUNDS["batch_size"].limits)
    parallel = serializers.IntegerField(required=False, **PROFILE_BOUNDS["parallel"].limits)
    extra_args = serializers.ListField(
        required=False,
        child=serializers.CharField(trim_whitespace=False),
        help_text="more engine arguments, one word each",
    )


class ProfileCreateSerializer(ProfileUpdateSerializer):
    name = NameField()


# Engines


SERVES_HELP = ("for kind command: what its models serve, of the capabilities; empty: what a request asks (the engine "
               "refuses what it cannot). Other kinds' models serve what their profile says.")


class EngineSerializer(serializers.ModelSerializer):
    serves = serializers.ListField(child=serializers.ChoiceField(choices=CAPABILITIES), read_only=True,
                                   help_text=SERVES_HELP)

    class Meta:
        model = EngineVersion
        fields = ["name", "kind", "version", "device", "binary", "command", "serves", "updated_at"]
        read_only_fields = fields


class EngineUpdateSerializer(StrictSerializer):
    serves = serializers.ListField(child=serializers.ChoiceField(choices=CAPABILITIES), required=False,
                                   max_length=len(CAPABILITIES), help_text=SERVES_HELP)


class EngineCreateSerializer(StrictSerializer):
    name = NameField()
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
    serves = serializers.ListField(child=serializers.ChoiceField(choices=CAPABILITIES), default=list,
                                   max_length=len(CAPABILITIES), help_text=SERVES_HELP)


# Model files


class FileCopySerializer(serializers.ModelSerializer):
    control_plane = serializers.CharField(source="control_plane.name")

    class Meta:
        model = FileCopy
        fields = ["control_plane", "verified_at"]
        read_only_fields = fields


class ModelFileSerializer(serializers.ModelSerializer):
    locations = FileCopySerializer(source="copies", many=True, read_only=True,
                                   help_text="the control planes whose mirror holds it, whole and checked")

    class Meta:
        model = ModelFile
        fields = ["sha256", "name", "size", "format", "gguf", "created_at", "locations"]
        read_only_fields = fields


class ControlPlaneSerializer(serializers.ModelSerializer):
    files = serializers.IntegerField(read_only=True, help_text="model files its mirror holds")
    alive = serializers.SerializerMethodField(help_text=f"heard from in the last {peers.ALIVE} s")
    this = serializers.SerializerMethodField(help_text="the control plane that answered this request")
    rotation_asked_at = serializers.DateTimeField(
        read_only=True, allow_null=True, help_text="when a new token was asked for, not yet made by its worker")

    class Meta:
        model = ControlPlane
        fields = ["name", "url", "seen_at", "alive", "files", "this", "rotation_asked_at"]
        read_only_fields = fields

    def get_alive(self, plane) -> bool:
        return peers.alive(plane)

    def get_this(self, plane) -> bool:
        return peers.is_this(plane)


class ControlPlaneTokenSerializer(ControlPlaneSerializer):
    rotated = serializers.BooleanField(help_text="true: made at once (the request came to that control plane); "
                                                 "false: asked for, made by its worker at its next heartbeat")

    class Meta(ControlPlaneSerializer.Meta):
        fields = [*ControlPlaneSerializer.Meta.fields, "rotated"]
        read_only_fields = fields


class ControlPlaneRemovedSerializer(serializers.Serializer):
    name = serializers.CharField()
    files = serializers.IntegerField(help_text="the copies of model files it held, forgotten with it")
    orphaned = serializers.ListField(child=serializers.CharField(),
                                     help_text="the model files it alone held: now on no control plane")
    alive = serializers.BooleanField(help_text="it was heard from lately: it still runs, cut off from the others")


class ModelFileImportSerializer(StrictSerializer):
    """As JSON: a path on the server, copied into the mirror."""

    path = serializers.CharField(help_text="a file on the server (in LLMGW_IMPORT_DIRS), copied into the mirror")
    name = serializers.CharField(max_length=255, required=False, help_text="default: the file's name")


class ModelFileUploadSerializer(StrictSerializer):
    """As multipart/form-data: the file itself."""

    # The file alone, named by its filename: a form's other fields are all text, so no schema can tell a client
    # that sends 1.5 for a name it meant as a number from one that means the name "1.5".
    file = serializers.FileField(allow_empty_file=True, help_text="the file itself, named by its filename (an empty"
                                 " one is refused, 422)")


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
    mode = serializers.ChoiceField(choices=["fixed", "autoscaled", "on-demand"])
    ready = serializers.IntegerField()
    wanted = serializers.IntegerField(help_text="the replicas it wants now (the autoscaler's number when autoscaled)")
    replicas = serializers.IntegerField(help_text="the same as wanted (kept for older clients)")
    min_replicas = serializers.IntegerField(allow_null=True)
    max_replicas = serializers.IntegerField(allow_null=True)
    replicas_text = serializers.CharField(help_text="READY/WANT, with the range when autoscaled: 2/2 (1-3)")
    last_request_at = serializers.DateTimeField(allow_null=True)
    removing = serializers.BooleanField()
    placement_note = serializers.CharField()


class StatusSerializer(serializers.Serializer):
    serving = serializers.ChoiceField(choices=["serving", "stopped"])
    nodes = StatusNodesSerializer()
    models = StatusModelSerializer(many=True)
    replicas = serializers.DictField(child=serializers.IntegerField(), help_text="replicas not over, by state")


class SystemRestartRequestSerializer(StrictSerializer):
    timeout = serializers.FloatField(required=False, min_value=0.1, max_value=3600,
                                     help_text="seconds each agent and process may take to come back (default 60 "
                                               "for agents, 90 for processes)")


class LoginSerializer(StrictSerializer):
    name = serializers.CharField(max_length=150)
    password = serializers.CharField(max_length=4096)


class LoggedInSerializer(serializers.Serializer):
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=ROLES, allow_null=True)
    token = serializers.CharField(help_text="the user's API token, for `Authorization: Bearer`")


class MeSerializer(serializers.Serializer):
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=ROLES, allow_null=True)


class SystemRestartSerializer(serializers.Serializer):
    queued = serializers.BooleanField()
    watch = serializers.CharField(help_text="where the restart's steps appear, as Events")


class UserCreateSerializer(StrictSerializer):
    name = UserNameField()
    role = serializers.ChoiceField(choices=ROLES)
    password = serializers.CharField(
        required=False, write_only=True, min_length=MIN_PASSWORD,
        help_text=f"for the dashboard ({MIN_PASSWORD} characters or more); none: API token only",
    )


class UserSerializer(serializers.Serializer):
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=ROLES, allow_null=True)
    password = serializers.BooleanField(help_text="whether it has a password, to log in to the dashboard (else: "
                                                  "the API token alone)")
    active = serializers.BooleanField()
    joined_at = serializers.DateTimeField()
    last_login_at = serializers.DateTimeField(allow_null=True, help_text="its last dashboard login (null: never)")


class NewUserSerializer(serializers.Serializer):
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=ROLES)
    token = serializers.CharField(help_text="the API token; shown this once")


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
    min_resident_seconds = serializers.IntegerField(
        help_text="how long an autoscaled model's replica serves before it may be evicted for another model")
    queue_limit = serializers.IntegerField(help_text="requests that may wait for a model's slots, for a model that "
                                           "sets none of its own (past it: 429 queue_full)")
    max_wait_seconds = serializers.IntegerField(help_text="seconds a request may wait for a slot, for a model that "
                                                "sets none of its own (past it: 503 queue_timeout)")
    serving_stopped = serializers.BooleanField(help_text="llmgw stop is in effect (change it with system stop/start)")
    engine_key_fingerprint = serializers.CharField(help_text="of the current engine key")


class ClusterSettingsUpdateSerializer(StrictSerializer):
    """At least one of them (the schema's minProperties)."""

    drain_grace_seconds = serializers.IntegerField(required=False, **DRAIN_GRACE.limits)
    reconcile_interval_seconds = serializers.IntegerField(required=False, **RECONCILE_INTERVAL.limits)
    min_resident_seconds = serializers.IntegerField(required=False, **MIN_RESIDENT.limits)
    queue_limit = serializers.IntegerField(required=False, **QUEUE_LIMIT.limits)
    max_wait_seconds = serializers.IntegerField(required=False, **MAX_WAIT.limits)

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if not attrs:
            raise serializers.ValidationError("name a setting to change: drain_grace_seconds, "
                                              "reconcile_interval_seconds, min_resident_seconds, queue_limit or "
                                              "max_wait_seconds")
        return attrs


class EngineKeyShownSerializer(serializers.Serializer):
    engine_key = serializers.CharField(help_text="the key every engine requires")
    fingerprint = serializers.CharField()
