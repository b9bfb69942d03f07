"""The REST API of rollouts (issue 39): a model change tried on canary replicas, then promoted or rolled back.

`models/{name}/rollout/` starts one (POST) or shows the model's latest (GET); `.../rollout/promote/` and
`.../rollout/abort/` end it by hand; `rollouts/` lists every rollout, newest first. What is shown is
cluster.queries.rollout_shown, the one representation every front door shows; the operations are
cluster.operations.rollouts'.
"""

from __future__ import annotations

import math

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from cluster import operations, queries
from cluster.api.base import NamedViewSet, StrictSerializer, text_param
from cluster.api.errors import Refused, refused
from cluster.api.schema import UNKNOWN_FILTER
from cluster.models import Model, Rollout
from cluster.operations.rollouts import CANARY, MIN_REQUESTS, WATCH
from cluster.operations.validation import MEMORY

ROLLOUT_STATES = Rollout.State.values


def _number(low: float, high: float):
    return extend_schema_field({"type": "number", "format": "double", "minimum": low, "maximum": high})


class _Number(serializers.FloatField):
    """A JSON number from `low` to `high`: never a string, a boolean, NaN or an infinity, each a 400 naming the
    field."""

    low, high = 0.0, 1.0

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            raise serializers.ValidationError("must be a number")
        if not self.low <= data <= self.high:
            raise serializers.ValidationError(f"must be from {self.low:g} to {self.high:g}, not {data!r}")
        return float(data)


@_number(0, 1)
class RateField(_Number):
    pass


@_number(1, 1000)
class RatioField(_Number):
    low, high = 1.0, 1000.0


class RolloutStartSerializer(StrictSerializer):
    file = serializers.CharField(required=False, help_text="the canary's model file: a sha256 (or 8+ hex digits of "
                                 "one), a file name in the mirror, or a path")
    profile = serializers.CharField(required=False, help_text="the canary's profile")
    engine = serializers.CharField(required=False, help_text="the canary's engine")
    memory_bytes = serializers.IntegerField(required=False, **MEMORY.limits, help_text="each canary's memory, the "
                                            "model's once promoted; 0: estimated from the new file and profile "
                                            "(default: the model's, as it is)")
    canary = serializers.IntegerField(required=False, **CANARY.limits, help_text="canary replicas (default 1)")
    traffic = RateField(required=False, help_text="the share of new conversations the canary takes, 0 to 1 (default "
                        "0.1: 10%; 0: it answers no one, judged on its shadow alone)")
    shadow = RateField(required=False, help_text="the share of the current replicas' requests also copied to the "
                       "canary, its answer read and discarded, 0 to 1 (default 0)")
    watch_seconds = serializers.IntegerField(required=False, **WATCH.limits, help_text="how long it is watched from "
                                             "its first ready canary before it may be promoted (default 600)")
    min_requests = serializers.IntegerField(required=False, **MIN_REQUESTS.limits, help_text="the canary's requests "
                                            "(each side's, for the latency ratios) before it is judged (default 50)")
    max_error_rate = RateField(required=False, help_text="the canary's errors per request past which it is rolled "
                               "back, 0 to 1 (default 0.01: 1%)")
    max_ttft_ratio = RatioField(required=False, help_text="the canary's median time to first token over the current "
                                "replicas' past which it is rolled back (default 1.5)")
    max_tpot_ratio = RatioField(required=False, help_text="likewise for the median time per output token "
                                "(default 1.3)")


