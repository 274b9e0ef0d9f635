"""Prometheus exposition with MindIE's metric names (reference §3.14) and vLLM-style histograms.

Request-level samples come from lifecycle events (gateway and engine); gauges and token counters
from the engine's heartbeats. Every sample carries ``model_name``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.messages import EngineInfo, Finished, FirstToken, MetricsEvent, Queued, Received

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
E2E_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000, 50000, 64000, 128000)
SUCCESS = {"length", "eos_token", "stop_sequence"}
RATE_WINDOW_S = 10.0


class PrometheusMetrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.received = Counter("request_received", "Number of requests received so far.", label, registry=r)
        self.success = Counter("request_success", "Number of requests proceed successfully so far.", label, registry=r)
        self.failed = Counter("request_failed", "Number of requests failed so far.", label, registry=r)
        self.finished = Counter("request_finished", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.running = Gauge("num_requests_running", "Number of requests currently running.", label, registry=r)
        self.waiting = Gauge("num_requests_waiting", "Number of requests waiting.", label, registry=r)
        self.swapped = Gauge("num_requests_swapped", "Number of requests swapped to CPU.", label, registry=r)
        self.preemptions = Counter("num_preemptions", "Cumulative number of preemptions.", label, registry=r)
        self.prompt_rate = Gauge("avg_prompt_throughput_toks_per_s", "Average prefill throughput in tokens/s.",
                                 label, registry=r)
        self.gen_rate = Gauge("avg_generation_throughput_toks_per_s", "Average generation throughput in tokens/s.",
                              label, registry=r)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", label,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("time_per_output_token_seconds", "Time per output token (inter-token latency) in seconds.",
                              label, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("e2e_request_latency_seconds", "End to end request latency in seconds.", label,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("request_queue_time_seconds", "Time from receipt to first schedule in seconds.", label,
                               buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("request_prompt_tokens", "Prompt tokens per request.", label,
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.gen_tokens = Histogram("request_generation_tokens", "Generated tokens per request.", label,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_total = Counter("prompt_tokens", "Number of prefill tokens processed.", label, registry=r)
        self.gen_total = Counter("generation_tokens", "Number of generation tokens processed.", label, registry=r)
        self.failed_perc = Gauge("failed_request_perc", "Failed requests ratio (1 = 100%).", label, registry=r)
        self.cache_usage = Gauge("npu_cache_usage_perc", "KV-cache block usage of the accelerator or CPU pool (1 = 100%).",
                                 label, registry=r)
        self.cpu_cache_usage = Gauge("cpu_cache_usage_perc", "KV-cache usage of swap space (1 = 100%).", label, registry=r)
        self.prefix_hit = Gauge("npu_prefix_cache_hit_rate", "Prefix-cache block hit rate.", label, registry=r)
        self._samples: list[tuple[float, int, int]] = []  # (time, prompt total, generation total)
        self._engine_totals: dict[str, int] = {}  # the engine's counters as last seen
        self._succeeded = self._failed = 0

    def observe(self, event: MetricsEvent) -> None:
        m = self.model
        if isinstance(event, Received):
            self.received.labels(m).inc()
        elif isinstance(event, Queued):
            for seconds in event.seconds:
                self.queue.labels(m).observe(seconds)
        elif isinstance(event, FirstToken):
            self.ttft.labels(m).observe(event.ttft_s)
        elif isinstance(event, Finished):
            self._finished(event)

    def _finished(self, event: Finished) -> None:
        m = self.model
        self.finished.labels(m, event.finish_reason).inc()
        if event.finish_reason in SUCCESS:
            self._succeeded += 1
            self.success.labels(m).inc()
        elif event.finish_reason == "error":
            self._failed += 1
            self.failed.labels(m).inc()
        if event.finish_reason in SUCCESS:  # latency and size histograms describe served requests
            self.e2e.labels(m).observe(event.e2e_s)
            self.prompt_tokens.labels(m).observe(event.prompt_tokens)
            self.gen_tokens.labels(m).observe(event.generated_tokens)
        if event.ttft_s is not None and event.generated_tokens > 1:
            self.tpot.labels(m).observe((event.e2e_s - event.ttft_s) / (event.generated_tokens - 1))
        done = self._succeeded + self._failed
        self.failed_perc.labels(m).set(self._failed / done if done else 0.0)

    def heartbeat(self, info: EngineInfo) -> None:
        m = self.model
        self.running.labels(m).set(info.running)
        self.waiting.labels(m).set(info.waiting)
        self.swapped.labels(m).set(0)
        self._advance(self.preemptions, "preemptions", info.preemptions_total)
        self._advance(self.prompt_total, "prompt", info.prompt_tokens_total)
        self._advance(self.gen_total, "generation", info.generation_tokens_total)
        self.cache_usage.labels(m).set(1.0 - info.free_blocks / info.total_blocks if info.total_blocks else 0.0)
        self.cpu_cache_usage.labels(m).set(0.0)
        self.prefix_hit.labels(m).set(0.0)
        self._rates(time.monotonic(), info)

    def _advance(self, counter: Counter, key: str, total: int) -> None:
        """Move a counter by what an engine counter grew since the last heartbeat (a restarted engine restarts at 0)."""
        last = self._engine_totals.get(key, 0)
        counter.labels(self.model).inc(total - last if total >= last else total)
        self._engine_totals[key] = total

    def _rates(self, now: float, info: EngineInfo) -> None:
        """Token throughput over the last RATE_WINDOW_S seconds of heartbeats."""
        self._samples.append((now, info.prompt_tokens_total, info.generation_tokens_total))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.pop(0)
        t0, p0, g0 = self._samples[0]
        if now - t0 > 0:
            self.prompt_rate.labels(self.model).set((info.prompt_tokens_total - p0) / (now - t0))
            self.gen_rate.labels(self.model).set((info.generation_tokens_total - g0) / (now - t0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
