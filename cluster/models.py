"""The cluster's state: what should run (models, profiles, engines, files) and what does (nodes, replicas)."""

import hashlib
import logging
import re
import secrets

from django.core.validators import RegexValidator
from django.db import models, transaction
from django.utils import timezone

from cluster import memory
from ground.engines import CAPABILITIES, driver_for
from ground.units import format_duration

# The one rule for a name of llmgw's (node, model, profile, engine, key): the server checks NAME_RE (operations,
# the REST API, the model's validator) and every dashboard form renders NAME_PATTERN as its input's `pattern`, with
# NAME_HINT as its hint. `\-`, not a bare `-`: browsers compile `pattern` with the `v` flag, where a bare `-` in a
# class is a syntax error, and drop a pattern that does not compile (the field then takes anything).
NAME_PATTERN = r"[a-z0-9][a-z0-9._\-]{0,62}"
NAME_RE = rf"^{NAME_PATTERN}$"
NAME_HINT = "lower-case letters, digits, '.', '_' or '-', starting with a letter or digit (at most 63)"
name_validator = RegexValidator(re.compile(NAME_RE), f"use {NAME_HINT}")
# Another name a model answers to on /v1/ (`claude-sonnet-4-5`, `gpt-5-codex`, `anthropic/claude-x`): what clients
# send, so wider than a name of llmgw's: any case, and '/', ':' and '@' too; never a space or a comma (the CLI and
# the dashboard take a list of them comma-separated).
ALIAS_PATTERN = r"[A-Za-z0-9@][A-Za-z0-9._\-/:@]{0,127}"
ALIAS_HINT = "letters, digits, '.', '_', '-', '/', ':' or '@', starting with a letter, a digit or '@' (at most 128)"

# A user's name (Django's own rule for a user name), likewise for the server and the dashboard's form.
USER_NAME_PATTERN = r"[A-Za-z0-9_.@+\-]{1,150}"
USER_NAME_HINT = "letters, digits and . @ + - _ (at most 150)"

GIB = 1024**3
log = logging.getLogger("llmgw.events")


