"""Prometheus metrics of the gateway, with vLLM-style names under the ``halfmoon:`` prefix.

Each gateway owns its registry (no global state). Its ``/metrics`` serves them merged with
the Conductor's and every worker's (:mod:`halfmoon.serve.gateway.scrape`; a worker's block
store figures come from the worker itself, :mod:`halfmoon.serve.worker.metrics`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class GatewayMetrics:
    """Counters, gauges and histograms the gateway updates per request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "halfmoon:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "halfmoon:inter_token_latency_seconds",
            "Gap between consecutive output tokens; tokens that arrive together (several "
            "from one engine step, e.g. accepted draft tokens) count once, as vLLM's.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "halfmoon:e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft_estimate_error = Histogram(
            "halfmoon:ttft_estimate_error_seconds",
            "Actual minus the Conductor's estimated TTFT.",
            buckets=(-10, -5, -2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "halfmoon:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "halfmoon:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "halfmoon:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "halfmoon:generation_tokens", "Generated tokens.", registry=r
        )
        self.requests = Counter(
            "halfmoon:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        #: By LoRA adapter (vLLM's ``lora_requests_info`` names the running ones; here a
        #: gauge and a counter per adapter, which a dashboard can sum and rate).
        self.lora_running = Gauge(
            "halfmoon:lora_requests_running",
            "Requests being generated, by LoRA adapter.",
            ["lora_name"],
            registry=r,
        )
        self.lora_requests = Counter(
            "halfmoon:lora_request_success",
            "Finished requests, by LoRA adapter.",
            ["lora_name"],
            registry=r,
        )
        self.rejections = Counter(
            "halfmoon:request_rejections", "Requests rejected early (HTTP 429).", registry=r
        )
        self.errors = Counter(
            "halfmoon:request_errors", "Requests that failed inside the cluster.", registry=r
        )
        self.kv_transfer_bytes = Counter(
            "halfmoon:kv_transfer_bytes",
            "KV bytes moved between workers (streams, pulls).",
            registry=r,
        )
        self.conductor_decision = Histogram(
            "halfmoon:conductor_decision_seconds",
            "Time the Conductor spent placing a request.",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=r,
        )
        self.conductor_rtt = Histogram(
            "halfmoon:conductor_rtt_seconds",
            "Gateway-side round trip of a placement.",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
            registry=r,
        )
        self.running = Gauge(
            "halfmoon:num_requests_running", "Requests being generated.", registry=r
        )
        #: Weight updates while serving (``/update_weights_from_disk``; vLLM names its own
        #: ``vllm:rl_weight_update_*``): how long each took (generation paused
        #: throughout), by outcome.
        self.weight_update = Histogram(
            "halfmoon:rl_weight_update_duration_seconds",
            "Duration of one weight update (pause, staging on every worker, install, cache "
            "flush), by outcome (ok, failed).",
            ["outcome"],
            buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.stored_responses = Gauge(
            "halfmoon:responses_stored",
            "Responses API answers kept for previous_response_id (--responses-store-mb).",
            registry=r,
        )
        self.stored_response_bytes = Gauge(
            "halfmoon:responses_stored_bytes",
            "Bytes (JSON) those stored answers count against the store's budget.",
            registry=r,
        )
        self.scrape_errors = Counter(
            "halfmoon:scrape_errors",
            "Processes (worker: its instance id, or conductor) that did not answer a /metrics "
            "scrape in time: skipped.",
            ["worker"],
            registry=r,
        )

        self.replan_rounds = Counter(
            "halfmoon:replan_rounds",
            "Re-planning rounds (--replan) by outcome: stay, or move to another P:D split.",
            ["outcome"],
            registry=r,
        )
        self.replan_moves = Counter(
            "halfmoon:replan_moves",
            "Workers re-planning moved to another role, by the role they moved to.",
            ["to_role"],
            registry=r,
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
