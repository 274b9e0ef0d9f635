"""Many engines seen as one: the sums behind status, slot counts, metrics and the stop drain."""

from __future__ import annotations

from typing import Iterable

from shared.messages import EngineInfo

SUMMED = ("max_batch_size", "total_blocks", "free_blocks", "running", "waiting", "free_slots",
          "prompt_tokens_total", "generation_tokens_total", "preemptions_total", "prefix_queried_tokens_total",
          "prefix_hit_tokens_total", "host_total_blocks", "host_used_blocks")


def combined(engines: Iterable[EngineInfo]) -> EngineInfo | None:
    """One EngineInfo for several engines: capacities, loads and counters summed; loaded when any is, stopping
    when all are; model, device and dtype of the first (one model per deployment). None for no engine."""
    engines = list(engines)
    if not engines:
        return None
    first = engines[0]
    return EngineInfo(
        model=first.model, device=first.device, dtype=first.dtype, quantization=first.quantization, kv_dtype=first.kv_dtype,
        loaded=any(e.loaded for e in engines), stopping=all(e.stopping for e in engines),
        **{name: sum(getattr(e, name) for e in engines) for name in SUMMED},
    )


def adapter_names(engine: EngineInfo) -> set[str]:
    """The LoRA adapters the engine has loaded and takes requests for (not those still unloading)."""
    return {a.name for a in engine.adapters}


def prefix_hit_rate(engine: EngineInfo | None) -> float:
    """Share of the prompt tokens looked up in the prefix cache that were found there; 0 when none was."""
    if engine is None or not engine.prefix_queried_tokens_total:
        return 0.0
    return engine.prefix_hit_tokens_total / engine.prefix_queried_tokens_total


def host_cache_usage(engine: EngineInfo | None) -> float:
    """Share of the host tier's blocks in use (1 = 100%); 0 with no engine or no host tier."""
    if engine is None or not engine.host_total_blocks:
        return 0.0
    return engine.host_used_blocks / engine.host_total_blocks


def cache_usage(engine: EngineInfo | None) -> float:
    """Share of KV blocks in use (1 = 100%); 0 with no engine or no blocks."""
    if engine is None or not engine.total_blocks:
        return 0.0
    return 1.0 - engine.free_blocks / engine.total_blocks