class Node(models.Model):
    """A machine with an agent. Liveness is `last_seen` within a tolerance, not a flag to remember to clear."""

    name = models.CharField(max_length=63, unique=True, validators=[name_validator])
    token_hash = models.CharField(max_length=64, unique=True)
    address = models.CharField(max_length=255, blank=True, default="")
    facts = models.JSONField(default=dict, blank=True)  # cpu_count, memory_bytes, gpus, engines, port_range, hostname
    memory_bytes = models.BigIntegerField(default=0)  # RAM the agent advertises for replicas
    schedulable = models.BooleanField(default=True)
    draining = models.BooleanField(default=False)  # takes no new replicas; its replicas are replaced elsewhere
    drain_force = models.BooleanField(default=False)  # a replica with nowhere else to go is stopped anyway
    drain_note = models.CharField(max_length=500, blank=True, default="")  # why the drain is blocked, if it is
    connected = models.BooleanField(default=False)
    # the agent stream that connected last (its channel name): only it moves `connected` and `last_seen`, so an
    # old stream's late word (its disconnect, a heartbeat) never undoes a newer stream's
    stream = models.CharField(max_length=255, blank=True, default="")
    last_seen = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @staticmethod
    def new_token() -> str:
        return "lnt_" + secrets.token_urlsafe(32)

    @staticmethod
    def hash_token(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    @property
    def gpus(self) -> list[dict]:
        return list(self.facts.get("gpus") or [])

    @property
    def cpus(self) -> int:
        """CPU cores its agent offers (0: not said; placement then does not count them)."""
        try:
            return max(0, int(self.facts.get("cpu_count") or 0))
        except (TypeError, ValueError):
            return 0

    @property
    def engines(self) -> dict:
        return dict(self.facts.get("engines") or {})

    def drain_state(self, replicas_left: int) -> str:
        """'' (not draining), 'draining', 'blocked' (a replica has nowhere else to go) or 'drained' (none left)."""
        if not self.draining:
            return ""
        if replicas_left == 0:
            return "drained"
        return "blocked" if self.drain_note else "draining"

    def is_alive(self, now=None, tolerance: int | None = None) -> bool:
        from django.conf import settings

        if not self.connected or self.last_seen is None:
            return False
        now = now or timezone.now()
        tolerance = settings.LLMGW_NODE_TOLERANCE if tolerance is None else tolerance
        return (now - self.last_seen).total_seconds() <= tolerance


class Profile(models.Model):
    """A named set of engine arguments. Editing one changes no running replica (they keep their snapshot)."""

    name = models.CharField(max_length=63, unique=True, validators=[name_validator])
    context_size = models.PositiveIntegerField(default=4096)
    threads = models.PositiveIntegerField(null=True, blank=True)
    gpu_layers = models.IntegerField(null=True, blank=True)
    batch_size = models.PositiveIntegerField(null=True, blank=True)
    parallel = models.PositiveIntegerField(default=1)
    extra_args = models.JSONField(default=list, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def args(self) -> dict:
        return {
            "context_size": self.context_size,
            "threads": self.threads,
            "gpu_layers": self.gpu_layers,
            "batch_size": self.batch_size,
            "parallel": self.parallel,
            "extra_args": list(self.extra_args or []),
        }


class EngineVersion(models.Model):
    """An engine kind and version, with how to find its binary on a node."""

    class Device(models.TextChoices):
        CPU = "cpu", "CPU (RAM)"
        GPU = "gpu", "GPU (one GPU's memory)"

    name = models.CharField(max_length=63, unique=True, validators=[name_validator])
    kind = models.CharField(max_length=32)  # a key of ground.engines.DRIVERS
    version = models.CharField(max_length=64, blank=True, default="")
    device = models.CharField(max_length=8, choices=Device.choices, default=Device.CPU)
    binary = models.CharField(max_length=500, blank=True, default="")  # empty: found on PATH on the node
    command = models.TextField(blank=True, default="")  # the `command` kind's template
    # What a `command` engine serves, of ground.engines.CAPABILITIES, as its operator declares; empty: whatever a
    # request asks (the engine refuses what it cannot). Other kinds' drivers read it from the profile.
    serves = models.JSONField(default=list, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def spec(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "version": self.version,
            "device": self.device,
            "binary": self.binary,
            "command": self.command,
        }


class ModelFile(models.Model):
    """A file in the mirror, stored as MIRROR_DIR/<sha256>."""

    sha256 = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=255)
    size = models.BigIntegerField()
    format = models.CharField(max_length=16, default="other")  # "gguf" or "other"
    gguf = models.JSONField(default=dict, blank=True)  # architecture, block_count, context_length, head_count_kv, ...
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "sha256"]

    def __str__(self):
        return f"{self.name} ({self.sha256[:12]})"

    @property
    def path(self):
        from django.conf import settings

        return settings.MIRROR_DIR / self.sha256


class ControlPlane(models.Model):
    """A control plane's mirror of model files (cluster/mirror/sync.py): where the others fetch what it holds. Known by
    the hash of the token it keeps in its LLMGW_HOME; written by its own processes as they start and by its
    worker every few seconds."""

    token_hash = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=100)
    url = models.CharField(max_length=255, blank=True)  # LLMGW_CONTROL_PLANE_URL: empty, the others cannot fetch
    seen_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    # a new token asked for through another control plane: its own worker makes it at its next heartbeat
    rotation_asked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name", "pk"]

    def __str__(self):
        return self.name


class RevokedControlPlaneToken(models.Model):
    """A control-plane token that no longer opens /mirror: the former token of a control plane given a new one,
    or the token of one removed. Kept so that a process still holding it can never record it again."""

    token_hash = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=100)  # whose it was
    revoked_at = models.DateTimeField(auto_now_add=True)


class FileCopy(models.Model):
    """A control plane holds a model file in its mirror directory, whole and checked against its sha256."""

    file = models.ForeignKey(ModelFile, on_delete=models.CASCADE, related_name="copies")
    control_plane = models.ForeignKey(ControlPlane, on_delete=models.CASCADE, related_name="copies")
    verified_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["file", "control_plane"], name="one_copy_per_control_plane")]


