"""The gateway's REST API resources under /api/v1/: client keys (`keys/`), their usage (`usage/`) and the
records of the requests through /v1/ (`requests/`).

Serializers parse and show; gateway.operations changes state. Mounted with the cluster's resources on one
router by llmgw.api_urls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import exceptions, mixins, renderers, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from cluster.api.base import NamedViewSet, NameField, StrictSerializer, datetime_param, text_param
from cluster.api.errors import Refused, refused
from cluster.api.schema import UNKNOWN_FILTER
from cluster.models import Event
from cluster.roles import role_of
from gateway import budgets, operations, records, timeline
from gateway.admission import CLASSES, DEFAULT_CLASS
from gateway.models import USAGE_BY, ApiKey, RequestRecord
from gateway.operations import BUDGET_TOKENS, CONCURRENCY, KEY_LIMIT

KEY_STATES = ["active", "revoked", "expired"]
PRIORITY_HELP = ("its requests' class when they wait for a slot: interactive first, then standard, then batch "
                 "(a request may lower its own with X-Llmgw-Priority)")
BUDGET_TOKENS_HELP = ("tokens (prompt and completion) it may use per budget period; null: no budget (with "
                      "budget_period)")
BUDGET_PERIOD_HELP = "the budget's period, a calendar day, week (from Monday) or month in UTC; \"\": no budget"
CONCURRENCY_HELP = "most of its requests in flight or waiting at once, refused with a 429 past it; null: no limit"
LOG_BODIES_HELP = ("its requests' bodies and their answers' are kept in the requests' records, each truncated past "
                   "LLMGW_REQUEST_LOG_BODY_BYTES (32768 unless set), shown to admins only and pruned with the record; "
                   "headers never are. Off by default")


class KeyBudgetSerializer(serializers.Serializer[Mapping[str, object]]):
    """A key's budget and what it spent of it in the current period."""

    tokens = serializers.IntegerField(help_text="tokens (prompt and completion) per period")
    period = serializers.ChoiceField(choices=budgets.PERIODS, help_text="day, week or month, in UTC")
    spent = serializers.IntegerField(
        help_text="tokens it used since the period began, as the usage has them (the gateways' counts reach it "
                  "within a minute)")
    resets_at = serializers.DateTimeField(help_text="when the period ends and the budget is whole again")


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    models = serializers.ListField(
        source="allowed_models",
        child=serializers.CharField(),
        read_only=True,
        help_text="models it may use; empty: all",
    )
    priority = serializers.ChoiceField(choices=CLASSES, read_only=True, help_text=PRIORITY_HELP)
    state = serializers.SerializerMethodField(help_text="active, revoked or expired")
    budget = serializers.SerializerMethodField(help_text="its token budget and what it spent of it; null: none")
    log_bodies = serializers.BooleanField(read_only=True, help_text=LOG_BODIES_HELP)

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
            "budget",
            "max_concurrency",
            "log_bodies",
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

    @extend_schema_field(KeyBudgetSerializer(allow_null=True))
    def get_budget(self, key: ApiKey) -> Mapping[str, object] | None:
        return budgets.status(key, timezone.now())


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the key for `Authorization: Bearer`; shown this once")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]
        read_only_fields = fields


