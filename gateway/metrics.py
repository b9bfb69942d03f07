"""Prometheus metrics of this web process (prometheus-client), and the fleet's replicas by state as the database
counts them at each scrape. Scrape every web process, or sum behind a proxy."""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

UNKNOWN_MODEL = "unknown"  # the label of every model name llmgw does not serve
# LLM latencies: a cached prompt's first token in tens of milliseconds, a cold long prompt's in seconds, a long
# completion in minutes; the bounds are dense where TTFT objectives sit (0.1 to 2 s) and reach 10 minutes
BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 8)

# Labels with a bounded set of values only (tests/gateway/test_metrics.py): a model llmgw serves (else `unknown`),
# a status code, a kind of token. Never a replica: each replica ever started would be a series for ever (which
# replica served a request is in the access log and the X-Llmgw-Replica header).
REQUESTS = Counter("llmgw_requests_total", "Requests through the gateway", ["model", "status"])
LATENCY = Histogram("llmgw_request_seconds", "Whole request time", ["model"], buckets=BUCKETS)
FIRST_TOKEN = Histogram("llmgw_time_to_first_chunk_seconds", "Time to the first streamed chunk", ["model"], buckets=BUCKETS)
WAITED = Histogram("llmgw_replica_wait_seconds", "Time a request waited for a ready replica (0: one was ready)",
                   ["model"], buckets=(0.001, *BUCKETS))
ATTEMPTS = Histogram("llmgw_upstream_attempts", "Replicas a request was sent to (more than 1: it failed over)",
                     ["model"], buckets=ATTEMPT_BUCKETS)
INFLIGHT = Gauge("llmgw_inflight_requests", "Requests in flight in this process", ["model"])
TOKENS = Counter("llmgw_tokens_total", "Tokens, from the engines' usage", ["model", "kind"])
# admission (gateway/admission.py), by model and class (interactive, standard, batch); a rejection by reason
# (queue_full, queue_timeout, budget_exceeded, concurrency_limit)
PRIORITIES = ("interactive", "standard", "batch")  # admission.CLASSES (tests/gateway/test_metrics.py)
QUEUED = Gauge("llmgw_queue_waiting_requests", "Requests waiting for a slot in this process", ["model", "priority"])
QUEUE_WAIT = Histogram("llmgw_queue_wait_seconds", "Time a request waited for a slot (0: one was free)",
                       ["model", "priority"], buckets=(0.001, *BUCKETS))
ADMITTED = Counter("llmgw_admitted_requests_total", "Requests given a slot", ["model", "priority"])
REJECTED = Counter("llmgw_rejected_requests_total", "Requests refused: the queue, the key's budget or concurrency",
                   ["model", "priority", "reason"])
# an answer resumed on another replica after its engine broke off mid-answer, by why: the engine closed or reset
# the connection, its stream went silent past the idle timeout, its replica left the fleet (failed, node lost),
# or it answered an error event mid-stream
RESUME_REASONS = ("closed", "silent", "lost", "error")
RESUMES = Counter("llmgw_resumes_total", "Answers resumed on another replica after their engine broke off",
                  ["model", "reason"])
RESUMED_PROMPT = Counter("llmgw_resumed_prompt_tokens_total",
                         "Prompt tokens of resumes' continuation requests: the fleet's cost, not the keys'", ["model"])


class Replicas:
    """`llmgw_replicas{model, state}`: the fleet's replicas, read from the database at each scrape, so every web
    process says the same figures (take one, or `max`, never their sum). A collector of one scrape's figures."""

    def __init__(self, by_state: dict[str, dict[str, int]]):
        self.by_state = by_state

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("llmgw_replicas", "Replicas of each model in each state (the whole fleet's)",
                                   labels=["model", "state"])
        for model, states in self.by_state.items():
            for state, n in states.items():
                family.add_metric([model, state], n)
        yield family


def exposition(replicas: dict[str, dict[str, int]]) -> bytes:
    """What `/metrics` answers: this process's series, then the fleet's replicas by state."""
    fleet = CollectorRegistry(auto_describe=False)
    fleet.register(Replicas(replicas))
    return generate_latest() + generate_latest(fleet)


class ModelMetrics:
    """One model's series, looked up once: `labels()` takes a lock and builds a key on every call, and a request
    touches seven of them."""

    __slots__ = ("model", "latency", "first_token", "waited", "attempts", "inflight", "prompt", "completion", "_requests",
                 "queued", "_resumes", "resumed_prompt")

    def __init__(self, model: str):
        self.model = model
        self.latency = LATENCY.labels(model)
        self.first_token = FIRST_TOKEN.labels(model)
        self.waited = WAITED.labels(model)
        self.attempts = ATTEMPTS.labels(model)
        self.inflight = INFLIGHT.labels(model)
        self.prompt = TOKENS.labels(model, "prompt")
        self.completion = TOKENS.labels(model, "completion")
        self._requests: dict[int, Counter] = {}
        # a series at 0 from the model's first request, not from its first wait: a dashboard shows 0, not no data
        self.queued = {priority: QUEUED.labels(model, priority) for priority in PRIORITIES}
        self._resumes = {reason: RESUMES.labels(model, reason) for reason in RESUME_REASONS}  # at 0 too, likewise
        self.resumed_prompt = RESUMED_PROMPT.labels(model)

    def requests(self, status: int) -> Counter:
        series = self._requests.get(status)
        if series is None:
            series = self._requests[status] = REQUESTS.labels(self.model, str(status))
        return series

    def resumes(self, reason: str) -> Counter:
        """The resumes of this model's answers for a reason of RESUME_REASONS (closed, silent, lost, error)."""
        return self._resumes[reason]


_models: dict[str, ModelMetrics] = {}


def of(model: str) -> ModelMetrics:
    """The series of a model llmgw serves (or of UNKNOWN_MODEL): a bounded set, as the labels are."""
    found = _models.get(model)
    if found is None:
        found = _models[model] = ModelMetrics(model)
    return found
