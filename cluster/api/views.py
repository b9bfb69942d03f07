"""The API's viewsets: each parses with a serializer, calls `cluster.operations`, and shows the result."""

from __future__ import annotations

import shlex

from django.conf import settings
from django.db.models import Count, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from cluster import operations
from cluster.api.errors import refused
from cluster.api.schema import MISSING, REFUSED
from cluster.api.serializers import (
    EngineKeyShownSerializer,
    ClusterSettingsSerializer,
    ClusterSettingsUpdateSerializer,
    ApiKeyCreateSerializer,
    ApiKeySerializer,
    EngineCreateSerializer,
    EngineKeyRotatedSerializer,
    EngineSerializer,
    EventSerializer,
    ModelFileImportSerializer,
    ModelFileSerializer,
    NewApiKeySerializer,
    NewNodeSerializer,
    NewUserSerializer,
    NodeCreateSerializer,
    NodeDrainSerializer,
    NodeSerializer,
    ProfileCreateSerializer,
    ProfileSerializer,
    ProfileUpdateSerializer,
    ReplicaDetailSerializer,
    ReplicaSerializer,
    RestartQueuedSerializer,
    RestartSerializer,
    STATES,
    ServedModelCreateSerializer,
    ServedModelSerializer,
    ServedModelUpdateSerializer,
    StatusSerializer,
    SystemRestartSerializer,
    UsageSerializer,
    UserCreateSerializer,
)
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica
from gateway.models import ApiKey


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

    @extend_schema(request=NodeDrainSerializer, responses={200: NodeSerializer, **REFUSED, **MISSING})
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """It takes no new replicas; its replicas are replaced elsewhere, one at a time per model, each serving
        until its replacement is ready. One with nowhere else to go stays (the drain is `blocked`), unless
        `force`. `drain` shows `drained` once nothing is left on it."""
        node = self.get_object()
        data = self.parsed(NodeDrainSerializer) if request.data else {"force": False}
        with refused():
            node = operations.drain_node(node.name, self.actor, force=data["force"])
        return self.shown(node)

    @extend_schema(request=None, responses={200: NodeSerializer, **REFUSED, **MISSING})
    @action(detail=True, methods=["post"])
    def undrain(self, request, name=None):
        """It takes new replicas again; replicas not yet moved off it stay."""
        node = self.get_object()
        with refused():
            node = operations.undrain_node(node.name, self.actor)
        return self.shown(node)


def _with_replica_counts(queryset):
    not_replacing = ~Q(replica_set__restart=Replica.Restart.REPLACING)
    counts = {f"n_{s}": Count("replica_set", filter=Q(replica_set__state=s)) for s in STATES}
    counting = Count("replica_set", filter=Q(replica_set__state__in=Replica.COUNTING) & not_replacing)
    return queryset.annotate(n_counting=counting, **counts)


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

    def get_serializer_context(self):
        from cluster.models import ClusterSettings

        # The engine key (and the rest) once per request, for every replica's `stale`.
        return {**super().get_serializer_context(), "cluster": ClusterSettings.load()}

    def get_queryset(self):
        queryset = Replica.objects.select_related(
            "model__profile", "model__engine", "model__file", "node"
        ).order_by("model__name", "name")
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
    """Files in the mirror, by sha256. Importing copies a file on the server into the mirror, or takes one
    uploaded as multipart/form-data."""

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
            if "file" in data:
                model_file, created = operations.import_uploaded_file(data["file"], self.actor, name=data.get("name"))
            else:
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


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ClusterViewSet):
    """Client keys for /v1/. The key itself is shown once, when it is created; only its hash is kept."""

    serializer_class = ApiKeySerializer
    missing = "no key named {value!r}"
    queryset = ApiKey.objects.order_by("name")

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: NewApiKeySerializer, **REFUSED})
    def create(self, request):
        data = self.parsed(ApiKeyCreateSerializer)
        with refused():
            key, secret = operations.create_key(data.pop("name"), self.actor, **data)
        key.key = secret
        return Response(NewApiKeySerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: ApiKeySerializer, **REFUSED, **MISSING})
    @action(detail=True, methods=["post"])
    def revoke(self, request, name=None):
        """The key stops working at once, in every web process; its usage stays."""
        key = self.get_object()
        with refused():
            key = operations.revoke_key(key.name, self.actor)
        return self.shown(key)


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("key", str, description="only this key's usage (a key name)"),
            OpenApiParameter("model", str, description="only this model's usage"),
            OpenApiParameter("since", OpenApiTypes.DATETIME, description="only the hours from this ISO 8601 time on"),
        ]
    )
)
class UsageViewSet(viewsets.GenericViewSet):
    """Requests and tokens per key, model and hour, newest first. The gateway's counts reach it within a minute."""

    serializer_class = UsageSerializer

    def list(self, request):
        params = request.query_params
        since = _datetime_param("since", params["since"]) if params.get("since") else None
        try:
            rows = operations.usage_report(
                key=params.get("key") or None, model=params.get("model") or None, since=since
            )
        except operations.NotFound as exc:
            raise serializers.ValidationError({"key": [str(exc)]}) from None
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)


