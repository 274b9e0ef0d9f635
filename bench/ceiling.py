"""What the machine allows: memory read bandwidth, matmul peak per dtype, and the decode tokens/s they
bound for the benchmark's model (c1: weights read once per token; cN: N rows per read, capped by FLOPs)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

from engine_bench import MODEL  # bench/engine_bench.py

@dataclass
class Ceiling:
    bandwidth: float  # bytes read per second
    peak: dict[str, float]  # FLOP/s per dtype
    params: int  # parameters read per decode step (the tied lm_head once; not the embedding lookup)

    def weight_bytes(self, dtype: str) -> int:
        return self.params * (4 if dtype == "float32" else 2)

    def c1(self, dtype: str) -> float:
        return self.bandwidth / self.weight_bytes(dtype)

    def cn(self, dtype: str, n: int) -> float:
        return min(n * self.c1(dtype), self.peak[dtype] / (2 * self.params))


def best(fn: Callable[[], object], n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(dtype: str, n: int = 5) -> float:
    """FLOP/s of a 2048² matmul in ``dtype`` (best of ``n``), torch on 2 threads in this process."""
    import torch

    torch.set_num_threads(2)
    with torch.inference_mode():
        a, b = (torch.randn(2048, 2048).to(getattr(torch, dtype)) for _ in range(2))
        return 2 * 2048**3 / best(lambda: torch.mm(a, b), n)


def measure_ceiling(dtypes: list[str]) -> Ceiling:
    import torch

    torch.set_num_threads(2)
    with torch.inference_mode():
        x = torch.ones(2**28)  # 1 GiB of float32
        bandwidth = x.numel() * 4 / best(x.sum, 10)
        del x
    peak = {dtype: matmul_peak(dtype) for dtype in dtypes}
    c = json.loads((MODEL / "config.json").read_text())
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or h // heads
    layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * c["intermediate_size"] + 2 * h
    lm_head = c["vocab_size"] * h  # tied or not, read once per step; the embedding lookup reads a few rows
    return Ceiling(bandwidth, peak, c["num_hidden_layers"] * layer + h + lm_head)


def print_ceiling(when: str, ceiling: Ceiling) -> None:
    print(f"[ceiling, {when}] memory read {ceiling.bandwidth / 1e9:.1f} GB/s, matmul "
          + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in ceiling.peak.items()), flush=True)
