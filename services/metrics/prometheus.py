"""Prometheus exposition with MindIE's metric names (reference §3.14) and vLLM-style histograms.

Request-level samples come from lifecycle events (gateway and engine); gauges and token counters
from the engines' heartbeats. Every sample carries ``model_name``; the request counters
(``request_received``, ``request_success``, ``request_failed``, ``request_finished``) also ``adapter``, the
LoRA adapter the request ran with ("" for the base model), and ``api``, the family and route it came by
(``tgi``, ``vllm``, ``triton``, ``mindie``, ``openai-chat``, ``openai-completions``, ``openai-responses``,
``anthropic``; ``health`` for /health/timed's probe, which the counters count and the latency and size
histograms, ``failed_request_perc`` and /metrics-json's averages leave out).

Many engines: each engine instance (its id in ``EngineInfo.instance``, new for every process, so a
restarted engine is a new instance) counts tokens and preemptions from 0. MindIE's unlabelled counters
(``prompt_tokens_total``, ``generation_tokens_total``, ``num_preemptions_total``) are the sum over every
instance ever heard of what that instance counted: each instance's growth is tracked apart, so one
engine's smaller total is never read as another's restart, and an engine that leaves keeps its last totals
in the sum (a counter never goes down). MindIE's gauges (``num_requests_running``, ``num_requests_waiting``,
``npu_cache_usage_perc``, ``cpu_cache_usage_perc``) cover the engines live now (heard within
``Switchboard.leaseSeconds``); cache usage is blocks in use over blocks of all of them (cpu_cache_usage_perc: of
the prefix cache's host tiers, ``Switchboard.hostKvCacheMemoryMb``; 0 without one). So do the prefix-cache gauges: ``all_radix_match_num`` (prompt
tokens looked up in the prefix cache since each live engine started), ``npu_radix_match_hit_num`` (of those,
the tokens found cached: whole blocks) and ``npu_prefix_cache_hit_rate``, the second over the first (0 when
nothing was looked up, as with ``enablePrefixCache`` off).

Per-engine series live in families of their own, ``engine_*`` with an ``engine_instance`` label
(``engine_prompt_tokens_total``, ``engine_generation_tokens_total``, ``engine_preemptions_total``,
``engine_requests_running``, ``engine_requests_waiting``, ``engine_cache_usage_perc``,
``engine_prefix_cache_hit_rate``), live engines only, and ``engine_info`` (1 per live engine, its device,
dtype, weight format, KV-cache dtype, block size, blocks and PD role in labels).
Adding the label to MindIE's families instead would put the total and its parts under one name, and
``sum(generation_tokens_total)`` would count every token twice (prometheus_client also wants one label
set per family). The per-engine counters are the engines' own counters: a departed engine's series ends,
as a restarted process's would, so chart them with ``rate()`` (``sum by (engine_instance)
(rate(engine_generation_tokens_total[1m]))``) and read totals from the unlabelled families.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.engines import cache_usage, combined, host_cache_usage, prefix_hit_rate
from shared.leases import Leases
from services.metrics.fleet import FleetMetrics
from services.metrics.histograms import SummedHistogram
from shared.messages import EngineInfo, FinishReason
from shared.metrics_messages import (
    PROBE_API,
    Finished,
    FirstToken,
    KvTransferred,
    MetricsEvent,
    PrefixPulled,
    Queued,
    Received,
    Refused,
    Routed,
    TPOT_BUCKETS,
)

KV_BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 33, 2))  # 64 KiB .. 4 GiB
KV_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
E2E_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000, 50000, 64000, 128000)
RATE_WINDOW_S = 10.0


class PrometheusMetrics:
    def __init__(self, model: str, lease_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.clock = clock
        self.engines: Leases[EngineInfo] = Leases(lease_s, clock)  # the live engines: gauges
        self._last: dict[str, EngineInfo] = {}  # every engine instance ever heard, as last heard: counters
        self.registry = r = CollectorRegistry()
        label, by_adapter = ["model_name"], ["model_name", "adapter", "api"]
        self.received = Counter("request_received", "Number of requests received so far.", by_adapter, registry=r)
        self.success = Counter("request_success", "Number of requests proceed successfully so far.", by_adapter,
                               registry=r)
        self.failed = Counter("request_failed", "Number of requests failed so far.", by_adapter, registry=r)
        self.finished = Counter("request_finished", "Finished requests by finish reason.",
                                [*by_adapter, "finished_reason"], registry=r)
        self.refused = Counter("request_refused", "Inference requests answered with an error before they were "
                               "received (bad input, slots full, no engine serving), by HTTP status.",
                               ["model_name", "api", "status"], registry=r)
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
        self.tpot = SummedHistogram("time_per_output_token_seconds",
                                    "Time per output token (inter-token latency) in seconds.", label, TPOT_BUCKETS)
        r.register(self.tpot)
        self.e2e = Histogram("e2e_request_latency_seconds", "End to end request latency in seconds.", label,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("request_queue_time_seconds", "Time from receipt to first schedule in seconds.", label,
                               buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("request_prompt_tokens", "Prompt tokens per request.", label,
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.gen_tokens = Histogram("request_generation_tokens", "Generated tokens per request.", label,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.kv_bytes = Histogram("kv_transfer_bytes", "K/V bytes a prefill engine handed to a decode engine, per "
                                  "request.", label, buckets=KV_BYTES_BUCKETS, registry=r)
        self.kv_seconds = Histogram("kv_transfer_seconds", "Seconds a prefill engine took to hand one request's K/V "
                                    "to a decode engine.", label, buckets=KV_SECONDS_BUCKETS, registry=r)
        self.prompt_total = Counter("prompt_tokens", "Number of prefill tokens processed (computed; the prompt tokens "
                                    "found in the prefix cache are prompt_tokens_cached).", label, registry=r)
        self.prompt_cached = Counter("prompt_tokens_cached", "Prompt tokens found in the prefix cache (not computed).",
                                     label, registry=r)
        self.gen_total = Counter("generation_tokens", "Number of generation tokens processed.", label, registry=r)
        self.failed_perc = Gauge("failed_request_perc", "Failed requests ratio (1 = 100%).", label, registry=r)
        self.cache_usage = Gauge("npu_cache_usage_perc", "KV-cache block usage of the accelerator or CPU pool (1 = 100%).",
                                 label, registry=r)
        self.cpu_cache_usage = Gauge("cpu_cache_usage_perc", "KV-cache usage of the prefix cache's host tier (1 = 100%).", label, registry=r)
        self.prefix_hit = Gauge("npu_prefix_cache_hit_rate", "Prefix-cache hit rate: prompt tokens found cached "
                                "over prompt tokens looked up (1 = 100%).", label, registry=r)
        self.radix_match = Gauge("all_radix_match_num", "Prompt tokens taking part in prefix-cache matching.",
                                 label, registry=r)
        self.radix_hit = Gauge("npu_radix_match_hit_num", "Prompt tokens hit by prefix-cache matching.", label,
                               registry=r)
        self._counted = ((self.prompt_total, "prompt_tokens_total"), (self.gen_total, "generation_tokens_total"),
                         (self.preemptions, "preemptions_total"),
                         (self.prompt_cached, "prefix_hit_tokens_total"))  # counter, the EngineInfo field it sums
        self._sums = {field: 0 for _, field in self._counted}  # what every instance counted, together
        self._samples: list[tuple[float, int, int]] = []  # (time, prompt total, generation total)
        self._succeeded = self._failed = 0
        self.fleet = FleetMetrics(model, r)
        r.register(PerEngine(self))

    def observe(self, event: MetricsEvent) -> None:
        m = self.model
        if isinstance(event, Received):
            self.received.labels(m, event.adapter, event.api).inc()
        elif isinstance(event, Queued):
            for seconds in event.seconds:
                self.queue.labels(m).observe(seconds)
        elif isinstance(event, FirstToken):
            self.ttft.labels(m).observe(event.ttft_s)
        elif isinstance(event, KvTransferred):
            self.kv_bytes.labels(m).observe(event.bytes)
            self.kv_seconds.labels(m).observe(event.seconds)
        elif isinstance(event, Finished):
            self._finished(event)
        elif isinstance(event, Routed):
            self.fleet.routed(event)
        elif isinstance(event, PrefixPulled):
            self.fleet.pulled_prefix(event)
        elif isinstance(event, Refused):
            self.refused.labels(m, event.api, str(event.status)).inc()

    def _finished(self, event: Finished) -> None:
        m, reason = self.model, FinishReason(event.finish_reason)  # as decoded (a str from a caller in process)
        self.finished.labels(m, event.adapter, event.api, reason.value).inc()
        if reason.served:
            self.success.labels(m, event.adapter, event.api).inc()
        elif reason is FinishReason.ERROR:
            self.failed.labels(m, event.adapter, event.api).inc()
        if event.api == PROBE_API:
            return  # (counted above; a probe's latency and outcome are not the clients')
        self._succeeded += reason.served
        self._failed += reason is FinishReason.ERROR
        if reason.served:  # latency and size histograms describe served requests
            self.e2e.labels(m).observe(event.e2e_s)
            self.prompt_tokens.labels(m).observe(event.prompt_tokens)
            self.gen_tokens.labels(m).observe(event.generated_tokens)
        if event.intervals is not None:  # (each token after the first: the time since the one before)
            self.tpot.add((m,), event.intervals.counts, event.intervals.total)
        done = self._succeeded + self._failed
        self.failed_perc.labels(m).set(self._failed / done if done else 0.0)

    def heartbeat(self, info: EngineInfo) -> None:
        """One engine's heartbeat: its counters' growth since its previous one goes into the sums."""
        before = self._last.get(info.instance)
        self._last[info.instance] = info
        self.engines.beat(info.instance, info)
        for counter, field in self._counted:
            self._advance(counter, field, getattr(before, field, 0), getattr(info, field))
        self._rates(self.clock())
        self.fleet.engines(self.live_engines())

    def _advance(self, counter: Counter, field: str, last: int, total: int) -> None:
        """Add what one instance's counter grew by (an instance without an id that restarted restarts at 0)."""
        grown = total - last if total >= last else total
        counter.labels(self.model).inc(grown)
        self._sums[field] += grown

    def _rates(self, now: float) -> None:
        """Token throughput of all engines together over the last RATE_WINDOW_S seconds of heartbeats."""
        prompt, generation = self._sums["prompt_tokens_total"], self._sums["generation_tokens_total"]
        self._samples.append((now, prompt, generation))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.pop(0)
        t0, p0, g0 = self._samples[0]
        if now - t0 > 0:
            self.prompt_rate.labels(self.model).set((prompt - p0) / (now - t0))
            self.gen_rate.labels(self.model).set((generation - g0) / (now - t0))

    def live_engines(self) -> dict[str, EngineInfo]:
        """The engines heard within their lease, by instance."""
        self.engines.expire()
        return self.engines.live()

    def _set_gauges(self) -> None:
        """Running, waiting, cache usage and the prefix cache of the live engines together (0 with none)."""
        m, live = self.model, combined(self.live_engines().values())
        self.running.labels(m).set(live.running if live else 0)
        self.waiting.labels(m).set(live.waiting if live else 0)
        self.cache_usage.labels(m).set(cache_usage(live))
        self.swapped.labels(m).set(0)
        self.cpu_cache_usage.labels(m).set(host_cache_usage(live))
        self.radix_match.labels(m).set(live.prefix_queried_tokens_total if live else 0)
        self.radix_hit.labels(m).set(live.prefix_hit_tokens_total if live else 0)
        self.prefix_hit.labels(m).set(prefix_hit_rate(live))

    def render(self) -> bytes:
        self._set_gauges()
        return generate_latest(self.registry)


