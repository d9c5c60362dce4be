"""Prometheus metrics (`/metrics`), under SGLang's names with our prefix (`radixserve:`).

Counters and latency histograms are fed by the tokenizer manager as outputs pass through it, for
every client, ZMQ or HTTP; the load gauges are the scheduler's server_info, read at each scrape.
Two registries per server (not prometheus_client's global one): the gauges have their own, so
that a scrape the scheduler could not answer in time (a long step) still has the counters.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixserve.protocol.internal import ReqStrOut
from radixserve.protocol.wire import ServerInfoReply
from radixserve.tokenizer_manager.inflight import InFlightRequest

PREFIX = "radixserve:"
# SGLang's buckets (seconds), cut to what a CPU server sees.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.load_registry = CollectorRegistry()  # the gauges, from the scheduler's server_info

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=self.load_registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.num_running_reqs = gauge("num_running_reqs", "Requests running.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting for admission.")
        self.num_used_tokens = gauge("num_used_tokens", "KV cache tokens in use.")
        self.token_usage = gauge("token_usage", "Fraction of the KV cache in use.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix cache hit rate.")
        self.gen_throughput = gauge("gen_throughput", "Generation throughput (token/s).")
        self.spec_accept_length = gauge(
            "spec_accept_length",
            "Speculative decoding: tokens per verifying request step, since the start.",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the cache.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_requests = counter("num_requests", "Completions finished (aborted included).")
        self.num_aborted_requests = counter("num_aborted_requests", "Completions aborted.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token (streamed).", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between tokens (streamed).", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from request to its last token.", _E2E_BUCKETS
        )

    def on_tokens(
        self, request: InFlightRequest, previous: float | None, out: ReqStrOut, now: float
    ) -> None:
        """An output with tokens; `previous`: when the completion's last one came. Only streamed
        completions time their tokens: the others come whole at their end."""
        self.generation_tokens.inc(len(out.new_token_ids))
        if not request.stream:
            return
        if previous is None:
            self.ttft.observe(now - request.created)
            return
        # k tokens in one output (speculation): k gaps, of the interval's k-th each (SGLang's).
        count = len(out.new_token_ids)
        for _ in range(count):
            self.itl.observe((now - previous) / count)

    def on_finished(self, request: InFlightRequest, out: ReqStrOut) -> None:
        assert out.finished_reason is not None
        self.num_requests.inc()
        if out.finished_reason.type == "abort":
            self.num_aborted_requests.inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.cached_tokens.inc(out.cached_tokens)
        self.e2e.observe(time.monotonic() - request.created)

    def expose(self, info: ServerInfoReply | None) -> bytes:
        """The text exposition, with the load gauges set from the scheduler's `info`; without
        them where it had none (no figure beats a stale one)."""
        if info is None:
            return generate_latest(self.registry)
        self.num_running_reqs.set(info.running_requests)
        self.num_queue_reqs.set(info.waiting_requests)
        self.num_used_tokens.set(info.kv_tokens_used)
        self.token_usage.set(info.kv_tokens_used / max(info.kv_tokens_total, 1))
        self.cache_hit_rate.set(info.cache_hit_rate)
        self.gen_throughput.set(info.gen_throughput)
        self.spec_accept_length.set(info.spec_accept_length)
        return generate_latest(self.registry) + generate_latest(self.load_registry)