DEFAULT_MAX_LOGPROBS = 20  # top log-probabilities per token a request may ask for (OpenAI's own top_logprobs limit)
DEFAULT_MAX_CHOICES = 8  # choices per request


class Model(models.Model):
    """What to serve: a file on an engine with a profile, so many replicas."""

    class Routing(models.TextChoices):
        # requests sharing an opening go to the replica that holds it in its cache (gateway/affinity.py)
        PREFIX = "prefix"
        LEAST_INFLIGHT = "least-inflight"  # the replica with the fewest requests in flight

    name = models.CharField(max_length=63, unique=True, validators=[name_validator])
    file = models.ForeignKey(ModelFile, on_delete=models.PROTECT, related_name="models")
    engine = models.ForeignKey(EngineVersion, on_delete=models.PROTECT, related_name="models")
    profile = models.ForeignKey(Profile, on_delete=models.PROTECT, related_name="models")
    replicas = models.PositiveIntegerField(default=1)
    memory_bytes = models.BigIntegerField(null=True, blank=True)  # set by the operator; else estimated
    nodes = models.JSONField(default=list, blank=True)  # placement constraint: node names allowed (empty: any)
    wait_seconds = models.PositiveIntegerField(default=30)  # how long the gateway waits for a replica
    # the most tokens one completion may generate: set when a client asks for none, lowered when it asks for more
    max_tokens = models.PositiveIntegerField(null=True, blank=True, default=4096)  # null: the engine's own limit
    # what a request may ask for that multiplies an answer's size, refused past these (null: no cap):
    # top log-probabilities per token (llama.cpp's n_probs, chat's top_logprobs, completions' logprobs; 0: none)
    max_logprobs = models.PositiveIntegerField(null=True, blank=True, default=DEFAULT_MAX_LOGPROBS)
    max_choices = models.PositiveIntegerField(null=True, blank=True, default=DEFAULT_MAX_CHOICES)  # n, best_of
    # admission (gateway/admission.py): requests that may wait for a slot, and how long one may; None: the
    # cluster's defaults (ClusterSettings)
    queue_limit = models.PositiveIntegerField(null=True, blank=True)
    max_wait_seconds = models.PositiveIntegerField(null=True, blank=True)
    routing = models.CharField(max_length=20, choices=Routing.choices, default=Routing.PREFIX)
    # an answer whose engine fails mid-answer is resumed on another replica (issue 38): at most this many times
    # per answer (0: never), and a streamed answer's engine silent this long counts as failed
    resume_limit = models.PositiveSmallIntegerField(default=2)
    stream_idle_timeout_seconds = models.PositiveIntegerField(default=30)  # at least 1
    # other names a request may give for it (ALIAS_PATTERN), sorted; none is a model's name or another's alias
    # (cluster/operations/models.py checks, under a lock); the gateway looks a name up first, so none shadows one
    aliases = models.JSONField(default=list, blank=True)
    # Autoscaled between min_replicas and max_replicas when min_replicas is set (else `replicas`, fixed);
    # min 0: on demand, loaded when a request names it and unloaded when idle (cluster/autoscaler.py)
    min_replicas = models.PositiveIntegerField(null=True, blank=True)
    max_replicas = models.PositiveIntegerField(null=True, blank=True)
    target_inflight = models.PositiveIntegerField(default=4)  # requests in flight per ready replica it aims at
    idle_after_seconds = models.PositiveIntegerField(default=900)  # min 0: no request this long, down to zero
    scale_down_delay_seconds = models.PositiveIntegerField(default=300)  # below the target this long: one fewer
    removing = models.BooleanField(default=False)
    failures = models.PositiveIntegerField(default=0)  # consecutive engine failures, for the back-off
    backoff_until = models.DateTimeField(null=True, blank=True)
    placement_note = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None

    @property
    def on_demand(self) -> bool:
        return self.min_replicas == 0

    @property
    def mode(self) -> str:
        """fixed, autoscaled, or on-demand (autoscaled from zero)."""
        return "fixed" if not self.autoscaled else "on-demand" if self.on_demand else "autoscaled"

    def scaling_text(self) -> str:
        """How it scales, in an operator's words."""
        if not self.autoscaled:
            return f"{self.replicas} replica(s)"
        idle = f", none after {format_duration(self.idle_after_seconds)} idle" if self.on_demand else ""
        return (f"{self.min_replicas} to {self.max_replicas} replicas at {self.target_inflight} requests in flight "
                f"each (one replica fewer after {format_duration(self.scale_down_delay_seconds)} below that{idle})")

    def resuming_text(self) -> str:
        """How an answer whose engine fails mid-answer is resumed elsewhere, in an operator's words."""
        if not self.resume_limit:
            return "an answer never resumed on another replica"
        return (f"an answer resumed on another replica at most {self.resume_limit} time(s) (a stream silent "
                f"{format_duration(self.stream_idle_timeout_seconds)} counts as failed)")

    def capabilities(self) -> tuple[str, ...]:
        """What its replicas serve (ground.engines.CAPABILITIES), as its engine's driver reads its profile."""
        if self.engine.serves:  # an operator's declaration (a command engine's)
            return tuple(c for c in CAPABILITIES if c in self.engine.serves)
        try:
            driver = driver_for(self.engine.kind)
        except ValueError:
            return CAPABILITIES
        return driver.capabilities(self.profile.args())

    def slots(self) -> int | None:
        """Requests one of its replicas serves at once, as its engine's driver reads its profile (None: not known,
        so admission does not bound it)."""
        try:
            driver = driver_for(self.engine.kind)
        except ValueError:
            return None
        return driver.slots(self.profile.args(), self.engine.command)

    def context(self) -> int | None:
        """Its replicas' tokens of context, as its engine's driver reads its profile (None: not known)."""
        try:
            driver = driver_for(self.engine.kind)
        except ValueError:
            return None
        return driver.context(self.profile.args())

    def memory_estimate(self) -> int:
        if self.memory_bytes:
            return self.memory_bytes
        return memory.estimate(self.file.size, self.file.gguf, self.profile.context_size)