class SystemViewSet(ClusterViewSet):
    """The whole system: stop serving (every model to zero replicas, /v1/ answers 503), start again, status."""

    serializer_class = StatusSerializer

    @extend_schema(request=None, responses={200: StatusSerializer, **REFUSED})
    @action(detail=False, methods=["post"])
    def stop(self, request):
        """Every model goes to zero replicas, freeing every GPU; /v1/ answers 503 `system_stopped` until start."""
        with refused():
            operations.stop_serving(self.actor)
        return Response(operations.cluster_status())

    @extend_schema(request=None, responses={200: StatusSerializer, **REFUSED})
    @action(detail=False, methods=["post"])
    def start(self, request):
        """Every model is placed again as it asks; /v1/ answers again."""
        with refused():
            operations.start_serving(self.actor)
        return Response(operations.cluster_status())

    @extend_schema(request=None, responses={202: SystemRestartSerializer, **REFUSED})
    @action(detail=False, methods=["post"])
    def restart(self, request):
        """Every agent restarts over its stream, then every web, beat and worker process; engines keep serving.
        Runs on a worker; each step is an Event. 400 while one runs."""
        from cluster.system import queue_restart

        with refused():
            queue_restart(self.actor)
        return Response({"queued": True, "watch": "/api/v1/events/"}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=StatusSerializer)
    @action(detail=False, methods=["get"])
    def status(self, request):
        """The cluster's summary, saying when serving is stopped (the same as /api/v1/status/)."""
        return Response(operations.cluster_status())


# Restart and drain (node drains are actions on NodeViewSet)


class RestartView(APIView):
    """Replace replicas without taking them out of service first: each keeps serving while a replacement
    starts beside it, then drains. One at a time per model; different models in parallel."""

    @extend_schema(request=RestartSerializer, responses={202: RestartQueuedSerializer, **REFUSED})
    def post(self, request):
        serializer = RestartSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        with refused():
            queued = operations.restart_replicas(
                f"user:{request.user.username}",
                replicas=data["replicas"],
                models=data["models"],
                all=data["all"],
                stale=data["stale"],
            )
        skipped = [{"name": name, "why": why} for name, why in queued.skipped.items()]
        return Response({"queued": list(queued), "skipped": skipped}, status=status.HTTP_202_ACCEPTED)


class RestartNoSlashView(RestartView):
    """`POST /api/v1/restart` as the issue spells it (a POST cannot follow a redirect to the slash)."""

    schema = None  # the same endpoint as restart/, listed once


class EngineKeyRotateView(APIView):
    """A new engine key. Running replicas keep the old one until restarted (the gateway uses each replica's
    own key meanwhile); refused while a replica still runs with the key before the current one."""

    @extend_schema(request=None, responses={200: EngineKeyRotatedSerializer, **REFUSED})
    def post(self, request):
        from cluster.models import ClusterSettings

        with refused():
            cluster = operations.rotate_engine_key(f"user:{request.user.username}")
        stale = (
            Replica.objects.exclude(state__in=Replica.TERMINAL)
            .filter(snapshot__engine_key=ClusterSettings.fingerprint(cluster.previous_engine_key))
            .count()
        )
        return Response({"fingerprint": ClusterSettings.fingerprint(cluster.engine_key), "stale": stale})


class SettingsView(APIView):
    """The cluster settings: drain grace and reconcile interval (PATCH changes those given)."""

    @extend_schema(responses={200: ClusterSettingsSerializer})
    def get(self, request):
        from cluster.models import ClusterSettings

        return Response(_settings_shown(ClusterSettings.load()))

    @extend_schema(request=ClusterSettingsUpdateSerializer, responses={200: ClusterSettingsSerializer, **REFUSED})
    def patch(self, request):
        serializer = ClusterSettingsUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with refused():
            cluster = operations.set_settings(f"user:{request.user.username}", **serializer.validated_data)
        return Response(_settings_shown(cluster))


def _settings_shown(cluster) -> dict:
    from cluster.models import ClusterSettings

    return {
        "drain_grace_seconds": cluster.drain_grace_seconds,
        "reconcile_interval_seconds": cluster.reconcile_interval_seconds,
        "serving_stopped": cluster.serving_stopped,
        "engine_key_fingerprint": ClusterSettings.fingerprint(cluster.engine_key),
    }


class EngineKeyView(APIView):
    """The engine key itself, to talk to an engine directly (what `ctl engine-key show` prints). Admins only."""

    @extend_schema(responses={200: EngineKeyShownSerializer, **REFUSED})
    def get(self, request):
        from cluster.models import ClusterSettings
        from cluster.roles import role_of

        if role_of(request.user) != "admin":
            raise exceptions.PermissionDenied("the engine key is shown to admins only")
        cluster = ClusterSettings.load()
        return Response({"engine_key": cluster.engine_key, "fingerprint": ClusterSettings.fingerprint(cluster.engine_key)})
