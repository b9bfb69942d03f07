"""Client keys for /v1/ and the token usage they run up, per hour."""

import hashlib
import secrets

from django.db import models
from django.utils import timezone

KEY_PREFIX = "sk-llmgw-"


class ApiKey(models.Model):
    """A client key. Stored hashed; shown once at creation; its first characters stay visible as `prefix`."""

    name = models.CharField(max_length=63, unique=True)
    prefix = models.CharField(max_length=24)
    key_hash = models.CharField(max_length=64, unique=True)
    allowed_models = models.JSONField(default=list, blank=True)  # model names it may use; empty: all
    rpm = models.PositiveIntegerField(null=True, blank=True)  # requests per minute
    tpm = models.PositiveIntegerField(null=True, blank=True)  # tokens per minute
    max_tokens = models.PositiveIntegerField(null=True, blank=True)  # per completion, below the model's own cap
    # its requests' class when they wait for a slot (gateway/admission.py): interactive, standard or batch
    priority = models.CharField(max_length=16, default="standard")
    # tokens (prompt and completion) it may use per budget period (gateway/budgets.py); None: no budget
    budget_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    budget_period = models.CharField(max_length=8, blank=True, default="")  # day, week or month (UTC)
    max_concurrency = models.PositiveIntegerField(null=True, blank=True)  # its requests in flight at once
    # its requests' bodies kept in their records (gateway/records.py; LLMGW_REQUEST_LOG_BODY_BYTES each, admins see)
    log_bodies = models.BooleanField(default=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)  # flushed from Redis, not written per request
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @staticmethod
    def new_secret() -> str:
        return KEY_PREFIX + secrets.token_urlsafe(32)

    @staticmethod
    def hash(secret: str) -> str:
        return hashlib.sha256(secret.encode()).hexdigest()

    @property
    def active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())


USAGE_BY = ("hour", "day")  # what usage is summed by, as the API, the CLI and the dashboard show it


class Usage(models.Model):
    """Tokens and requests per key, model and hour."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=63)
    hour = models.DateTimeField()
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    # prompt tokens its answers' resumes on another replica cost the fleet (not the key's: not in its budget)
    resumed_prompt_tokens = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-hour", "key", "model"]
        constraints = [models.UniqueConstraint(fields=["key", "model", "hour"], name="usage_key_model_hour")]


class RequestRecord(models.Model):
    """One request through /v1/, as the gateway saw it: written off the request's path, in batches
    (gateway/records.py), kept LLMGW_REQUEST_LOG_DAYS and at most LLMGW_REQUEST_LOG_ROWS rows."""

    request_id = models.CharField(max_length=128, db_index=True)  # the client's X-Request-Id or the gateway's
    trace_id = models.CharField(max_length=32, blank=True, default="")  # its W3C trace
    at = models.DateTimeField(db_index=True)  # when it arrived
    # indexed by request_key_at (key first): an index of its own would cost every write and serve no read
    key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="requests",
                            db_index=False)
    model = models.CharField(max_length=128, blank=True, default="")  # the model's own name, or as asked if unknown
    asked = models.CharField(max_length=128, blank=True, default="")  # the name the client asked for (an alias)
    surface = models.CharField(max_length=32)  # chat/completions, completions, embeddings, messages, …
    streamed = models.BooleanField(default=False)
    status = models.PositiveSmallIntegerField()
    error = models.CharField(max_length=64, blank=True, default="")  # its error's code, when refused
    priority = models.CharField(max_length=16, blank=True, default="")  # its class in the queue
    waited_ms = models.FloatField(null=True, blank=True)  # for a ready replica and a slot
    replica = models.CharField(max_length=128, blank=True, default="")  # the last it was sent to
    attempts = models.PositiveSmallIntegerField(default=0)  # replicas it was sent to
    ttft_ms = models.FloatField(null=True, blank=True)  # to the first chunk of a stream
    total_ms = models.FloatField()
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    client = models.CharField(max_length=64, blank=True, default="")  # the client's address
    # its trace's spans: the gateway's (the engine's parent) and the client's (its parent), as W3C says them
    span_id = models.CharField(max_length=16, blank=True, default="")
    parent_id = models.CharField(max_length=16, blank=True, default="")
    position = models.PositiveIntegerField(null=True, blank=True)  # where it entered its model's queue (1: first)
    # why that replica (gateway/explain.py): {"policy", "hit", "chosen", "passed": [[replica, why], …]}
    route = models.JSONField(default=dict, blank=True)
    # each replica it was sent to: [[replica, started ms, ended ms, outcome], …], in order (ms from its arrival)
    tries = models.JSONField(default=list, blank=True)
    cached_tokens = models.PositiveIntegerField(default=0)  # of its prompt, served from the engine's cache
    prompt_ms = models.FloatField(null=True, blank=True)  # the engine's time on the prompt (prefill), as it said
    generation_ms = models.FloatField(null=True, blank=True)  # the engine's time generating, as it said
    # what the client sent and was answered, when its key logs bodies (ApiKey.log_bodies): at most
    # LLMGW_REQUEST_LOG_BODY_BYTES of each, as UTF-8; only an admin sees them
    request_body = models.TextField(blank=True, default="")
    response_body = models.TextField(blank=True, default="")
    resumes = models.PositiveSmallIntegerField(default=0)  # times its answer was resumed on another replica
    # the prompt tokens of those resumes' continuation requests: the fleet's cost, not charged to its key
    resumed_prompt_tokens = models.PositiveIntegerField(default=0)
    # a copy of a request sent to a rollout's canary, its answer read and discarded (gateway/shadow.py): the
    # fleet's, no client's; `request_id` is its request's with `.shadow`
    shadow = models.BooleanField(default=False)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["key", "-at"], name="request_key_at"),
                   models.Index(fields=["model", "-at"], name="request_model_at"),
                   # a replica's requests: the ones a failure broke (records.broken_by), `--replica`
                   models.Index(fields=["replica", "-at"], name="request_replica_at")]
