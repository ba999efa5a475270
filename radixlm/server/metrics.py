"""Prometheus metrics (`radixlm:` prefix, names after SGLang's and vLLM's).

Latencies and token counters are observed in the TokenizerManager as
messages arrive; the scheduler's live state (running/queued requests, KV
usage, hit rate) is read from it when /metrics is scraped, so the gauges are
always current and nothing is pushed while nobody looks. TTFT and
inter-token latency exist only for streamed requests: a non-streamed one
produces a single message, its end-to-end latency is still recorded.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from radixlm.protocol import TokenOut

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # the `_created` series only add noise to a scrape
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"radixlm:{name}", doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"radixlm:{name}", doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"radixlm:{name}", doc, list(labels), buckets=buckets,
                             registry=r).labels(**labels)

        self.num_running = gauge("num_running_reqs", "Requests being decoded")
        self.num_queued = gauge("num_queue_reqs", "Requests waiting to be scheduled")
        self.token_usage = gauge("token_usage", "Fraction of KV slots held by live requests")
        self.kv_tokens_cached = gauge("kv_tokens_cached", "Evictable KV tokens in the radix tree")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache")
        self.spec_accept_length = gauge(
            "spec_accept_length", "Speculative decoding: tokens per verify step and request "
            "(1 + accepted drafts / verifies), since start; 0 without speculation")
        self.spec_accept_rate = gauge(
            "spec_accept_rate", "Speculative decoding: accepted / proposed draft tokens")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.finished = Counter("radixlm:num_requests", "Finished requests by finish reason",
                                ["model_name", "finish_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (streamed)",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens (streamed)",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish",
                             _LATENCY_BUCKETS)

    # ---- observed by the TokenizerManager --------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, seconds: float, num_tokens: int) -> None:
        per_token = seconds / max(num_tokens, 1)
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def on_finish(self, token: TokenOut, seconds: float, finish_type: str) -> None:
        self.prompt_tokens.inc(token.prompt_tokens)
        self.generation_tokens.inc(token.completion_tokens)
        self.e2e.observe(seconds)
        self.finished.labels(model_name=self.model_name, finish_reason=finish_type).inc()

    # ---- refreshed on scrape ------------------------------------------------------------
    def set_scheduler_state(self, info: dict[str, Any]) -> None:
        self.num_running.set(info["num_running_requests"])
        self.num_queued.set(info["num_queued_requests"])
        self.token_usage.set(info["kv_tokens_in_use"] / max(info["kv_tokens_total"], 1))
        self.kv_tokens_cached.set(info["kv_tokens_cached"])
        self.cache_hit_rate.set(info["cache_hit_rate"])
        verifies, drafts = info.get("num_spec_verifies", 0), info.get("num_draft_tokens", 0)
        accepted = info.get("num_accepted_drafts", 0)
        self.spec_accept_length.set(1 + accepted / verifies if verifies else 0.0)
        self.spec_accept_rate.set(accepted / drafts if drafts else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
