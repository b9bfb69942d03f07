"""The API's serializers of models (what to serve): the output one shows a model with its scaling and its admission
queue, the input ones (strict: unknown fields refused) parse an add or an edit."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from cluster import queries
from cluster.api.base import AliasField, NameField, StrictSerializer
from cluster.models import Model, ModelFile, Replica
from cluster.operations import DEFAULT_MAX_CHOICES, DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_TOKENS, MAX_ALIASES
from cluster.operations.validation import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_TOKENS,
    MAX_WAIT,
    MEMORY,
    MOST_REPLICAS,
    QUEUE_LIMIT,
    REPLICAS,
    RESUME_LIMIT,
    SCALING_SECONDS,
    STREAM_IDLE_TIMEOUT,
    TARGET_INFLIGHT,
    WAIT_SECONDS,
)
from ground.engines import CAPABILITIES, SURFACES


class ModelFileRefSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelFile
        fields = ["sha256", "name"]
        read_only_fields = fields


STATES = Replica.State.values


class ScalingShownSerializer(serializers.Serializer):
    mode = serializers.ChoiceField(choices=["fixed", "autoscaled", "on-demand"])
    ready = serializers.IntegerField(help_text="its ready replicas")
    wanted = serializers.IntegerField(help_text="the replicas it wants now (the autoscaler's number when autoscaled)")
    replicas_text = serializers.CharField(help_text="READY/WANT, with the range when autoscaled: 2/2 (1-3)")
    min_replicas = serializers.IntegerField(allow_null=True)
    max_replicas = serializers.IntegerField(allow_null=True)
    target_inflight = serializers.IntegerField(allow_null=True)
    idle_after_seconds = serializers.IntegerField(allow_null=True)
    scale_down_delay_seconds = serializers.IntegerField(allow_null=True)
    last_request_at = serializers.DateTimeField(allow_null=True, help_text="the last request the gateway saw for it "
                                                "(fixed or autoscaled); null: none yet")
    idle_at = serializers.DateTimeField(allow_null=True, help_text="on demand and loaded: when it goes to zero if "
                                        "no request comes")


QUEUE_LIMIT_HELP = ("requests that may wait for a slot of its replicas, refused with a 429 queue_full past it;"
                    " null: the cluster's default (settings)")
MAX_WAIT_HELP = ("seconds a request may wait for a slot, answered with a 503 queue_timeout past it; null: the"
                 " cluster's default (settings)")
RESUME_LIMIT_HELP = ("times one answer may be resumed on another replica when its engine fails mid-answer; 0: never"
                     " (default 2)")
STREAM_IDLE_TIMEOUT_HELP = ("seconds a streaming engine may send nothing before its answer counts as failed and is"
                            " resumed on another replica (default 30)")


class QueueShownSerializer(serializers.Serializer):
    waiting = serializers.IntegerField(allow_null=True, help_text="requests waiting for a slot now; null: unknown "
                                       "(Redis could not be read)")
    longest_wait_seconds = serializers.FloatField(allow_null=True, help_text="how long the oldest has waited; null: "
                                                  "none waits")
    queue_limit = serializers.IntegerField(help_text="requests that may wait (the model's, else the cluster's "
                                           "default); past it a request is refused with 429 queue_full")
    max_wait_seconds = serializers.IntegerField(help_text="how long one may wait (the model's, else the cluster's "
                                                "default); past it a request is refused with 503 queue_timeout")


class ServedModelListSerializer(serializers.ListSerializer):
    """A page of models: their queues are read from Redis in one round trip for the page, not once per model."""

    def to_representation(self, data):
        models = list(data.all() if hasattr(data, "all") else data)
        assert self.child is not None  # a list serializer is made with its child
        self.child.context["queues"] = queries.queues([m.name for m in models])
        return super().to_representation(models)


ALIASES_HELP = (
    "other names a request on /v1/ may give for the model (a client's vendor names: claude-sonnet-4-5,"
    " gpt-5-codex), each listed by /v1/models; none is a model's name or another model's alias"
)


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
    aliases = serializers.ListField(child=serializers.CharField(), read_only=True, help_text=ALIASES_HELP)
    capabilities = serializers.SerializerMethodField(
        help_text="what its engine serves with its profile: /v1/ APIs (chat, completions, embeddings, messages,"
        " responses, rerank) and inputs beyond text (images, audio); the gateway refuses the rest with a 400"
    )
    serves = serializers.SerializerMethodField(
        help_text="the /v1/ APIs it serves, of chat, completions, embeddings, messages (Anthropic's), responses"
        " (OpenAI's Responses) and rerank: its capabilities without the inputs"
    )
    scaling_text = serializers.CharField(read_only=True, help_text="how it scales, in an operator's words")
    scaling = serializers.SerializerMethodField(
        help_text="how it scales: mode (fixed, autoscaled, on-demand), the replicas it wants now, its range and the "
        "autoscaler's knobs (null for a fixed model), its last request, and when an on-demand model goes idle"
    )
    queue_limit = serializers.IntegerField(read_only=True, allow_null=True, help_text=QUEUE_LIMIT_HELP)
    max_wait_seconds = serializers.IntegerField(read_only=True, allow_null=True, help_text=MAX_WAIT_HELP)
    resume_limit = serializers.IntegerField(read_only=True, help_text=RESUME_LIMIT_HELP)
    stream_idle_timeout_seconds = serializers.IntegerField(read_only=True, help_text=STREAM_IDLE_TIMEOUT_HELP)
    queue = serializers.SerializerMethodField(
        help_text="its admission queue: requests waiting for a slot, the oldest's wait, and the bounds in effect"
    )

    class Meta:
        model = Model
        list_serializer_class = ServedModelListSerializer
        fields = [
            "name",
            "file",
            "engine",
            "profile",
            "capabilities",
            "serves",
            "replicas",
            "memory_bytes",
            "memory_estimated",
            "nodes",
            "aliases",
            "wait_seconds",
            "max_tokens",
            "max_logprobs",
            "max_choices",
            "routing",
            "queue_limit",
            "max_wait_seconds",
            "queue",
            "resume_limit",
            "stream_idle_timeout_seconds",
            "min_replicas",
            "max_replicas",
            "target_inflight",
            "idle_after_seconds",
            "scale_down_delay_seconds",
            "scaling",
            "scaling_text",
            "removing",
            "placement_note",
            "counting",
            "replica_states",
            "created_at",
        ]
        read_only_fields = fields

    @extend_schema_field(ScalingShownSerializer)
    def get_scaling(self, model: Model) -> dict:
        asked = self.context.get("last_requests")
        if asked is None:  # read once for a page of models
            asked = self.context["last_requests"] = queries.last_requests()
        return ScalingShownSerializer(queries.scaling_shown(model, asked)).data

    @extend_schema_field(QueueShownSerializer)
    def get_queue(self, model: Model) -> dict:
        if "queues" not in self.context:  # one model shown (a page's are read by ServedModelListSerializer)
            self.context["queues"] = queries.queues([model.name])
        if "cluster" not in self.context:
            self.context["cluster"] = queries.read_settings()
        shown = queries.queue_shown(model, self.context["queues"], self.context["cluster"])
        return QueueShownSerializer(shown).data

    @extend_schema_field(OpenApiTypes.INT64)
    def get_memory_bytes(self, model: Model) -> int:
        return model.memory_estimate()

    @extend_schema_field(serializers.ListField(child=serializers.ChoiceField(choices=CAPABILITIES)))
    def get_capabilities(self, model: Model) -> list[str]:
        return list(model.capabilities())

    @extend_schema_field(serializers.ListField(child=serializers.ChoiceField(choices=SURFACES)))
    def get_serves(self, model: Model) -> list[str]:
        return [c for c in model.capabilities() if c in SURFACES]

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_memory_estimated(self, model: Model) -> bool:
        return not model.memory_bytes

    @extend_schema_field(serializers.DictField(child=serializers.IntegerField()))
    def get_replica_states(self, model: Model) -> dict:
        return {s: getattr(model, f"n_{s}") for s in STATES}


MAX_LOGPROBS_HELP = (
    "most top log-probabilities per token a request may ask for (llama.cpp's n_probs, chat's top_logprobs,"
    " completions' logprobs), refused with a 400 past it; 0: none at all; null: no cap"
)
MAX_CHOICES_HELP = "most choices a request may ask for (n, best_of), refused with a 400 past it; null: no cap"


ROUTING_HELP = (
    "how the gateway picks among the ready replicas: prefix (requests sharing an opening, such as the turns of"
    " a conversation, to the replica holding it in its cache, within a load bound) or least-inflight"
)


class ScalingFields(StrictSerializer):
    """A model's replicas: fixed (`replicas`) or autoscaled (`min_replicas` to `max_replicas`, and the knobs)."""

    min_replicas = serializers.IntegerField(
        required=False, **REPLICAS.limits, allow_null=True,
        help_text="autoscale from this many (0: on demand, loaded when a request asks for it); with max_replicas, "
        "never with replicas")
    max_replicas = serializers.IntegerField(required=False, **MOST_REPLICAS.limits, allow_null=True,
                                            help_text="autoscale up to this many")
    target_inflight = serializers.IntegerField(required=False, **TARGET_INFLIGHT.limits, allow_null=True,
                                               help_text="requests in flight per replica the autoscaler aims at")
    idle_after_seconds = serializers.IntegerField(
        required=False, **SCALING_SECONDS.limits, allow_null=True,
        help_text="min_replicas 0: with no request this long the model goes to zero replicas")
    scale_down_delay_seconds = serializers.IntegerField(
        required=False, **SCALING_SECONDS.limits, allow_null=True,
        help_text="below the target this long, one replica fewer")


