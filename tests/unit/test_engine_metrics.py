"""Many engines seen as one (shared/engines.py) and in Prometheus (services/metrics/prometheus.py), on a fake
clock: counters sum what each instance counted and never go down; gauges cover the live engines."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics.prometheus import PrometheusMetrics
from shared.engines import cache_usage, combined, prefix_hit_rate
from shared.messages import EngineInfo, decoder, encode


def engine(instance: str, generated: int = 0, running: int = 0, waiting: int = 0, free_blocks: int = 10,
           stopping: bool = False, queried: int = 0, hit: int = 0) -> EngineInfo:
    return EngineInfo(model="m", loaded=True, device="cpu", dtype="float32", max_batch_size=8, total_blocks=10,
                      free_blocks=free_blocks, running=running, waiting=waiting, free_slots=8 - running,
                      prompt_tokens_total=2 * generated, generation_tokens_total=generated,
                      preemptions_total=generated // 10, instance=instance, stopping=stopping,
                      prefix_queried_tokens_total=queried, prefix_hit_tokens_total=hit)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def scrape(metrics: PrometheusMetrics) -> dict[str, float]:
    """name{engine_instance} -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            instance = s.labels.get("engine_instance")
            out[s.name + (f"{{{instance}}}" if instance else "")] = s.value
    return out


def test_combined_sums_loads_and_capacities():
    both = combined([engine("a", 5, running=2, waiting=1, free_blocks=6), engine("b", 3, running=1, free_blocks=9,
                                                                                 stopping=True)])
    assert (both.running, both.waiting, both.free_blocks, both.total_blocks) == (3, 1, 15, 20)
    assert (both.max_batch_size, both.free_slots, both.generation_tokens_total) == (16, 13, 8)
    assert both.loaded and not both.stopping
    assert cache_usage(both) == 0.25
    assert combined([]) is None and cache_usage(None) == 0.0


def test_counters_sum_each_instance_and_a_smaller_total_is_no_restart():
    metrics = PrometheusMetrics("m", 2.0, Clock())
    for big, small in ((100, 3), (140, 5), (180, 9)):  # interleaved heartbeats of a busy and a quiet engine
        metrics.heartbeat(engine("busy", big))
        metrics.heartbeat(engine("quiet", small))
    m = scrape(metrics)
    assert m["generation_tokens_total"] == 180 + 9
    assert m["prompt_tokens_total"] == 2 * (180 + 9)
    assert m["num_preemptions_total"] == 18 + 0
    assert m["engine_generation_tokens_total{busy}"] == 180 and m["engine_generation_tokens_total{quiet}"] == 9


def test_a_departed_engine_keeps_its_tokens_in_the_sum_and_leaves_the_gauges():
    clock = Clock()
    metrics = PrometheusMetrics("m", 2.0, clock)
    metrics.heartbeat(engine("a", 50, running=2, waiting=1, free_blocks=4))
    metrics.heartbeat(engine("b", 20, running=1, free_blocks=8))
    m = scrape(metrics)
    assert (m["num_requests_running"], m["num_requests_waiting"]) == (3, 1)
    assert m["npu_cache_usage_perc"] == pytest.approx(0.4)
    clock.now = 1.5
    metrics.heartbeat(engine("b", 30, running=1, free_blocks=8))
    clock.now = 2.5  # a's lease has run out
    m = scrape(metrics)
    assert m["generation_tokens_total"] == 50 + 30
    assert (m["num_requests_running"], m["num_requests_waiting"]) == (1, 0)
    assert m["npu_cache_usage_perc"] == pytest.approx(0.2)
    assert "engine_generation_tokens_total{a}" not in m and m["engine_generation_tokens_total{b}"] == 30
    metrics.heartbeat(engine("a", 60))  # back after a silence (the same process): only its growth counts
    assert scrape(metrics)["generation_tokens_total"] == 60 + 30


def test_a_restarted_engine_is_a_new_instance_counting_from_zero():
    metrics = PrometheusMetrics("m", 2.0, Clock())
    metrics.heartbeat(engine("first", 70))
    metrics.heartbeat(engine("second", 4))
    assert scrape(metrics)["generation_tokens_total"] == 74


