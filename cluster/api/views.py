"""The API's viewsets: each parses with a serializer, calls `cluster.operations`, and shows the result."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from cluster import operations, peers, queries
from cluster.api.base import BIGINT_MAX, NamedViewSet, actor_of, datetime_param, flag_param, int_param, text_param
from cluster.api.errors import Refused, refused
from cluster.api.model_serializers import (
    STATES,
    ServedModelCreateSerializer,
    ServedModelSerializer,
    ServedModelUpdateSerializer,
)
from cluster.api.parsers import JSONParser
from cluster.api.rollouts import ModelRolloutActions
from cluster.api.schema import UNKNOWN_FILTER, ErrorSerializer
from cluster.api.serializers import (
    ClusterSettingsSerializer,
    ClusterSettingsUpdateSerializer,
    ControlPlaneRemovedSerializer,
    ControlPlaneSerializer,
    ControlPlaneTokenSerializer,
    EngineCreateSerializer,
    EngineKeyRotatedSerializer,
    EngineKeyShownSerializer,
    EngineSerializer,
    EngineUpdateSerializer,
    EventSerializer,
    LoggedInSerializer,
    LoginSerializer,
    MeSerializer,
    ModelFileImportSerializer,
    ModelFileSerializer,
    ModelFileUploadSerializer,
    NewNodeSerializer,
    NewNodeTokenSerializer,
    NewUserSerializer,
    NodeCreateSerializer,
    NodeDrainSerializer,
    NodeSerializer,
    NodeTokenSerializer,
    ProfileCreateSerializer,
    ProfileSerializer,
    ProfileUpdateSerializer,
    ReplicaDetailSerializer,
    ReplicaSerializer,
    RestartQueuedSerializer,
    RestartSerializer,
    StatusSerializer,
    SystemRestartRequestSerializer,
    SystemRestartSerializer,
    UserCreateSerializer,
    UserSerializer,
)
from cluster.clients import agents_url
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Machines with an agent. Adding one gives the token its agent dials in with."""

    serializer_class = NodeSerializer
    missing = "no node named {value!r}"

    def get_queryset(self):
        return queries.nodes_with_counts()

    @extend_schema(request=NodeCreateSerializer, responses={201: NewNodeSerializer})
    def create(self, request):
        data = self.parsed(NodeCreateSerializer)
        with refused():
            node, token = operations.add_node(data["name"], self.actor)
        node = self.get_queryset().get(pk=node.pk)
        node.token = token
        node.agent_command = operations.agent_command(self._agents_url(data), token)
        return Response(NewNodeSerializer(node).data, status=status.HTTP_201_CREATED)

    def _agents_url(self, data: dict) -> str:
        return data.get("server") or agents_url(self.request)

    @extend_schema(request=NodeTokenSerializer, responses={200: NewNodeTokenSerializer})
    @action(detail=True, methods=["post"])
    def token(self, request, name=None):
        """A new token for the node's agent; the old one stops working and its stream is closed."""
        node = self.get_object()
        empty = isinstance(request.data, dict) and not request.data
        data = {} if empty else self.parsed(NodeTokenSerializer)
        with refused():
            node, token = operations.reset_node_token(node.name, self.actor)
        return Response({"name": node.name, "token": token,
                         "agent_command": operations.agent_command(self._agents_url(data), token)})

    @extend_schema(
        parameters=[
            OpenApiParameter("force", bool, description="remove it even with replicas on it (they count as failed)")
        ],
        responses={204: None},
    )
    def destroy(self, request, name=None):
        force = flag_param(request, "force")
        node = self.get_object()
        with refused():
            operations.remove_node(node.name, self.actor, force=force)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=NodeDrainSerializer, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """It takes no new replicas; its replicas are replaced elsewhere, one at a time per model, each serving
        until its replacement is ready. One with nowhere else to go stays (the drain is `blocked`), unless
        `force`. `drain` shows `drained` once nothing is left on it."""
        node = self.get_object()
        # no body, or {}: not forced; a body that is not an object (`null`, `false`) is refused as malformed
        empty = isinstance(request.data, dict) and not request.data
        data = {"force": False} if empty else self.parsed(NodeDrainSerializer)
        with refused():
            node = operations.drain_node(node.name, self.actor, force=data["force"])
        return self.shown(node)

    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def undrain(self, request, name=None):
        """It takes new replicas again; replicas not yet moved off it stay."""
        node = self.get_object()
        with refused():
            node = operations.undrain_node(node.name, self.actor)
        return self.shown(node)


class ServedModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ModelRolloutActions):
    """What to serve. Removing one stops its replicas first; it disappears once they have stopped. A change
    may be tried on canary replicas first: `rollout/` (cluster.api.rollouts)."""

    serializer_class = ServedModelSerializer
    missing = "no model named {value!r}"

    def get_queryset(self):
        return queries.models_with_counts()

    @extend_schema(request=ServedModelCreateSerializer, responses={201: ServedModelSerializer})
    def create(self, request):
        data = self.parsed(ServedModelCreateSerializer)
        with refused(reads_files=True):
            model = operations.add_model(actor=self.actor, **data)
        return self.shown(model, status.HTTP_201_CREATED)

    @extend_schema(request=ServedModelUpdateSerializer, responses={200: ServedModelSerializer})
    def update(self, request, name=None):
        """Change what is given; fields left out stay as they are (PUT and PATCH alike)."""
        model = self.get_object()
        data = self.parsed(ServedModelUpdateSerializer)
        with refused(reads_files=True):
            model = operations.set_model(model.name, self.actor, **data)
        return self.shown(model)

    @extend_schema(request=ServedModelUpdateSerializer, responses={200: ServedModelSerializer})
    def partial_update(self, request, name=None):
        return self.update(request, name=name)

    @extend_schema(request=None, responses={202: ServedModelSerializer})
    def destroy(self, request, name=None):
        model = self.get_object()
        with refused():
            removed = operations.remove_model(model.name, self.actor)
        # Not read again: the reconciler may already have deleted a model that had no replicas.
        model.removing = removed.removing
        return Response(self.get_serializer(model).data, status=status.HTTP_202_ACCEPTED)