class RolloutReplicaSerializer(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    node = serializers.CharField(allow_null=True)


class RolloutSidesSerializer(serializers.Serializer):
    canary = RolloutReplicaSerializer(many=True, help_text="the canary replicas, with the new settings")
    current = RolloutReplicaSerializer(many=True, help_text="the model's other replicas")


class RolloutSideSerializer(serializers.Serializer):
    requests = serializers.IntegerField(help_text="requests sent to the side over the window (each try counts)")
    # a field (the serializer's metaclass takes it out of the class), not Serializer.errors
    errors = serializers.IntegerField(help_text="5xx answers, broken streams, engines that failed")  # type: ignore[assignment]
    error_rate = serializers.FloatField(help_text="errors per request")
    timed = serializers.IntegerField(help_text="answered streams: the latency figures' samples")
    ttft_p50 = serializers.FloatField(allow_null=True, help_text="median time to first token, ms")
    ttft_p99 = serializers.FloatField(allow_null=True)
    tpot_p50 = serializers.FloatField(allow_null=True, help_text="median time per output token, ms")
    tpot_p99 = serializers.FloatField(allow_null=True)


class RolloutFiguresSerializer(serializers.Serializer):
    canary = RolloutSideSerializer(allow_null=True)
    current = RolloutSideSerializer(allow_null=True)


class RolloutRatiosSerializer(serializers.Serializer):
    ttft = serializers.FloatField(allow_null=True, help_text="the canary's median time to first token over the "
                                  "current replicas' (null until both have one)")
    tpot = serializers.FloatField(allow_null=True, help_text="likewise per output token")


class RolloutBreachedSerializer(serializers.Serializer):
    error_rate = serializers.BooleanField(help_text="the canary's errors are past what max_error_rate allows")
    ttft = serializers.BooleanField(help_text="the TTFT ratio is past max_ttft_ratio (judged once both sides have "
                                    "min_requests answered streams)")
    tpot = serializers.BooleanField(help_text="likewise for max_tpot_ratio")


class RolloutSerializer(serializers.Serializer):
    """cluster.queries.rollout_shown, as the schema says it."""

    model = serializers.CharField()
    state = serializers.ChoiceField(choices=ROLLOUT_STATES)
    state_text = serializers.CharField(help_text="the state in words: watching, promoting, promoted, rolling back, "
                                       "rolled back, aborted")
    change = serializers.DictField(child=serializers.ListField(child=serializers.CharField()),
                                   help_text='what changes, from and to: {"profile": ["default", "fast"]}')
    change_text = serializers.CharField(help_text="the change in words: profile default -> fast")
    canary = serializers.IntegerField()
    traffic = serializers.FloatField()
    shadow = serializers.FloatField()
    watch_seconds = serializers.IntegerField()
    min_requests = serializers.IntegerField()
    max_error_rate = serializers.FloatField()
    max_ttft_ratio = serializers.FloatField()
    max_tpot_ratio = serializers.FloatField()
    actor = serializers.CharField(help_text="who started it")
    started_at = serializers.DateTimeField()
    watching_since = serializers.DateTimeField(allow_null=True, help_text="its first canary ready: the window began")
    window_left_seconds = serializers.IntegerField(allow_null=True, help_text="while watching")
    ended_at = serializers.DateTimeField(allow_null=True)
    reason = serializers.CharField(allow_blank=True, help_text="why it is in its state")
    note = serializers.CharField(allow_blank=True, help_text="why its canary is not placed, if it is not")
    verdict = serializers.CharField(allow_blank=True, help_text="the verdict as last judged")
    replicas = RolloutSidesSerializer()
    figures = RolloutFiguresSerializer(help_text="both sides' figures as last judged (null before)")
    ratios = RolloutRatiosSerializer(help_text="the latency ratios the judge reads, as last judged")
    breached = RolloutBreachedSerializer(help_text="the bounds the canary is past now, as the judge reads them")

    def to_representation(self, instance):
        shown = instance if isinstance(instance, dict) else queries.rollout_shown(instance)
        return super().to_representation(shown)


def shown(rollout: Rollout, status_code: int = status.HTTP_200_OK) -> Response:
    return Response(RolloutSerializer(queries.rollout_shown(rollout)).data, status=status_code)


class ModelRolloutActions(NamedViewSet):
    """The rollout actions of a model (ServedModelViewSet's): `models/{name}/rollout/…`."""

    @extend_schema(methods=["GET"], request=None, responses={200: RolloutSerializer},
                   description="The model's rollout: the one under way, else its last (404: it has had none).")
    @extend_schema(methods=["POST"], request=RolloutStartSerializer, responses={201: RolloutSerializer},
                   description="Start a rollout: canary replicas with the new file, profile or engine beside the "
                   "model's own, taking a share of new conversations, judged on their errors and latency against "
                   "the current replicas, then promoted or rolled back by llmgw. 409 while one is under way.")
    @action(detail=True, methods=["get", "post"])
    def rollout(self, request, name=None):
        model = self.get_object()
        if request.method == "GET":
            with refused(named=True):
                return shown(operations.rollout_of(model.name))
        data = self.parsed(RolloutStartSerializer)
        with refused(reads_files=True):
            rollout = operations.start_rollout(model.name, self.actor, **data)
        return shown(rollout, status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"], url_path="rollout/promote", url_name="rollout-promote")
    def rollout_promote(self, request, name=None):
        """Promote the rollout under way now: the model takes the canary's settings, its other replicas are
        replaced one at a time. 409 unless it is watching."""
        model = self.get_object()
        with refused():
            return shown(operations.promote_rollout(model.name, self.actor, f"promoted by {self.actor}"))

    @extend_schema(request=None, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"], url_path="rollout/abort", url_name="rollout-abort")
    def rollout_abort(self, request, name=None):
        """Abort the rollout under way. Watching: its canary drains and stops, the model never changed. Promoting:
        the model goes back to its settings before, its replicas on the new ones replaced one at a time (the
        rollout rolling back). 409 while it rolls back."""
        model = self.get_object()
        with refused():
            return shown(operations.abort_rollout(model.name, self.actor))


@extend_schema_view(
    list=extend_schema(
        responses={200: RolloutSerializer(many=True), **UNKNOWN_FILTER},
        parameters=[
            OpenApiParameter("model", {"type": "string", "minLength": 1}, description="only this model's rollouts"),
            OpenApiParameter("state", str, enum=ROLLOUT_STATES, description="only rollouts in this state"),
        ],
    )
)
class RolloutViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Every rollout, newest first."""

    serializer_class = RolloutSerializer

    def get_queryset(self):
        queryset = Rollout.objects.select_related("model").order_by("-started_at", "-id")
        model = text_param(self.request, "model", required_text=True)
        if model is not None:
            if not Model.objects.filter(name=model).exists():
                raise Refused(f"no model named {model!r}")
            queryset = queryset.filter(model__name=model)
        state = self.request.query_params.get("state")
        if state is not None:
            if state not in ROLLOUT_STATES:
                known = ", ".join(ROLLOUT_STATES)
                raise serializers.ValidationError({"state": [f"unknown state {state!r} (known: {known})"]})
            queryset = queryset.filter(state=state)
        return queryset