class Rollout(models.Model):
    """A model change tried on canary replicas beside the current ones, judged on the fleet's own traffic (the
    request records) and promoted or rolled back by llmgw itself (cluster/rollouts.py). The model's own settings
    change only when it is promoted. One at a time per model; its state is here, so it outlives the control
    plane that began it."""

    class State(models.TextChoices):
        WATCHING = "watching", "watching"  # the canary serves its share; judged as requests come
        PROMOTING = "promoting", "promoting"  # the model has the new settings; its replicas are replaced one at a time
        PROMOTED = "promoted", "promoted"
        ROLLING_BACK = "rolling_back", "rolling back"  # the canary drains and stops; the model never changed
        ROLLED_BACK = "rolled_back", "rolled back"
        ABORTED = "aborted", "aborted"  # by hand: the canary drains and stops

    ACTIVE = frozenset({State.WATCHING, State.PROMOTING, State.ROLLING_BACK})
    FINISHED = frozenset({State.PROMOTED, State.ROLLED_BACK, State.ABORTED})

    model = models.ForeignKey("Model", on_delete=models.CASCADE, related_name="rollouts")
    state = models.CharField(max_length=16, choices=State.choices, default=State.WATCHING, db_index=True)
    # what the canary runs (None: as the model): the model's own once promoted
    file = models.ForeignKey(ModelFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    profile = models.ForeignKey(Profile, null=True, blank=True, on_delete=models.SET_NULL, related_name="rollouts")
    engine = models.ForeignKey(EngineVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # the model's settings before (of those the rollout changes): what a promotion that fails goes back to
    was_file = models.ForeignKey(ModelFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    was_profile = models.ForeignKey(Profile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    was_engine = models.ForeignKey(EngineVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    was_memory_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    # the canary's memory per replica, when the rollout changes it ("memory" in `change`; None there: estimated
    # from the new file and profile): the model's own once promoted. Without "memory" in `change`, the model's.
    memory_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    # the change in words, as it began: {"file": [from, to], "profile": [from, to], "engine": [from, to],
    # "memory": [from, to]}
    change = models.JSONField(default=dict, blank=True)
    canary = models.PositiveSmallIntegerField(default=1)  # canary replicas
    traffic = models.FloatField(default=0.10)  # the share of new conversations the canary takes
    shadow = models.FloatField(default=0.0)  # the share of the others' requests also sent to it, answers discarded
    watch_seconds = models.PositiveIntegerField(default=600)  # judged this long from its first ready canary
    min_requests = models.PositiveIntegerField(default=50)  # each side's requests before it is judged
    max_error_rate = models.FloatField(default=0.01)  # the canary's errors per request
    max_ttft_ratio = models.FloatField(default=1.5)  # canary's median time to first token / the current side's
    max_tpot_ratio = models.FloatField(default=1.3)  # likewise per output token
    actor = models.CharField(max_length=120)  # who started it
    started_at = models.DateTimeField(default=timezone.now)
    watching_since = models.DateTimeField(null=True, blank=True)  # its first canary ready: the window begins
    # since when no canary of it has been ready while serving (None: one is): past LLMGW_ROLLOUT_READY_TIMEOUT, it
    # is rolled back. Its start, at first; kept at now while serving is stopped
    unready_since = models.DateTimeField(null=True, blank=True, default=timezone.now)
    state_changed_at = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)
    reason = models.CharField(max_length=500, blank=True, default="")  # why it is in its state (promoted, rolled back)
    failures = models.PositiveIntegerField(default=0)  # canary engines that failed (a node lost is not theirs)
    note = models.CharField(max_length=500, blank=True, default="")  # why its canary is not placed, if it is not
    figures = models.JSONField(default=dict, blank=True)  # both sides' figures as last judged (cluster/rollouts.py)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [models.UniqueConstraint(
            fields=["model"], condition=models.Q(state__in=["watching", "promoting", "rolling_back"]),
            name="one_rollout_per_model")]

    def __str__(self):
        return f"rollout of {self.model_id} ({self.state})"

    @property
    def active(self) -> bool:
        return self.state in self.ACTIVE

    def change_text(self) -> str:
        """`file a.gguf -> b.gguf, profile p -> q`."""
        return ", ".join(f"{what} {was} -> {now}" for what, (was, now) in self.change.items()) or "no change"

    def runs_new(self, snapshot: dict | None) -> bool:
        """Whether a replica started with `snapshot` runs this rollout's new file, profile and engine."""
        snap = snapshot or {}
        new = {"file": self.file and self.file.sha256, "profile": self.profile and self.profile.name,
               "engine": self.engine and self.engine.spec()}
        return bool(snap) and all(snap.get(what) == new[what] for what in ("file", "profile", "engine")
                                  if what in self.change and new[what] is not None)


class Replica(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"
        DOWNLOADING = "downloading"
        STARTING = "starting"
        READY = "ready"
        DRAINING = "draining"
        STOPPING = "stopping"
        STOPPED = "stopped"
        FAILED = "failed"

    class Restart(models.TextChoices):
        NONE = "none"
        QUEUED = "queued"
        REPLACING = "replacing"

    # Counts toward its model (when its restart marker is not `replacing`).
    COUNTING = frozenset({State.PENDING, State.DOWNLOADING, State.STARTING, State.READY})
    # Holds memory on its node and is in the node's desired list.
    RUNNING = frozenset({State.PENDING, State.DOWNLOADING, State.STARTING, State.READY, State.DRAINING})
    TERMINAL = frozenset({State.STOPPED, State.FAILED})
    COLOURS = {
        State.PENDING: "grey",
        State.DOWNLOADING: "blue",
        State.STARTING: "blue",
        State.READY: "green",
        State.DRAINING: "orange",
        State.STOPPING: "orange",
        State.STOPPED: "grey",
        State.FAILED: "red",
    }

    name = models.CharField(max_length=80, unique=True)
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="replica_set")
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="replicas")
    gpu_index = models.IntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING, db_index=True)
    restart = models.CharField(max_length=16, choices=Restart.choices, default=Restart.NONE)
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    memory_bytes = models.BigIntegerField(default=0)
    reason = models.CharField(max_length=500, blank=True, default="")  # why it is not placed, or why it failed
    # not placed, but room is coming: an idle on-demand model's replica will be evicted for it (its requests wait)
    waiting_for_room = models.BooleanField(default=False)
    log_tail = models.TextField(blank=True, default="")
    snapshot = models.JSONField(default=dict, blank=True)  # profile args, engine, engine-key fingerprint at start
    # a canary of this rollout (its settings are the rollout's, and it does not count toward its model); None once
    # promoted: then it is one of the model's own
    rollout = models.ForeignKey(Rollout, null=True, blank=True, on_delete=models.SET_NULL, related_name="canaries")
    download_done = models.BigIntegerField(default=0)
    download_total = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["model__name", "name"]
        indexes = [models.Index(fields=["node", "state"])]

    def __str__(self):
        return self.name

    @classmethod
    def new_name(cls, model_name: str) -> str:
        return f"{model_name}-{secrets.token_hex(4)}"

    @property
    def counts(self) -> bool:
        return self.state in self.COUNTING and self.restart != self.Restart.REPLACING


