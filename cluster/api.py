"""REST API under /api/v1/: serializers parse and show, `cluster.operations` changes state. Nothing else writes."""

from __future__ import annotations

import shlex
from contextlib import contextmanager

from django.conf import settings
from django.db.models import Count, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import exceptions, mixins, routers, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from agents.engines import DRIVERS
from cluster import operations
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica
from cluster.roles import ROLES

INT_MAX = 2**31 - 1  # PostgreSQL's integer: a bigger number must be a 400 here, not a database error
BIGINT_MAX = 2**63 - 1


def exception_handler(exc, context):
    """Refused operations that reach here unwrapped still answer 400/404 with their one-line message."""
    if isinstance(exc, operations.NotFound):
        exc = exceptions.NotFound(str(exc))
    elif isinstance(exc, operations.OperationError):
        exc = Refused(str(exc))
    return drf_exception_handler(exc, context)


class Refused(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "refused"
    default_code = "refused"


@contextmanager
def refused(reads_files: bool = False):
    """An operation's refusal of the request body is a 400, even "no such engine": the URL itself was found."""
    try:
        yield
    except operations.OperationError as exc:
        raise Refused(str(exc)) from None
    except OSError as exc:
        if not reads_files:
            raise
        # e.g. a path the server may not read; the operation imports it before anything is written
        raise Refused(f"cannot import {exc.filename or 'the file'}: {exc.strerror or exc}") from None


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "cluster.permissions.BearerTokenAuthentication"
    name = "bearerAuth"
    priority = 1

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "a user's API token: `Authorization: Bearer <token>` (`Token <token>` works too)",
        }


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
            "memory_bytes",
            "facts",
            "replica_count",
            "created_at",
        ]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_connected(self, node: Node) -> bool:
        return node.is_alive()


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