class ApiKeyCreateSerializer(StrictSerializer):
    name = NameField()
    models = serializers.ListField(child=NameField(), default=list, help_text="model names; empty: all")
    rpm = serializers.IntegerField(
        **KEY_LIMIT.limits, allow_null=True, default=None, help_text="requests per minute; null: no limit"
    )
    tpm = serializers.IntegerField(
        **KEY_LIMIT.limits, allow_null=True, default=None, help_text="tokens per minute; null: no limit"
    )
    expires_at = serializers.DateTimeField(allow_null=True, default=None, help_text="null: never")
    max_tokens = serializers.IntegerField(
        **KEY_LIMIT.limits, allow_null=True, default=None,
        help_text="most tokens a completion may generate with this key, below the model's own cap; null: the model's",
    )
    priority = serializers.ChoiceField(choices=CLASSES, default=DEFAULT_CLASS, help_text=PRIORITY_HELP)
    budget_tokens = serializers.IntegerField(
        **BUDGET_TOKENS.limits, allow_null=True, default=None, help_text=BUDGET_TOKENS_HELP)
    budget_period = serializers.ChoiceField(choices=budgets.PERIODS, allow_blank=True, default="",
                                            help_text=BUDGET_PERIOD_HELP)
    max_concurrency = serializers.IntegerField(
        **CONCURRENCY.limits, allow_null=True, default=None, help_text=CONCURRENCY_HELP)
    log_bodies = serializers.BooleanField(default=False, help_text=LOG_BODIES_HELP)


class ApiKeyUpdateSerializer(StrictSerializer):
    """What `PUT`/`PATCH /keys/{name}/` changes: the fields given; those left out stay as they are."""

    priority = serializers.ChoiceField(choices=CLASSES, required=False, help_text=PRIORITY_HELP)
    models = serializers.ListField(child=NameField(), required=False, help_text="model names; empty: all")
    rpm = serializers.IntegerField(
        **KEY_LIMIT.limits, allow_null=True, required=False, help_text="requests per minute; null: no limit"
    )
    tpm = serializers.IntegerField(
        **KEY_LIMIT.limits, allow_null=True, required=False, help_text="tokens per minute; null: no limit"
    )
    max_tokens = serializers.IntegerField(
        **KEY_LIMIT.limits, allow_null=True, required=False,
        help_text="most tokens a completion may generate with this key, below the model's own cap; null: the model's",
    )
    expires_at = serializers.DateTimeField(allow_null=True, required=False, help_text="null: never")
    budget_tokens = serializers.IntegerField(
        **BUDGET_TOKENS.limits, allow_null=True, required=False,
        help_text=BUDGET_TOKENS_HELP + "; alone, the period stays")
    budget_period = serializers.ChoiceField(choices=budgets.PERIODS, allow_blank=True, required=False,
                                            help_text=BUDGET_PERIOD_HELP + "; alone, the tokens stay")
    max_concurrency = serializers.IntegerField(
        **CONCURRENCY.limits, allow_null=True, required=False, help_text=CONCURRENCY_HELP)
    log_bodies = serializers.BooleanField(required=False, help_text=LOG_BODIES_HELP)


class UsageSerializer(serializers.Serializer[operations.UsageRow]):
    key = serializers.CharField()
    model = serializers.CharField()
    hour = serializers.DateTimeField(help_text="the start of the hour")
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    resumed_prompt_tokens = serializers.IntegerField(help_text=(
        "the prompt tokens of its answers' resumes on another replica (after an engine broke off mid-answer): the "
        "fleet's cost, not the key's; not counted in its budget or limits"))


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, NamedViewSet):
    """Client keys for /v1/. The key itself is shown once, when it is created; only its hash is kept."""

    serializer_class = ApiKeySerializer
    missing = "no key named {value!r}"
    queryset = ApiKey.objects.order_by("name")

    def get_queryset(self) -> QuerySet[ApiKey]:
        # with what each spent of its budget: no query per key for it
        keys: QuerySet[ApiKey] = budgets.with_spent(super().get_queryset(), timezone.now())
        return keys

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: NewApiKeySerializer})
    def create(self, request: Request) -> Response:
        data = self.parsed(ApiKeyCreateSerializer)
        with refused():
            key, secret = operations.create_key(data.pop("name"), self.actor, **data)
        key.key = secret  # type: ignore[attr-defined]  # no column: NewApiKeySerializer shows it this once
        return Response(NewApiKeySerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ApiKeyUpdateSerializer, responses={200: ApiKeySerializer})
    def update(self, request: Request, name: str | None = None) -> Response:
        """Change what is given; fields left out stay as they are (PUT and PATCH alike). A revoked key stays so."""
        key: ApiKey = self.get_object()
        data = self.parsed(ApiKeyUpdateSerializer)
        if "budget_tokens" in data and data["budget_tokens"] is None:
            data["budget_tokens"] = 0  # null: no budget, as set_key takes it
        with refused():
            key = operations.set_key(key.name, self.actor, **data)
        return self.shown(key)

    @extend_schema(request=ApiKeyUpdateSerializer, responses={200: ApiKeySerializer})
    def partial_update(self, request: Request, name: str | None = None) -> Response:
        return self.update(request, name=name)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, name: str | None = None) -> Response:
        """The key stops working at once, in every web process; its usage stays."""
        key: ApiKey = self.get_object()
        with refused():
            key = operations.revoke_key(key.name, self.actor)
        return self.shown(key)


