"""The server's Prometheus figures (``GET /metrics``), in a registry of its own per server."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import InfoMetricFamily
from prometheus_client.registry import Collector

from swiftspec.engine.events import StepEvent
from swiftspec.engine.host.protocol import EngineInfo

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Requests by route and status, tokens, the queue, time to first token, per-token latency and the
    draft's acceptance (accepted / verified draft tokens: rate = their ratio)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("swiftspec_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("swiftspec_prompt_tokens", "Prompt tokens of the requests the engine took", registry=r)
        self.generated_tokens = Counter("swiftspec_generated_tokens", "Tokens generated", registry=r)
        self.accepted_tokens = Counter("swiftspec_accepted_draft_tokens", "Draft tokens the target accepted",
                                       registry=r)
        self.verified_tokens = Counter("swiftspec_verified_draft_tokens", "Draft tokens the target verified",
                                       registry=r)
        self.verifications = Counter("swiftspec_verifications", "Target verifications (speculative modes)",
                                     registry=r)
        self.queue_length = Gauge("swiftspec_queue_length", "Requests waiting for the engine", registry=r)
        self.engine_up = Gauge("swiftspec_engine_up", "1 while the engine can answer", registry=r)
        self.restarts = Counter("swiftspec_engine_restarts", "Times the engine was started again", registry=r)
        self.queue_seconds = Histogram("swiftspec_queue_seconds", "Time a request waited for the engine",
                                       buckets=WAIT_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("swiftspec_time_to_first_token_seconds",
                                             "Arrival of a request to its first token", buckets=WAIT_BUCKETS,
                                             registry=r)
        self.token_latency = Histogram("swiftspec_token_latency_seconds", "Time per generated token",
                                       buckets=LATENCY_BUCKETS, registry=r)

    def describe(self, info: Callable[[], EngineInfo]) -> None:
        """``swiftspec_engine_info``: what runs, read from ``info`` at each scrape (a restart's new ranks)."""
        self.registry.register(_Described(info))

    def step(self, event: StepEvent) -> None:
        s, n = event.stats, len(event.token_ids)
        self.generated_tokens.inc(n)
        for _ in range(n if s.generated > n else 0):  # the first step's latency is the prefill's: TTFT's
            self.token_latency.observe(s.token_latency_ms / 1e3)
        if s.tree_size:
            self.verifications.inc()
            self.accepted_tokens.inc(s.accepted)
            self.verified_tokens.inc(s.tree_size - 1)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Described(Collector):
    """The engine info's labels, as the TUI's Layout box and /swiftspec/v1/info name them."""

    def __init__(self, info: Callable[[], EngineInfo]):
        self.info = info

    def collect(self):
        info = self.info()
        yield InfoMetricFamily("swiftspec_engine", "What runs: the target and its precision, the draft, the ranks "
                               "and the CPU kernels' threads by mode", value={
                                   "model": info.target, "draft": info.draft,
                                   "ranks": ", ".join(f"{r.role} r{r.rank} {r.device}" for r in info.ranks),
                                   "kernel_threads": info.kernel_threads_by_mode()})