def test_with_no_engine_the_gauges_read_zero():
    m = scrape(PrometheusMetrics("m", 2.0, Clock()))
    assert m["num_requests_running"] == 0 and m["npu_cache_usage_perc"] == 0
    assert not [name for name in m if name.startswith("engine_")]


# ---- the prefix cache: all_radix_match_num, npu_radix_match_hit_num, npu_prefix_cache_hit_rate ----------


def test_prefix_cache_counters_ride_on_the_heartbeat_and_are_summed():
    info = engine("a", queried=300, hit=96)
    assert decoder(EngineInfo).decode(encode(info)) == info
    old = msgspec.msgpack.encode({f: getattr(info, f) for f in info.__struct_fields__
                                  if not f.startswith("prefix_")})  # an engine from before these fields
    assert decoder(EngineInfo).decode(old).prefix_queried_tokens_total == 0
    both = combined([info, engine("b", queried=100, hit=64)])
    assert (both.prefix_queried_tokens_total, both.prefix_hit_tokens_total) == (400, 160)
    assert prefix_hit_rate(both) == 0.4
    assert prefix_hit_rate(engine("off")) == 0.0 and prefix_hit_rate(None) == 0.0


def test_prefix_cache_gauges_cover_the_live_engines():
    clock = Clock()
    metrics = PrometheusMetrics("m", 2.0, clock)
    m = scrape(metrics)
    assert (m["all_radix_match_num"], m["npu_radix_match_hit_num"], m["npu_prefix_cache_hit_rate"]) == (0, 0, 0)
    metrics.heartbeat(engine("a", queried=300, hit=96))
    metrics.heartbeat(engine("b", queried=100, hit=64))
    m = scrape(metrics)
    assert (m["all_radix_match_num"], m["npu_radix_match_hit_num"]) == (400, 160)
    assert m["npu_prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert m["engine_prefix_cache_hit_rate{a}"] == pytest.approx(0.32)
    assert m["engine_prefix_cache_hit_rate{b}"] == pytest.approx(0.64)
    clock.now = 1.5
    metrics.heartbeat(engine("b", queried=200, hit=96))
    clock.now = 2.5  # a's lease has run out
    m = scrape(metrics)
    assert (m["all_radix_match_num"], m["npu_radix_match_hit_num"]) == (200, 96)
    assert m["npu_prefix_cache_hit_rate"] == pytest.approx(0.48)
    assert "engine_prefix_cache_hit_rate{a}" not in m


def test_prefix_cache_off_reads_zero():
    metrics = PrometheusMetrics("m", 2.0, Clock())
    metrics.heartbeat(engine("a", generated=50))
    m = scrape(metrics)
    assert (m["all_radix_match_num"], m["npu_radix_match_hit_num"], m["npu_prefix_cache_hit_rate"]) == (0, 0, 0)
    text = metrics.render().decode()
    assert 'npu_prefix_cache_hit_rate{model_name="m"} 0.0' in text
    assert "# TYPE all_radix_match_num gauge" in text and "# TYPE npu_radix_match_hit_num gauge" in text


def test_engine_info_names_each_live_engines_weight_and_kv_formats():
    metrics = PrometheusMetrics("m", 2.0, clock := Clock())
    metrics.heartbeat(msgspec.structs.replace(engine("int4"), quantization="int4", kv_dtype="int8", block_size=128))
    metrics.heartbeat(engine("float"))
    infos = {s.labels["engine_instance"]: s for f in text_string_to_metric_families(metrics.render().decode())
             for s in f.samples if s.name == "engine_info"}
    assert infos["int4"].value == 1 and infos["int4"].labels == {
        "model_name": "m", "engine_instance": "int4", "device": "cpu", "dtype": "float32", "quantization": "int4",
        "kv_dtype": "int8", "block_size": "128", "total_blocks": "10", "role": "both"}
    assert (infos["float"].labels["quantization"], infos["float"].labels["kv_dtype"]) == ("none", "float32")
    clock.now = 3.0
    metrics.heartbeat(engine("float"))  # the int4 engine's lease ran out: its series ends
    assert "engine_info{int4}" not in scrape(metrics) and "engine_info{float}" in scrape(metrics)