class Demand(models.Model):
    """An autoscaled model's autoscaler state, so a restarted control plane carries on where it was: how many
    replicas it wants now, the load it saw over the window, since when the load has been low, the last request."""

    model = models.OneToOneField(Model, on_delete=models.CASCADE, related_name="demand")
    replicas = models.PositiveIntegerField(default=0)
    samples = models.JSONField(default=list, blank=True)  # [[epoch seconds, requests in flight or waiting], ...]
    below_since = models.DateTimeField(null=True, blank=True)  # the load has been below the target since
    last_request_at = models.DateTimeField(null=True, blank=True)
    last_scaled_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"demand for {self.model_id}"


class ClusterSettings(models.Model):
    """One row, read live."""

    serving_stopped = models.BooleanField(default=False)
    drain_grace_seconds = models.PositiveIntegerField(default=300)
    reconcile_interval_seconds = models.PositiveIntegerField(default=5)
    # an on-demand model's replica is evicted for another only once it has served this long (no thrash)
    min_resident_seconds = models.PositiveIntegerField(default=30)
    # admission's defaults for a model that sets none: requests that may wait for a slot, and how long
    queue_limit = models.PositiveIntegerField(default=512)
    max_wait_seconds = models.PositiveIntegerField(default=120)
    engine_key = models.CharField(max_length=128, blank=True, default="")
    previous_engine_key = models.CharField(max_length=128, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)
    # the reconciler's last pass (written every few seconds), and the last stretch with none, when every control
    # plane was stopped: a node's silence then is not counted against it (cluster.reconciler.watch)
    watched_at = models.DateTimeField(null=True, blank=True)
    away_from = models.DateTimeField(null=True, blank=True)
    away_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "cluster settings"

    def __str__(self):
        return "cluster settings"

    @classmethod
    def load(cls) -> "ClusterSettings":
        """The row, with the engine key made the first time anyone asks: once, by whichever process gets there
        first, with an Event; every other process, at once or later, gets that same key."""
        obj = cls.objects.filter(pk=1).first()
        if obj is not None and obj.engine_key:
            return obj
        key = cls.new_engine_key()
        with transaction.atomic():
            obj, made = cls.objects.get_or_create(pk=1, defaults={"engine_key": key})  # one insert wins
            if not made and not obj.engine_key:  # a row without a key: give it one, unless another just did
                made = bool(cls.objects.filter(pk=1, engine_key="").update(engine_key=key))
                obj.refresh_from_db()
            if made:
                message = f"engine key created (fingerprint {cls.fingerprint(key)}): every engine requires it"
                log.info("system engine_key.created: %s", message)
                Event.objects.create(kind="engine_key.created", actor="system", message=message)
        return obj

    @staticmethod
    def new_engine_key() -> str:
        return "lek_" + secrets.token_urlsafe(32)

    @staticmethod
    def fingerprint(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:12]


class Event(models.Model):
    """Append-only: what happened, to what, and who or what did it."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=64, db_index=True)  # e.g. model.added, replica.placed, replica.failed
    actor = models.CharField(max_length=120)  # user:alice, reconciler, agent:gpu-1, system
    subject = models.CharField(max_length=120, blank=True, default="", db_index=True)  # e.g. smollm2-3f2a91c0
    message = models.CharField(max_length=1000)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind} {self.message}"