class ServedModelUpdateSerializer(ScalingFields):
    file = serializers.CharField(
        required=False, help_text="a sha256 (or 8+ hex digits of one), a file name in the mirror, or a path"
    )
    engine = serializers.CharField(required=False, help_text="engine name, e.g. llama.cpp")
    profile = serializers.CharField(required=False)
    replicas = serializers.IntegerField(required=False, **REPLICAS.limits)
    memory_bytes = serializers.IntegerField(
        required=False, **MEMORY.limits, allow_null=True, help_text="per replica; null or 0: estimate"
    )
    nodes = serializers.ListField(required=False, child=NameField(), help_text="node names allowed; empty: any")
    aliases = serializers.ListField(required=False, child=AliasField(), max_length=MAX_ALIASES,
                                    help_text=ALIASES_HELP + "; empty: none")
    wait_seconds = serializers.IntegerField(required=False, **WAIT_SECONDS.limits)
    max_tokens = serializers.IntegerField(
        required=False, **MAX_TOKENS.limits, allow_null=True,
        help_text="most tokens a completion may generate; null: no cap of llmgw's",
    )
    max_logprobs = serializers.IntegerField(required=False, **MAX_LOGPROBS.limits, allow_null=True,
                                            help_text=MAX_LOGPROBS_HELP)
    max_choices = serializers.IntegerField(required=False, **MAX_CHOICES.limits, allow_null=True,
                                           help_text=MAX_CHOICES_HELP)
    routing = serializers.ChoiceField(choices=Model.Routing.choices, required=False, help_text=ROUTING_HELP)
    queue_limit = serializers.IntegerField(required=False, **QUEUE_LIMIT.limits, allow_null=True,
                                           help_text=QUEUE_LIMIT_HELP)
    max_wait_seconds = serializers.IntegerField(required=False, **MAX_WAIT.limits,
                                                allow_null=True, help_text=MAX_WAIT_HELP)
    resume_limit = serializers.IntegerField(required=False, **RESUME_LIMIT.limits, help_text=RESUME_LIMIT_HELP)
    stream_idle_timeout_seconds = serializers.IntegerField(required=False, **STREAM_IDLE_TIMEOUT.limits,
                                                           help_text=STREAM_IDLE_TIMEOUT_HELP)


