"""Prometheus metrics of one server (own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ddspec.engine import RunStats, StepStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, queue_depth) -> None:
        """queue_depth() -> requests queued or running (read at each scrape)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ddspec_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ddspec_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.reused_tokens = Counter("ddspec_reused_prompt_tokens",
                                     "prompt tokens whose KV was kept from the previous generation (prefix reuse)",
                                     registry=r)
        self.generated_tokens = Counter("ddspec_generated_tokens", "tokens sent to clients (cancelled requests included)",
                                        registry=r)
        self.steps = Counter("ddspec_steps", "decoding steps (one target forward each)", registry=r)
        self.tau = Histogram("ddspec_tau", "mean accepted length per finished request (tokens per step)",
                             buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8), registry=r)
        self.draft = Histogram("ddspec_step_draft_seconds", "draft time per step", buckets=STEP_BUCKETS, registry=r)
        self.verify = Histogram("ddspec_step_verify_seconds", "verification time per step (target forward + "
                                "acceptance)", buckets=STEP_BUCKETS, registry=r)
        self.ttft = Histogram("ddspec_time_to_first_token_seconds", "admission to first token (queueing included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("ddspec_request_seconds", "admission to last token", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.queue = Gauge("ddspec_queue_depth", "requests queued or running", registry=r)
        self.queue.set_function(queue_depth)

    def step(self, step: StepStats) -> None:
        """Per decoding step (called from the worker thread; prometheus_client is thread-safe)."""
        self.steps.inc()
        self.draft.observe(step.draft_ms / 1e3)
        self.verify.observe(step.verify_ms / 1e3)

    def finished(self, stats: RunStats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.reused_tokens.inc(stats.reused_tokens)
        if stats.steps:
            self.tau.observe(stats.tau)

    def render(self) -> bytes:
        return generate_latest(self.registry)