class PerEngine:
    """The ``engine_*`` families: one series per live engine, labelled ``engine_instance`` (collected at scrape)."""

    COUNTERS = (("engine_prompt_tokens", "Prefill tokens processed by this engine instance.", "prompt_tokens_total"),
                ("engine_generation_tokens", "Tokens generated by this engine instance.", "generation_tokens_total"),
                ("engine_preemptions", "Preemptions in this engine instance.", "preemptions_total"))
    GAUGES = (("engine_requests_running", "Requests running in this engine instance.", lambda e: e.running),
              ("engine_requests_waiting", "Requests waiting in this engine instance.", lambda e: e.waiting),
              ("engine_cache_usage_perc", "KV-cache block usage of this engine instance (1 = 100%).", cache_usage),
              ("engine_prefix_cache_hit_rate", "Prefix-cache hit rate of this engine instance (1 = 100%).",
               prefix_hit_rate))
    LABELS = ["model_name", "engine_instance"]
    INFO = ("device", "dtype", "quantization", "kv_dtype", "block_size", "total_blocks", "role")  # engine_info's

    def __init__(self, metrics: PrometheusMetrics):
        self.metrics = metrics

    @classmethod
    def info(cls, engines: list[tuple[str, EngineInfo]], model: str) -> GaugeMetricFamily:
        """``engine_info``: 1 per live engine, its configuration in labels (vLLM's ``cache_config_info``): the
        weight format (``quantization``) and KV cache's element type (``kv_dtype``, the dtype's when not set)."""
        family = GaugeMetricFamily("engine_info", "Configuration of this engine instance, in labels (value 1): "
                                   "device, activation dtype, weight format, KV-cache dtype, KV block size in "
                                   "tokens, KV blocks, PD role.", labels=[*cls.LABELS, *cls.INFO])
        for instance, e in engines:
            family.add_metric([model, instance, e.device, e.dtype, e.quantization, e.kv_dtype or e.dtype,
                               str(e.block_size), str(e.total_blocks), e.role], 1)
        return family

    def collect(self):
        engines = sorted(self.metrics.live_engines().items())
        model = self.metrics.model
        yield self.info(engines, model)
        for name, doc, field in self.COUNTERS:
            family = CounterMetricFamily(name, doc, labels=self.LABELS)
            for instance, info in engines:
                family.add_metric([model, instance], getattr(info, field))
            yield family
        for name, doc, value in self.GAUGES:
            family = GaugeMetricFamily(name, doc, labels=self.LABELS)
            for instance, info in engines:
                family.add_metric([model, instance], value(info))
            yield family
