"""The request counters carry the LoRA adapter a request ran with ("" for the base model) and the API it came by."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.metrics.prometheus import PrometheusMetrics
from shared.metrics_messages import Finished, Received


def counts(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value, for the request counters."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith("request_") and s.name.endswith("_total"):
                out[s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))] = s.value
    return out


def finished(request_id: str, reason: str, adapter: str = "", api: str = "tgi") -> Finished:
    return Finished(id=request_id, model="m", arrival=0.0, e2e_s=1.0, ttft_s=0.1, prompt_tokens=3,
                    generated_tokens=2, finish_reason=reason, adapter=adapter, api=api)


def test_request_counters_are_labelled_by_adapter():
    metrics = PrometheusMetrics("m")
    for i, adapter in enumerate(["", "lora1", "lora1"]):
        metrics.observe(Received(id=str(i), model="m", adapter=adapter, api="tgi"))
    metrics.observe(finished("0", "length"))
    metrics.observe(finished("1", "eos_token", "lora1"))
    metrics.observe(finished("2", "error", "lora1"))
    m = counts(metrics)
    assert m["request_received_total", (("adapter", ""), ("api", "tgi"))] == 1
    assert m["request_received_total", (("adapter", "lora1"), ("api", "tgi"))] == 2
    assert m["request_success_total", (("adapter", ""), ("api", "tgi"))] == 1
    assert m["request_success_total", (("adapter", "lora1"), ("api", "tgi"))] == 1
    assert m["request_failed_total", (("adapter", "lora1"), ("api", "tgi"))] == 1
    assert ("request_failed_total", (("adapter", ""), ("api", "tgi"))) not in m
    assert m["request_finished_total", (("adapter", "lora1"), ("api", "tgi"), ("finished_reason", "error"))] == 1
    assert m["request_finished_total", (("adapter", ""), ("api", "tgi"), ("finished_reason", "length"))] == 1


def test_request_counters_are_labelled_by_api():
    metrics = PrometheusMetrics("m")
    for i, api in enumerate(["anthropic", "openai-responses", "anthropic"]):
        metrics.observe(Received(id=str(i), model="m", api=api))
        metrics.observe(finished(str(i), "length", api=api))
    m = counts(metrics)
    assert m["request_received_total", (("adapter", ""), ("api", "anthropic"))] == 2
    assert m["request_success_total", (("adapter", ""), ("api", "openai-responses"))] == 1


def test_health_probes_are_counted_but_not_in_latencies_or_averages():
    """/health/timed's one-token probe (api "health", every few seconds) is counted by the request counters, but
    the latency and size histograms, failed_request_perc and /metrics-json's averages describe clients' requests
    (probes were most of them on a quiet server)."""
    from services.metrics.aggregator import Aggregator
    from shared.metrics_messages import PROBE_API

    metrics, averages = PrometheusMetrics("m"), Aggregator()
    for event in (Received(id="p", model="m", api=PROBE_API), finished("p", "length", api=PROBE_API),
                  Received(id="q", model="m", api=PROBE_API), finished("q", "error", api=PROBE_API)):
        metrics.observe(event)
        averages.add(event)
    m = counts(metrics)
    assert m["request_received_total", (("adapter", ""), ("api", "health"))] == 2
    assert m["request_failed_total", (("adapter", ""), ("api", "health"))] == 1
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples.get("e2e_request_latency_seconds_count", 0) == 0 and samples.get("failed_request_perc", 0) == 0
    assert averages.snapshot().ttft_avg_ms == 0
    metrics.observe(finished("c", "length"))
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples["e2e_request_latency_seconds_count"] == 1 and samples["failed_request_perc"] == 0


def test_time_per_output_token_counts_each_interval_between_tokens():
    """One observation per token after the first (vLLM's inter-token latency), not one per request: a request's
    intervals come counted in the buckets already; tokens that came together share their interval."""
    from shared.metrics_messages import Intervals

    intervals = Intervals()
    intervals.add(0.02, 1)  # 0.02 s: le 0.025
    intervals.add(0.3, 3)  # three tokens in 0.3 s: 0.1 s each, le 0.1
    intervals.add(4.0, 1)  # above every bound: +Inf only
    metrics = PrometheusMetrics("m")
    metrics.observe(Received(id="0", model="m"))
    metrics.observe(Finished(id="0", model="m", arrival=0.0, e2e_s=5.0, ttft_s=0.5, prompt_tokens=3,
                             generated_tokens=6, finish_reason="length", intervals=intervals))
    metrics.observe(finished("1", "length"))  # no intervals (one token): nothing observed
    [family] = [f for f in text_string_to_metric_families(metrics.render().decode())
                if f.name == "time_per_output_token_seconds"]
    assert family.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert got["time_per_output_token_seconds_count", None] == 5
    assert abs(got["time_per_output_token_seconds_sum", None] - 4.32) < 1e-9
    assert got["time_per_output_token_seconds_bucket", "0.01"] == 0
    assert got["time_per_output_token_seconds_bucket", "0.025"] == 1
    assert got["time_per_output_token_seconds_bucket", "0.075"] == 1
    assert got["time_per_output_token_seconds_bucket", "0.1"] == 4
    assert got["time_per_output_token_seconds_bucket", "2.5"] == 4
    assert got["time_per_output_token_seconds_bucket", "+Inf"] == 5