class ServedModelCreateSerializer(ScalingFields):
    name = NameField()
    file = serializers.CharField(help_text="a sha256 (or 8+ hex digits of one), a file name in the mirror, or a path")
    engine = serializers.CharField(help_text="engine name, e.g. llama.cpp")
    profile = serializers.CharField(default="default")
    replicas = serializers.IntegerField(**REPLICAS.limits, allow_null=True, default=None,
                                        help_text="a fixed number of replicas (1 when neither this nor a range is given)")
    memory_bytes = serializers.IntegerField(
        **MEMORY.limits, allow_null=True, default=None, help_text="per replica; null or 0: estimate"
    )
    nodes = serializers.ListField(child=NameField(), default=list, help_text="node names; empty: any")
    aliases = serializers.ListField(child=AliasField(), default=list, max_length=MAX_ALIASES, help_text=ALIASES_HELP)
    wait_seconds = serializers.IntegerField(**WAIT_SECONDS.limits, allow_null=True, default=None)
    max_tokens = serializers.IntegerField(
        **MAX_TOKENS.limits, allow_null=True, default=DEFAULT_MAX_TOKENS,
        help_text="most tokens a completion may generate, set when a client asks for none and lowered when it asks"
        " for more; null: no cap of llmgw's",
    )
    max_logprobs = serializers.IntegerField(**MAX_LOGPROBS.limits, allow_null=True,
                                            default=DEFAULT_MAX_LOGPROBS, help_text=MAX_LOGPROBS_HELP)
    max_choices = serializers.IntegerField(**MAX_CHOICES.limits, allow_null=True,
                                           default=DEFAULT_MAX_CHOICES, help_text=MAX_CHOICES_HELP)
    routing = serializers.ChoiceField(choices=Model.Routing.choices, default=Model.Routing.PREFIX, help_text=ROUTING_HELP)
    queue_limit = serializers.IntegerField(**QUEUE_LIMIT.limits, allow_null=True, default=None,
                                           help_text=QUEUE_LIMIT_HELP)
    max_wait_seconds = serializers.IntegerField(**MAX_WAIT.limits, allow_null=True,
                                                default=None, help_text=MAX_WAIT_HELP)
    resume_limit = serializers.IntegerField(**RESUME_LIMIT.limits, allow_null=True, default=None,
                                            help_text=RESUME_LIMIT_HELP + "; null: the default")
    stream_idle_timeout_seconds = serializers.IntegerField(**STREAM_IDLE_TIMEOUT.limits, allow_null=True,
                                                           default=None,
                                                           help_text=STREAM_IDLE_TIMEOUT_HELP + "; null: the default")
