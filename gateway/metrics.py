"""Prometheus metrics of this web process (prometheus-client). Scrape every web process, or sum behind a proxy."""

from prometheus_client import Counter, Gauge, Histogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("llmgw_requests_total", "Requests through the gateway", ["model", "status", "replica"])
LATENCY = Histogram("llmgw_request_seconds", "Whole request time", ["model"], buckets=BUCKETS)
FIRST_TOKEN = Histogram("llmgw_time_to_first_chunk_seconds", "Time to the first streamed chunk", ["model"], buckets=BUCKETS)
INFLIGHT = Gauge("llmgw_inflight_requests", "Requests in flight in this process", ["model"])
TOKENS = Counter("llmgw_tokens_total", "Tokens, from the engines' usage", ["model", "kind"])