@extend_schema_view(
    list=extend_schema(
        responses={200: ReplicaSerializer(many=True), **UNKNOWN_FILTER},
        parameters=[
            OpenApiParameter("model", {"type": "string", "minLength": 1}, description="only this model's replicas"),
            OpenApiParameter("node", {"type": "string", "minLength": 1}, description="only the replicas on this node"),
            OpenApiParameter("state", str, enum=STATES, description="only replicas in this state"),
            OpenApiParameter(
                "current", bool,
                description="only the replicas `ctl replicas` lists: those not over, and those failed in the "
                "last 10 minutes",
            ),
        ]
    )
)
class ReplicaViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Engine processes, one per replica; the reconciler makes and ends them."""

    missing = "no replica named {value!r}"

    def get_serializer_class(self):
        return ReplicaDetailSerializer if self.action == "retrieve" else ReplicaSerializer

    def get_serializer_context(self):
        from cluster.models import ClusterSettings

        # The engine key (and the rest) once per request, for every replica's `stale`.
        return {**super().get_serializer_context(), "cluster": ClusterSettings.load()}

    def get_queryset(self):
        if self.action != "list":
            return queries.replicas_listed(include_over=True).order_by("model__name", "name")
        params = self.request.query_params
        current = flag_param(self.request, "current")
        queryset = queries.replicas_listed(include_over=not current).order_by("model__name", "name")
        for name, model in (("model", Model), ("node", Node)):
            value = text_param(self.request, name, required_text=True)
            if value is None:
                continue
            if not model.objects.filter(name=value).exists():
                raise Refused(f"no {name} named {value!r}")
            queryset = queryset.filter(**{f"{name}__name": value})
        if "state" in params:
            if params["state"] not in STATES:
                known = ", ".join(STATES)
                raise serializers.ValidationError({"state": [f"unknown state {params['state']!r} (known: {known})"]})
            queryset = queryset.filter(state=params["state"])
        return queryset.defer("log_tail")


class ProfileViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Named sets of engine arguments. Editing one changes no running replica until it is restarted."""

    serializer_class = ProfileSerializer
    missing = "no profile named {value!r}"
    queryset = Profile.objects.order_by("name")

    @extend_schema(request=ProfileCreateSerializer, responses={201: ProfileSerializer})
    def create(self, request):
        data = self.parsed(ProfileCreateSerializer)
        with refused():
            profile = operations.add_profile(data.pop("name"), self.actor, **data)
        return self.shown(profile, status.HTTP_201_CREATED)

    @extend_schema(request=ProfileUpdateSerializer, responses={200: ProfileSerializer})
    def update(self, request, name=None):
        """Change what is given; fields left out stay as they are (PUT and PATCH alike)."""
        profile = self.get_object()
        data = self.parsed(ProfileUpdateSerializer)
        with refused():
            profile = operations.set_profile(profile.name, self.actor, **data)
        return self.shown(profile)

    @extend_schema(request=ProfileUpdateSerializer, responses={200: ProfileSerializer})
    def partial_update(self, request, name=None):
        return self.update(request, name=name)

    @extend_schema(responses={204: None})
    def destroy(self, request, name=None):
        profile = self.get_object()
        with refused():
            operations.remove_profile(profile.name, self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class EngineViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Engine kinds and versions models can run on."""

    serializer_class = EngineSerializer
    missing = "no engine named {value!r}"
    queryset = EngineVersion.objects.order_by("name")

    @extend_schema(request=EngineCreateSerializer, responses={201: EngineSerializer})
    def create(self, request):
        data = self.parsed(EngineCreateSerializer)
        with refused():
            engine = operations.add_engine(data.pop("name"), data.pop("kind"), self.actor, **data)
        return self.shown(engine, status.HTTP_201_CREATED)

    @extend_schema(request=EngineUpdateSerializer, responses={200: EngineSerializer})
    def update(self, request, name=None):
        """Change what a command engine serves; fields left out stay as they are (PUT and PATCH alike)."""
        engine = self.get_object()
        data = self.parsed(EngineUpdateSerializer)
        with refused():
            engine = operations.set_engine(engine.name, self.actor, **data)
        return self.shown(engine)

    @extend_schema(request=EngineUpdateSerializer, responses={200: EngineSerializer})
    def partial_update(self, request, name=None):
        return self.update(request, name=name)


class ModelFileViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Files in the mirror, by sha256. Importing copies a file on the server into the mirror, or takes one
    uploaded as multipart/form-data."""

    serializer_class = ModelFileSerializer
    parser_classes = [JSONParser, MultiPartParser]  # a path as JSON, or the file itself
    missing = "no model file with sha256 {value!r} in the mirror"
    queryset = ModelFile.objects.order_by("name", "sha256").prefetch_related("copies__control_plane")
    lookup_field = "sha256"

    @extend_schema(
        request={"application/json": ModelFileImportSerializer, "multipart/form-data": ModelFileUploadSerializer},
        responses={
            201: ModelFileSerializer,
            200: OpenApiResponse(ModelFileSerializer, description="the mirror already had this file"),
        },
    )
    def create(self, request):
        uploaded = request.content_type.startswith("multipart/")
        data = self.parsed(ModelFileUploadSerializer if uploaded else ModelFileImportSerializer)
        with refused(reads_files=True):
            if uploaded:
                model_file, created = operations.import_uploaded_file(data["file"], self.actor)
            else:
                model_file, created = operations.import_model_file(data["path"], self.actor, name=data.get("name"))
        return self.shown(model_file, status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class ControlPlaneViewSet(mixins.ListModelMixin, NamedViewSet):
    """The control planes, each with its own mirror of model files (docs/high-availability.md). Removing one or
    giving it a new token needs the admin role."""

    required_role = "admin"
    serializer_class = ControlPlaneSerializer

    def get_queryset(self):
        return peers.listed()

    @extend_schema(
        parameters=[OpenApiParameter("force", bool, description="even the control plane answering this request")],
        responses={200: ControlPlaneRemovedSerializer},
    )
    def destroy(self, request, name=None):
        """Forget it: its token no longer opens /mirror, and what it said it held goes. The control plane answering
        the request is refused (409) unless `force`."""
        force = flag_param(request, "force")
        with refused(named=True):
            removal = operations.remove_control_plane(name, self.actor, force=force)
        return Response(ControlPlaneRemovedSerializer(removal).data)

    @extend_schema(request=None, responses={200: ControlPlaneTokenSerializer})
    @action(detail=True, methods=["post"])
    def token(self, request, name=None):
        """A new token, made by that control plane: at once where it is the one answering (the old token stops
        working), else by its worker at its next heartbeat (`rotation_asked_at` until then)."""
        with refused(named=True):
            rotation = operations.rotate_control_plane_token(name, self.actor)
        rotation.plane.rotated = rotation.now  # type: ignore[attr-defined]  # the serializer's field of the answer
        return Response(ControlPlaneTokenSerializer(rotation.plane).data)


@extend_schema(
    parameters=[
        OpenApiParameter("kind", str, description="e.g. model.added"),
        OpenApiParameter("subject", str, description="what it happened to, e.g. a model or replica name"),
        OpenApiParameter("actor", str, description="who did it, e.g. user:alice, reconciler"),
        OpenApiParameter("since", OpenApiTypes.DATETIME, description="only events at or after this ISO 8601 time"),
        OpenApiParameter("kind_prefix", str, description="only kinds starting with this, e.g. replica."),
        OpenApiParameter("after", {"type": "integer", "format": "int64", "minimum": 0, "maximum": BIGINT_MAX},
                         description="only events after the one with this id (to follow the log)"),
    ]
)
class EventViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """What happened and who did it, newest first."""

    serializer_class = EventSerializer

    def get_queryset(self):
        queryset = Event.objects.order_by("-created_at", "-id")
        params = self.request.query_params
        for key, lookup in (("kind", "kind"), ("subject", "subject"), ("actor", "actor"),
                            ("kind_prefix", "kind__startswith")):
            value = text_param(self.request, key)
            if value is not None:
                queryset = queryset.filter(**{lookup: value})
        if "after" in params:
            queryset = queryset.filter(pk__gt=int_param("after", params["after"]))
        if "since" in params:
            queryset = queryset.filter(created_at__gte=datetime_param("since", params["since"]))
        return queryset


class StatusView(APIView):
    """The cluster's summary, saying when serving is stopped."""

    @extend_schema(responses=StatusSerializer)
    def get(self, request):
        return Response(queries.cluster_status())


class LoginView(APIView):
    """A user name and password for the user's API token (what `llmgw login` asks for). Failures are throttled
    as the dashboard's login is: per address, per user name at that address and per user name from any address
    but the user's known places, 429 with the wait."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]

    def get_authenticate_header(self, request):
        return "Bearer"  # a wrong password is a 401 (with the header a 401 needs), not a 403

    @extend_schema(request=LoginSerializer, responses={200: LoggedInSerializer, 401: ErrorSerializer,
                                                       429: ErrorSerializer})
    def post(self, request):
        from django.contrib.auth import authenticate

        from cluster import throttle
        from cluster.clients import client_address
        from cluster.locks import redis_client
        from cluster.roles import role_of

        serializer = LoginSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        name, password = serializer.validated_data["name"], serializer.validated_data["password"]
        redis, address = redis_client(), client_address(request.META)
        found = throttle.login_subjects(redis, address, name)
        wait = throttle.LOGIN.shut(found)
        if wait:
            raise exceptions.Throttled(wait, "Too many failed logins.")
        user = authenticate(request, username=name, password=password)
        if user is None or not user.is_active:
            throttle.LOGIN.failed(redis, found)
            raise exceptions.AuthenticationFailed("wrong user name or password")
        throttle.logged_in(redis, address, user.username)
        token = operations.api_token(user, "llmgw login")
        return Response({"name": user.username, "role": role_of(user), "token": token})


class MeView(APIView):
    """Who this token (or session) is, and its role: what `llmgw login` checks and says."""

    @extend_schema(responses=MeSerializer)
    def get(self, request):
        from cluster.roles import role_of

        return Response({"name": request.user.username, "role": role_of(request.user)})


class UserViewSet(NamedViewSet):
    """API users. Listing or adding them needs the admin role; a token is shown once, when made."""

    required_role = "admin"
    serializer_class = UserSerializer

    @extend_schema(responses={200: UserSerializer(many=True)})
    def list(self, request):
        from cluster.roles import role_of

        if role_of(request.user) != "admin":
            raise exceptions.PermissionDenied("users are listed to admins only")
        rows = queries.users_listed()
        page = self.paginate_queryset(rows)  # type: ignore[arg-type]  # DRF pages any sequence; its stubs say a QuerySet
        return self.get_paginated_response(UserSerializer(page, many=True).data)

    @extend_schema(request=UserCreateSerializer, responses={201: NewUserSerializer})
    def create(self, request):
        data = self.parsed(UserCreateSerializer)
        with refused():
            user, token = operations.add_user(data["name"], data["role"], self.actor, password=data.get("password"))
        return Response({"name": user.username, "role": data["role"], "token": token}, status=status.HTTP_201_CREATED)


class SystemViewSet(NamedViewSet):
    """The whole system: stop serving (every model to zero replicas, /v1/ answers 503), start again, status."""

    serializer_class = StatusSerializer

    @extend_schema(request=None, responses={200: StatusSerializer})
    @action(detail=False, methods=["post"])
    def stop(self, request):
        """Every model goes to zero replicas, freeing every GPU; /v1/ answers 503 `system_stopped` until start."""
        with refused():
            operations.stop_serving(self.actor)
        return Response(queries.cluster_status())

    @extend_schema(request=None, responses={200: StatusSerializer})
    @action(detail=False, methods=["post"])
    def start(self, request):
        """Every model is placed again as it asks; /v1/ answers again."""
        with refused():
            operations.start_serving(self.actor)
        return Response(queries.cluster_status())

    @extend_schema(
        request=SystemRestartRequestSerializer,
        responses={
            202: SystemRestartSerializer,
            503: OpenApiResponse(ErrorSerializer, description="the broker (Redis) did not take the restart"),
        },
    )
    @action(detail=False, methods=["post"])
    def restart(self, request):
        """Every agent restarts over its stream, then every web, beat and worker process; engines keep serving.
        Runs on a worker; each step is an Event. 409 while one runs or is queued."""
        from cluster.system import queue_restart

        empty = isinstance(request.data, dict) and not request.data
        data = {} if empty else self.parsed(SystemRestartRequestSerializer)
        with refused():
            queue_restart(self.actor, timeout=data.get("timeout"))
        return Response({"queued": True, "watch": "/api/v1/events/"}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=StatusSerializer)
    @action(detail=False, methods=["get"])
    def status(self, request):
        """The cluster's summary, saying when serving is stopped (the same as /api/v1/status/)."""
        return Response(queries.cluster_status())


# Restart and drain (node drains are actions on NodeViewSet)


class RestartView(APIView):
    """Replace replicas without taking them out of service first: each keeps serving while a replacement
    starts beside it, then drains. One at a time per model; different models in parallel."""

    @extend_schema(request=RestartSerializer, responses={202: RestartQueuedSerializer})
    def post(self, request):
        serializer = RestartSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        with refused():
            queued = operations.restart_replicas(
                actor_of(request),
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

    @extend_schema(request=None, responses={200: EngineKeyRotatedSerializer})
    def post(self, request):
        from cluster.models import ClusterSettings

        with refused():
            cluster = operations.rotate_engine_key(actor_of(request))
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
        return Response(queries.cluster_settings_shown())

    @extend_schema(request=ClusterSettingsUpdateSerializer, responses={200: ClusterSettingsSerializer})
    def patch(self, request):
        serializer = ClusterSettingsUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with refused():
            cluster = operations.set_settings(actor_of(request), **serializer.validated_data)
        return Response(queries.cluster_settings_shown(cluster))


class EngineKeyView(APIView):
    """The engine key itself, to talk to an engine directly (what `ctl engine-key show` prints). Admins only."""

    @extend_schema(responses={200: EngineKeyShownSerializer})
    def get(self, request):
        from cluster.models import ClusterSettings
        from cluster.roles import role_of

        if role_of(request.user) != "admin":
            raise exceptions.PermissionDenied("the engine key is shown to admins only")
        cluster = ClusterSettings.load()
        return Response({"engine_key": cluster.engine_key, "fingerprint": ClusterSettings.fingerprint(cluster.engine_key)})


class NoSuchPathView(APIView):
    """Any path under /api/ that no endpoint answers, by any method and for anyone (the schema lists the paths
    anyway): a 404 in the API's JSON, never Django's HTML page, DEBUG or not. A GET or HEAD that lacks only its
    trailing slash is sent to it, as Django's APPEND_SLASH does; another method is told where it meant (a POST
    cannot follow a redirect with its body)."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]
    schema = None

    def answer(self, request, *args, **kwargs):
        from django.http import HttpResponsePermanentRedirect
        from django.urls import Resolver404, resolve

        path = request.path_info
        meant = ""
        if not path.endswith("/"):
            try:
                match = resolve(path + "/")
            except Resolver404:
                match = None
            if match is not None and getattr(match.func, "view_class", None) is not NoSuchPathView:
                if request.method in ("GET", "HEAD"):
                    return HttpResponsePermanentRedirect(request.get_full_path(force_append_slash=True))
                meant = f": did you mean {request.path[:200]}/?"
        raise exceptions.NotFound(f"no API endpoint at {request.path[:200]}{meant}")

    http_method_not_allowed = options = answer  # every method, the ones no view names too
