"""The gateway's REST API resources under /api/v1/: client keys (`keys/`) and their usage (`usage/`).

Serializers parse and show; gateway.operations changes state. Mounted with the cluster's resources on one
router by llmgw.api_urls.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from cluster.api.base import INT_MAX, NamedViewSet, NameField, StrictSerializer, datetime_param, text_param
from cluster.api.errors import refused
from cluster.api.schema import UNKNOWN_FILTER
from gateway import operations
from gateway.admission import CLASSES, DEFAULT_CLASS
from gateway.models import ApiKey

KEY_STATES = ["active", "revoked", "expired"]
PRIORITY_HELP = ("its requests' class when they wait for a slot: interactive first, then standard, then batch "
                 "(a request may lower its own with X-Llmgw-Priority)")


class ApiKeySerializer(serializers.ModelSerializer):
    models = serializers.ListField(
        source="allowed_models",
        child=serializers.CharField(),
        read_only=True,
        help_text="models it may use; empty: all",
    )
    priority = serializers.ChoiceField(choices=CLASSES, read_only=True, help_text=PRIORITY_HELP)
    state = serializers.SerializerMethodField(help_text="active, revoked or expired")

    class Meta:
        model = ApiKey
        fields = [
            "name",
            "prefix",
            "models",
            "rpm",
            "tpm",
            "max_tokens",
            "priority",
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
    name = NameField()
    models = serializers.ListField(child=NameField(), default=list, help_text="model names; empty: all")
    rpm = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, default=None, help_text="requests per minute; null: no limit"
    )
    tpm = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, default=None, help_text="tokens per minute; null: no limit"
    )
    expires_at = serializers.DateTimeField(allow_null=True, default=None, help_text="null: never")
    max_tokens = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, default=None,
        help_text="most tokens a completion may generate with this key, below the model's own cap; null: the model's",
    )
    priority = serializers.ChoiceField(choices=CLASSES, default=DEFAULT_CLASS, help_text=PRIORITY_HELP)


class ApiKeyUpdateSerializer(StrictSerializer):
    """What `PUT`/`PATCH /keys/{name}/` changes: the fields given; those left out stay as they are."""

    priority = serializers.ChoiceField(choices=CLASSES, required=False, help_text=PRIORITY_HELP)
    models = serializers.ListField(child=NameField(), required=False, help_text="model names; empty: all")
    rpm = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, required=False, help_text="requests per minute; null: no limit"
    )
    tpm = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, required=False, help_text="tokens per minute; null: no limit"
    )
    max_tokens = serializers.IntegerField(
        min_value=1, max_value=INT_MAX, allow_null=True, required=False,
        help_text="most tokens a completion may generate with this key, below the model's own cap; null: the model's",
    )
    expires_at = serializers.DateTimeField(allow_null=True, required=False, help_text="null: never")


class UsageSerializer(serializers.Serializer):
    key = serializers.CharField()
    model = serializers.CharField()
    hour = serializers.DateTimeField(help_text="the start of the hour")
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Client keys for /v1/. The key itself is shown once, when it is created; only its hash is kept."""

    serializer_class = ApiKeySerializer
    missing = "no key named {value!r}"
    queryset = ApiKey.objects.order_by("name")

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: NewApiKeySerializer})
    def create(self, request):
        data = self.parsed(ApiKeyCreateSerializer)
        with refused():
            key, secret = operations.create_key(data.pop("name"), self.actor, **data)
        key.key = secret
        return Response(NewApiKeySerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ApiKeyUpdateSerializer, responses={200: ApiKeySerializer})
    def update(self, request, name=None):
        """Change what is given; fields left out stay as they are (PUT and PATCH alike). A revoked key stays so."""
        key = self.get_object()
        data = self.parsed(ApiKeyUpdateSerializer)
        with refused():
            key = operations.set_key(key.name, self.actor, **data)
        return self.shown(key)

    @extend_schema(request=ApiKeyUpdateSerializer, responses={200: ApiKeySerializer})
    def partial_update(self, request, name=None):
        return self.update(request, name=name)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, name=None):
        """The key stops working at once, in every web process; its usage stays."""
        key = self.get_object()
        with refused():
            key = operations.revoke_key(key.name, self.actor)
        return self.shown(key)


@extend_schema_view(
    list=extend_schema(
        responses={200: UsageSerializer(many=True), **UNKNOWN_FILTER},
        parameters=[
            OpenApiParameter("key", {"type": "string", "minLength": 1}, description="only this key's usage (a key name)"),
            OpenApiParameter("model", {"type": "string", "minLength": 1}, description="only this model's usage"),
            OpenApiParameter("since", OpenApiTypes.DATETIME, description="only the hours from this ISO 8601 time on"),
        ]
    )
)
class UsageViewSet(viewsets.GenericViewSet):
    """Requests and tokens per key, model and hour, newest first. The gateway's counts reach it within a minute."""

    serializer_class = UsageSerializer

    def list(self, request):
        params = request.query_params
        since = datetime_param("since", params["since"]) if "since" in params else None
        key, model = (text_param(request, name, required_text=True) for name in ("key", "model"))
        with refused():  # a key that does not exist: 422
            rows = operations.usage_report(key=key, model=model, since=since)
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)


ROUTES = [("keys", ApiKeyViewSet, "key"), ("usage", UsageViewSet, "usage")]