class UsageCSVRenderer(renderers.BaseRenderer):
    """The usage as CSV (`?format=csv`, or `Accept: text/csv`): a header row, then a row per key, model and hour;
    a refusal stays JSON, as every refusal of the API is."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: Mapping[str, Any] | None = None) -> bytes:
        response = (renderer_context or {}).get("response")
        if response is not None and response.status_code >= 400:
            response["Content-Type"] = "application/json"
            said: bytes = renderers.JSONRenderer().render(data)
            return said
        return operations.usage_csv(data["results"] if isinstance(data, dict) else data).encode()


USAGE_FORMATS = ("json", "csv")


@extend_schema_view(
    list=extend_schema(
        responses={(200, "application/json"): UsageSerializer(many=True),
                   (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description=(
                       "a header row (key, model, hour, requests, prompt_tokens, completion_tokens, "
                       "resumed_prompt_tokens), then a row each; every row unless limit or offset is given")),
                   (422, "application/json"): UNKNOWN_FILTER[422]},
        parameters=[
            OpenApiParameter("key", {"type": "string", "minLength": 1}, description="only this key's usage (a key name)"),
            OpenApiParameter("model", {"type": "string", "minLength": 1}, description="only this model's usage"),
            OpenApiParameter("since", OpenApiTypes.DATETIME, description="only the hours from this ISO 8601 time on"),
            OpenApiParameter("by", {"type": "string", "enum": list(USAGE_BY)},
                             description="a row per hour (the default) or per day (`hour`: the day's start, UTC)"),
            OpenApiParameter("format", {"type": "string", "enum": list(USAGE_FORMATS)},
                             description="csv: the rows as CSV (as `Accept: text/csv`)"),
        ]
    )
)
class UsageViewSet(viewsets.GenericViewSet[Any]):  # no model: its rows are usage_report's
    """Requests and tokens per key, model and hour (or day), newest first, as JSON or CSV. The gateway's counts
    reach it within a minute."""

    serializer_class = UsageSerializer
    renderer_classes = [renderers.JSONRenderer, renderers.BrowsableAPIRenderer, UsageCSVRenderer]

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        wanted = request.query_params.get("format")
        if not force and wanted is not None and wanted not in USAGE_FORMATS:
            raise serializers.ValidationError({"format": [f"json or csv, not {wanted[:40]!r}"]})
        return super().perform_content_negotiation(request, force=force)

    def list(self, request: Request) -> Response:
        params = request.query_params
        since = datetime_param("since", params["since"]) if "since" in params else None
        key, model = (text_param(request, name, required_text=True) for name in ("key", "model"))
        by = params.get("by", "hour")
        if by not in USAGE_BY:
            raise serializers.ValidationError({"by": [f"hour or day, not {by[:40]!r}"]})
        with refused():  # a key that does not exist: 422
            rows = operations.usage_report(key=key, model=model, since=since, by=by)
        page = self.paginate_queryset(rows)  # type: ignore[arg-type]  # DRF's paginators take a list too
        if request.accepted_renderer.format == "csv" and not {"limit", "offset"} & set(params):
            return Response(self.get_serializer(rows, many=True).data)  # a download: every row
        return self.get_paginated_response(self.get_serializer(page, many=True).data)


class StepSerializer(serializers.Serializer[timeline.Step]):
    at_ms = serializers.FloatField(help_text="from the request's arrival")
    what = serializers.CharField()


class PhaseSerializer(serializers.Serializer[timeline.Phase]):
    name = serializers.CharField()
    start_ms = serializers.FloatField()
    end_ms = serializers.FloatField()
    kind = serializers.ChoiceField(["queue", "failed", "prompt", "generation", "engine"])


class RouteSerializer(serializers.Serializer[dict[str, Any]]):
    policy = serializers.CharField(help_text="prefix or least in flight")
    hit = serializers.CharField(help_text="prefix or session: the replica its key maps to took it; empty: another")
    chosen = serializers.CharField(help_text="the replica, with its requests in flight as it was chosen")
    passed = serializers.ListField(child=serializers.ListField(child=serializers.CharField(), min_length=2,
                                                               max_length=2),
                                   help_text="[replica, why passed over] for each passed over before it")


class RequestRecordSerializer(serializers.ModelSerializer[RequestRecord]):
    key: serializers.SlugRelatedField[ApiKey] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True, help_text="the client key's name (null: none llmgw knew)")
    route = serializers.SerializerMethodField(help_text="why that replica (empty: none was chosen)")
    tries = serializers.JSONField(read_only=True, help_text=(
        "each replica it was sent to, in order: [replica, sent at ms, ended at ms (from its arrival), outcome]"))
    timeline = serializers.SerializerMethodField(help_text="what happened, in order (gateway/timeline.py)")
    phases = serializers.SerializerMethodField(help_text="where its time went: queue, failed attempts, prompt, "
                                                         "generation")

    class Meta:
        model = RequestRecord
        fields = ["request_id", "trace_id", "span_id", "parent_id", "at", "key", "model", "asked", "surface",
                  "streamed", "status", "error", "priority", "waited_ms", "position", "replica", "attempts", "route",
                  "tries", "ttft_ms", "total_ms", "prompt_tokens", "completion_tokens", "cached_tokens", "prompt_ms",
                  "generation_ms", "resumes", "resumed_prompt_tokens", "client", "timeline", "phases", "request_body",
                  "response_body"]
        read_only_fields = fields
        extra_kwargs = {
            "request_body": {"help_text": "what the client sent, when its key logs bodies (cut at "
                                          "LLMGW_REQUEST_LOG_BODY_BYTES); admins only: absent for anyone else"},
            "response_body": {"help_text": "what it was answered (a stream's events), as far as kept; admins only"},
            "resumes": {"help_text": "times its answer was resumed on another replica after its engine broke off "
                                     "mid-answer (each such try's outcome ends \"; resumed\")"},
            "resumed_prompt_tokens": {"help_text": "the prompt tokens of those resumes' continuation requests: the "
                                                   "fleet's cost, not charged to its key"},
        }

    def to_representation(self, instance: RequestRecord) -> dict[str, Any]:
        shown: dict[str, Any] = super().to_representation(instance)
        if not self.context.get("shows_bodies"):  # the bodies are an admin's to see
            shown.pop("request_body", None)
            shown.pop("response_body", None)
        return shown

    @extend_schema_field(RouteSerializer(allow_null=True))
    def get_route(self, record: RequestRecord) -> dict[str, Any] | None:
        return record.route or None

    @extend_schema_field(StepSerializer(many=True))
    def get_timeline(self, record: RequestRecord) -> list[dict[str, Any]]:
        return [step._asdict() for step in timeline.timeline(record)]

    @extend_schema_field(PhaseSerializer(many=True))
    def get_phases(self, record: RequestRecord) -> list[dict[str, Any]]:
        return [phase._asdict() for phase in timeline.phases(record)]


EVENT_ID_MAX = 2**63 - 1  # a database's largest id


@extend_schema_view(
    list=extend_schema(
        responses={200: RequestRecordSerializer(many=True), **UNKNOWN_FILTER},
        parameters=[
            OpenApiParameter("key", {"type": "string", "minLength": 1}, description="only this key's (a key name)"),
            OpenApiParameter("model", {"type": "string", "minLength": 1}, description="only this model's"),
            OpenApiParameter("status", {"type": "string", "pattern": records.STATUS_FILTER.pattern},
                             description="only answers of this status (429) or class (5xx)"),
            OpenApiParameter("slower_than", {"type": "string", "pattern": records.SLOWER_THAN.pattern},
                             description="only requests that took longer than this (2s, 500ms; a number: seconds)"),
            OpenApiParameter("since", OpenApiTypes.DATETIME, description="only those from this ISO 8601 time on"),
            OpenApiParameter("replica", {"type": "string", "minLength": 1},
                             description="only those this replica answered (the last they were sent to)"),
            OpenApiParameter("event", {"type": "integer", "minimum": 1, "maximum": EVENT_ID_MAX},
                             description="only those a replica's failure broke: the id of its replica.failed Event"),
            OpenApiParameter("resumed", {"type": "string", "enum": list(records.RESUMED_FILTER)},
                             description="true: only those whose answer was resumed on another replica; false: the "
                                         "others"),
        ]
    ),
)
class RequestRecordViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet[RequestRecord]):
    """Every request through /v1/, newest first (gateway/records.py): written within a second of its end, kept
    LLMGW_REQUEST_LOG_DAYS days. One by its id (`X-Request-Id`): the newest with that id."""

    serializer_class = RequestRecordSerializer
    lookup_field = "request_id"

    def get_serializer_context(self) -> dict[str, Any]:
        # whether the asker is an admin, who sees the bodies: once per request, not per record
        return {**super().get_serializer_context(), "shows_bodies": role_of(self.request.user) == "admin"}
    lookup_value_regex = ".+"  # a client's id may hold a slash

    def get_queryset(self) -> QuerySet[RequestRecord]:
        if self.action != "list":
            return records.listed()
        params = self.request.query_params
        key, model, replica = (text_param(self.request, name, required_text=True)
                               for name in ("key", "model", "replica"))
        since = datetime_param("since", params["since"]) if "since" in params else None
        try:
            found = records.listed(key=key or "", model=model or "", status=params.get("status"),
                                   slower_than=params.get("slower_than"), since=since, replica=replica or "",
                                   resumed=params.get("resumed"))
        except records.FilterError as exc:
            raise serializers.ValidationError({exc.name: [exc.message]}) from None
        if "event" in params:
            found = found.filter(request_id__in=self._broken_by(params["event"]))
        return found

    @staticmethod
    def _broken_by(said: str) -> list[str]:
        """The requests the replica failure Event `said` (its id) broke."""
        if not (said.isascii() and said.isdigit() and 0 < int(said[:20]) <= EVENT_ID_MAX):
            raise serializers.ValidationError({"event": [f"an Event's id, a whole number, not {said[:40]!r}"]})
        event = Event.objects.filter(pk=int(said), kind="replica.failed").first()
        if event is None:
            raise Refused(f"no replica.failed Event has id {said}")
        return records.broken_by(event.subject, event.created_at)

    def get_object(self) -> RequestRecord:
        record = self.get_queryset().filter(request_id=self.kwargs["request_id"]).first()
        if record is None:
            raise exceptions.NotFound(f"no request with id {self.kwargs['request_id'][:128]!r} is on record")
        return record


ROUTES = [("keys", ApiKeyViewSet, "key"), ("usage", UsageViewSet, "usage"),
          ("requests", RequestRecordViewSet, "request")]
