"""Device selection: cpu, cuda, or Ascend npu (torch_npu imported only when configured)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from shared.config import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Device:
    kind: str  # cpu | cuda | npu
    dtype: torch.dtype

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_device(kind: str, dtype: str) -> Device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "npu":
        importlib.import_module("torch_npu")  # registers the npu device with torch
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("Switchboard.device is 'cuda' but torch sees no CUDA device")
    if dtype == "auto":
        dtype = "bfloat16" if kind != "cpu" or cpu_has_native_bf16() else "float32"
    return Device(kind, DTYPES[dtype])


def cpu_has_native_bf16(flags: str | None = None) -> bool:
    """bfloat16 arithmetic in hardware (AVX-512 BF16 or AMX): there bfloat16 halves the bytes each step
    reads at full speed; elsewhere it is emulated and float32 is the faster choice."""
    if flags is None:
        from services.engine.kernels import cpu_flags

        flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def kv_budget_bytes(device: Device, cpu_budget_mb: int, npu_mem_size_gb: int) -> int:
    """cpu: the configured MiB; accelerators: npuMemSize GB, or 80% of free memory when -1."""
    if device.kind == "cpu":
        return cpu_budget_mb * 1024 * 1024
    if npu_mem_size_gb > 0:
        return npu_mem_size_gb * 1024**3
    module = torch.cuda if device.kind == "cuda" else getattr(torch, "npu")
    module.empty_cache()  # what the load freed (float weights replaced by quantized ones) counts as free
    free, _total = module.mem_get_info()
    return int(free * 0.8)