def _with_replica_counts(queryset):
    not_replacing = ~Q(replica_set__restart=Replica.Restart.REPLACING)
    counts = {f"n_{s}": Count("replica_set", filter=Q(replica_set__state=s)) for s in STATES}
    counting = Count("replica_set", filter=Q(replica_set__state__in=Replica.COUNTING) & not_replacing)
    return queryset.annotate(n_counting=counting, **counts)


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

    class Meta:
        model = Replica
        fields = [
            "name",
            "model",
            "node",
            "gpu_index",
            "state",
            "restart",
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
    path = serializers.CharField(help_text="a file on the server, copied into the mirror")
    name = serializers.CharField(max_length=255, required=False, help_text="default: the file's name")


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


# Views


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()


REFUSED = {
    400: OpenApiResponse(
        ErrorSerializer, description='refused: `{"detail": "why"}`, or `{"field": ["why"]}` for a malformed field'
    )
}
MISSING = {404: OpenApiResponse(ErrorSerializer, description="no object by that name")}


class ClusterViewSet(viewsets.GenericViewSet):
    lookup_field = "name"
    # Any segment reaches the view, so an unknown or malformed name gets a JSON 404 naming it.
    lookup_value_regex = "[^/]+"
    missing = "no {value!r}"  # the 404's message

    @property
    def actor(self) -> str:
        return f"user:{self.request.user.username}"

    def parsed(self, serializer_class) -> dict:
        serializer = serializer_class(data=self.request.data)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def get_object(self):
        value = self.kwargs[self.lookup_url_kwarg or self.lookup_field]
        obj = self.get_queryset().filter(**{self.lookup_field: value}).first()
        if obj is None:
            raise exceptions.NotFound(self.missing.format(value=value))
        self.check_object_permissions(self.request, obj)
        return obj

    def shown(self, obj, status_code=status.HTTP_200_OK) -> Response:
        """The object as a GET would show it, read again so annotations are there."""
        fresh = self.get_queryset().get(pk=obj.pk)
        return Response(self.get_serializer(fresh).data, status=status_code)


def _flag(request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return False
    try:
        return serializers.BooleanField().to_internal_value(raw)
    except serializers.ValidationError:
        raise serializers.ValidationError({name: [f"must be true or false, not {raw!r}"]}) from None


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """Machines with an agent. Adding one gives the token its agent dials in with."""

    serializer_class = NodeSerializer
    missing = "no node named {value!r}"

    def get_queryset(self):
        over = Q(replicas__state__in=Replica.TERMINAL)
        return Node.objects.annotate(replica_count=Count("replicas", filter=~over)).order_by("name")

    @extend_schema(request=NodeCreateSerializer, responses={201: NewNodeSerializer, **REFUSED})
    def create(self, request):
        data = self.parsed(NodeCreateSerializer)
        with refused():
            node, token = operations.add_node(data["name"], self.actor)
        server = (settings.LLMGW_PUBLIC_URL or request.build_absolute_uri("/")).rstrip("/")
        node = self.get_queryset().get(pk=node.pk)
        node.token = token
        node.agent_command = (
            f"python manage.py llmgw agent --server {shlex.quote(server)} --token {shlex.quote(token)}"
        )
        return Response(NewNodeSerializer(node).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[
            OpenApiParameter("force", bool, description="remove it even with replicas on it (they count as failed)")
        ],
        responses={204: None, **REFUSED, **MISSING},
    )
    def destroy(self, request, name=None):
        force = _flag(request, "force")
        node = self.get_object()
        with refused():
            operations.remove_node(node.name, self.actor, force=force)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ServedModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """What to serve. Removing one stops its replicas first; it disappears once they have stopped."""

    serializer_class = ServedModelSerializer
    missing = "no model named {value!r}"

    def get_queryset(self):
        return _with_replica_counts(Model.objects.select_related("file", "engine", "profile")).order_by("name")

    @extend_schema(request=ServedModelCreateSerializer, responses={201: ServedModelSerializer, **REFUSED})
    def create(self, request):
        data = self.parsed(ServedModelCreateSerializer)
        with refused(reads_files=True):
            model = operations.add_model(actor=self.actor, **data)
        return self.shown(model, status.HTTP_201_CREATED)

    @extend_schema(request=ServedModelUpdateSerializer, responses={200: ServedModelSerializer, **REFUSED, **MISSING})
    def update(self, request, name=None):
        """Change what is given; fields left out stay as they are (PUT and PATCH alike)."""
        model = self.get_object()
        data = self.parsed(ServedModelUpdateSerializer)
        with refused(reads_files=True):
            model = operations.set_model(model.name, self.actor, **data)
        return self.shown(model)

    @extend_schema(request=ServedModelUpdateSerializer, responses={200: ServedModelSerializer, **REFUSED, **MISSING})
    def partial_update(self, request, name=None):
        return self.update(request, name=name)

    @extend_schema(request=None, responses={202: ServedModelSerializer, **REFUSED, **MISSING})
    def destroy(self, request, name=None):
        model = self.get_object()
        with refused():
            removed = operations.remove_model(model.name, self.actor)
        # Not read again: the reconciler may already have deleted a model that had no replicas.
        model.removing = removed.removing
        return Response(self.get_serializer(model).data, status=status.HTTP_202_ACCEPTED)


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("model", str, description="only this model's replicas"),
            OpenApiParameter("node", str, description="only the replicas on this node"),
            OpenApiParameter("state", str, enum=STATES, description="only replicas in this state"),
        ]
    )
)
class ReplicaViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """Engine processes, one per replica; the reconciler makes and ends them."""

    missing = "no replica named {value!r}"

    def get_serializer_class(self):
        return ReplicaDetailSerializer if self.action == "retrieve" else ReplicaSerializer

    def get_queryset(self):
        queryset = Replica.objects.select_related("model", "node").order_by("model__name", "name")
        if self.action != "list":
            return queryset
        params = self.request.query_params
        if "model" in params:
            if not Model.objects.filter(name=params["model"]).exists():
                raise serializers.ValidationError({"model": [f"no model named {params['model']!r}"]})
            queryset = queryset.filter(model__name=params["model"])
        if "node" in params:
            if not Node.objects.filter(name=params["node"]).exists():
                raise serializers.ValidationError({"node": [f"no node named {params['node']!r}"]})
            queryset = queryset.filter(node__name=params["node"])
        if "state" in params:
            if params["state"] not in STATES:
                known = ", ".join(STATES)
                raise serializers.ValidationError({"state": [f"unknown state {params['state']!r} (known: {known})"]})
            queryset = queryset.filter(state=params["state"])
        return queryset.defer("log_tail")


class ProfileViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """Named sets of engine arguments. Editing one changes no running replica until it is restarted."""

    serializer_class = ProfileSerializer
    missing = "no profile named {value!r}"
    queryset = Profile.objects.order_by("name")

    @extend_schema(request=ProfileCreateSerializer, responses={201: ProfileSerializer, **REFUSED})
    def create(self, request):
        data = self.parsed(ProfileCreateSerializer)
        with refused():
            profile = operations.add_profile(data.pop("name"), self.actor, **data)
        return self.shown(profile, status.HTTP_201_CREATED)

    @extend_schema(request=ProfileUpdateSerializer, responses={200: ProfileSerializer, **REFUSED, **MISSING})
    def update(self, request, name=None):
        """Change what is given; fields left out stay as they are (PUT and PATCH alike)."""
        profile = self.get_object()
        data = self.parsed(ProfileUpdateSerializer)
        with refused():
            profile = operations.set_profile(profile.name, self.actor, **data)
        return self.shown(profile)

    @extend_schema(request=ProfileUpdateSerializer, responses={200: ProfileSerializer, **REFUSED, **MISSING})
    def partial_update(self, request, name=None):
        return self.update(request, name=name)

    @extend_schema(responses={204: None, **REFUSED, **MISSING})
    def destroy(self, request, name=None):
        profile = self.get_object()
        with refused():
            operations.remove_profile(profile.name, self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class EngineViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """Engine kinds and versions models can run on."""

    serializer_class = EngineSerializer
    missing = "no engine named {value!r}"
    queryset = EngineVersion.objects.order_by("name")

    @extend_schema(request=EngineCreateSerializer, responses={201: EngineSerializer, **REFUSED})
    def create(self, request):
        data = self.parsed(EngineCreateSerializer)
        with refused():
            engine = operations.add_engine(data.pop("name"), data.pop("kind"), self.actor, **data)
        return self.shown(engine, status.HTTP_201_CREATED)


class ModelFileViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """Files in the mirror, by sha256. Importing copies a file on the server into the mirror."""

    serializer_class = ModelFileSerializer
    missing = "no model file with sha256 {value!r} in the mirror"
    queryset = ModelFile.objects.order_by("name", "sha256")
    lookup_field = "sha256"

    @extend_schema(
        request=ModelFileImportSerializer,
        responses={
            201: ModelFileSerializer,
            200: OpenApiResponse(ModelFileSerializer, description="the mirror already had this file"),
            **REFUSED,
        },
    )
    def create(self, request):
        data = self.parsed(ModelFileImportSerializer)
        with refused(reads_files=True):
            model_file, created = operations.import_model_file(data["path"], self.actor, name=data.get("name"))
        return self.shown(model_file, status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@extend_schema(
    parameters=[
        OpenApiParameter("kind", str, description="e.g. model.added"),
        OpenApiParameter("subject", str, description="what it happened to, e.g. a model or replica name"),
        OpenApiParameter("actor", str, description="who did it, e.g. user:alice, reconciler"),
        OpenApiParameter("since", OpenApiTypes.DATETIME, description="only events at or after this ISO 8601 time"),
    ]
)
class EventViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """What happened and who did it, newest first."""

    serializer_class = EventSerializer

    def get_queryset(self):
        queryset = Event.objects.order_by("-created_at", "-id")
        params = self.request.query_params
        for key in ("kind", "subject", "actor"):
            if key in params:
                queryset = queryset.filter(**{key: params[key]})
        if "since" in params:
            queryset = queryset.filter(created_at__gte=_datetime_param("since", params["since"]))
        return queryset


def _datetime_param(name: str, raw: str):
    try:
        value = parse_datetime(raw.strip())
    except ValueError:  # well formed but impossible, e.g. month 13
        value = None
    if value is None:
        raise serializers.ValidationError(
            {name: [f"must be an ISO 8601 date and time, e.g. 2025-01-31T12:00:00Z, not {raw!r}"]}
        )
    if timezone.is_naive(value):
        value = timezone.make_aware(value)
    return value


class StatusView(APIView):
    """The cluster's summary, saying when serving is stopped."""

    @extend_schema(responses=StatusSerializer)
    def get(self, request):
        return Response(operations.cluster_status())


class UserViewSet(ClusterViewSet):
    """API users. Adding one needs the admin role; the token is shown once."""

    required_role = "admin"
    serializer_class = NewUserSerializer

    @extend_schema(request=UserCreateSerializer, responses={201: NewUserSerializer, **REFUSED})
    def create(self, request):
        data = self.parsed(UserCreateSerializer)
        with refused():
            user, token = operations.add_user(data["name"], data["role"], self.actor, password=data.get("password"))
        return Response({"name": user.username, "role": data["role"], "token": token}, status=status.HTTP_201_CREATED)


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
