"""The paged K/V cache of every layer, in the model's dtype or in 8 bits (``Switchboard.kvCacheDtype``).

Layout: ``[layers, kv_heads, slots, head_dim]`` for K and for V (slot = block * block_size + offset, so one
head's block of positions is contiguous); the last block is the scratch block padding rows write to.

``int8``: each head's vector of one position is stored as ``head_dim`` int8 codes and one float16 scale
(symmetric, ``s = max |x| / 127``, written once when the position's K/V are computed, never rescaled), in
``k_scale`` / ``v_scale`` ``[layers, kv_heads, slots]``. A position then takes ``head_dim + 2`` bytes per
head instead of 2 * head_dim (bfloat16) or 4 * head_dim (float32): the same ``kvCacheMemoryMb`` holds 1.94x
the tokens of a bfloat16 cache for SmolLM2's 64-wide heads (3.9x float32's). The decode attention reads the
codes directly (the C++ kernel, or the PyTorch reference); a prompt chunk's attention dequantizes the
positions it reads.

``fp8_e4m3`` (cuda, compute capability 8.9 or newer): each element as float8 e4m3 with no scale (vLLM's default
for an uncalibrated model: K and V stay well inside e4m3's ±448), 1 byte instead of bfloat16's 2. The Triton
kernels convert as they load and store; a prompt chunk's attention reads it back in the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shared.config import ConfigError

KV_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_DTYPE = torch.float16
FP8 = torch.float8_e4m3fn


def token_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str) -> int:
    """K and V of one position in every layer."""
    if kv_dtype == "int8":
        per_head = head_dim + SCALE_DTYPE.itemsize
    else:
        per_head = head_dim * (FP8.itemsize if kv_dtype == "fp8_e4m3" else dtype.itemsize)
    return 2 * layers * kv_heads * per_head


class LayerKv(NamedTuple):
    """One layer's cache, as the ops' ``rope_store`` / ``paged_decode`` (and their ``_q8`` forms) take it."""

    k: torch.Tensor  # [kv_heads, slots, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [kv_heads, slots] float16 for int8; None otherwise
    v_scale: torch.Tensor | None


class KvCache:
    def __init__(self, layers: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, kv_dtype: str,
                 device: torch.device):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"Switchboard.kvCacheDtype {kv_dtype!r}: one of {', '.join(KV_DTYPES)}")
        check_dtype(kv_dtype, device)
        self.quantized = kv_dtype == "int8"
        shape = (layers, kv_heads, slots, head_dim)
        store = torch.int8 if self.quantized else FP8 if kv_dtype == "fp8_e4m3" else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        scales = (layers, kv_heads, slots) if self.quantized else (0,)
        self.k_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)
        self.layers = [LayerKv(self.k[i], self.v[i], self.k_scale[i] if self.quantized else None,
                               self.v_scale[i] if self.quantized else None) for i in range(layers)]

    @property
    def dtype_name(self) -> str:
        """What a position's K/V are stored as: "int8", or the model's dtype ("float32", "bfloat16", ...)."""
        return str(self.k.dtype).removeprefix("torch.")

    def read(self, index: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [kv_heads, len(slots), head_dim] of layer ``index`` at ``slots``, in ``dtype``."""
        layer = self.layers[index]
        k, v = layer.k.index_select(1, slots), layer.v.index_select(1, slots)
        if not self.quantized:
            return k.to(dtype), v.to(dtype)
        ks, vs = layer.k_scale.index_select(1, slots), layer.v_scale.index_select(1, slots)
        return dequantize(k, ks, dtype), dequantize(v, vs, dtype)

    # ---- whole blocks, as bytes (prefill/decode disaggregation: kv_transfer.py) --------------------------

    def block_bytes(self, block: int, block_size: int) -> bytes:
        """Block ``block`` of every layer: K then V ``[2, layers, kv_heads, block_size, head_dim]``, then (int8)
        their scales ``[2, layers, kv_heads, block_size]``."""
        span = slice(block * block_size, (block + 1) * block_size)
        scales = (self.k_scale[:, :, span], self.v_scale[:, :, span]) if self.quantized else None
        return pack_block(self.k[:, :, span], self.v[:, :, span], scales)

    def write_block(self, block: int, block_size: int, data: bytes) -> None:
        """The inverse of ``block_bytes``, into block ``block``."""
        span = slice(block * block_size, (block + 1) * block_size)
        layers, heads, _, dim = self.k.shape
        codes = 2 * layers * heads * block_size * dim * self.k.element_size()
        values = torch.frombuffer(bytearray(data[:codes]), dtype=self.k.dtype).view(2, layers, heads, block_size, dim)
        self.k[:, :, span], self.v[:, :, span] = values[0].to(self.k.device), values[1].to(self.k.device)
        if self.quantized:
            scales = torch.frombuffer(bytearray(data[codes:]), dtype=SCALE_DTYPE).view(2, layers, heads, block_size)
            self.k_scale[:, :, span], self.v_scale[:, :, span] = scales[0], scales[1]


def check_dtype(kv_dtype: str, device: torch.device) -> None:
    """Refuse a K/V element type the device has no kernels for, naming the key."""
    if kv_dtype == "int8" and device.type != "cpu":
        raise ValueError(f"Switchboard.kvCacheDtype \"int8\" runs on cpu only; the engine's device is {device.type}"
                         f" (on cuda: \"fp8_e4m3\")")
    if kv_dtype == "fp8_e4m3":
        if device.type != "cuda":
            raise ConfigError(f"Switchboard.kvCacheDtype \"fp8_e4m3\" runs on cuda only; the engine's device is "
                             f"{device.type} (on cpu: \"int8\")")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("Switchboard.kvCacheDtype \"fp8_e4m3\" needs a GPU of compute capability 8.9 or newer")


def pack_block(k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> bytes:
    """One block's K and V (and, int8, their scales) as ``KvCache.block_bytes`` lays them out."""
    data = _raw(torch.stack([k, v]))
    return data + _raw(torch.stack(scales)) if scales is not None else data


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes in its own dtype (as bytes: numpy has no bfloat16)."""
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float → int8 codes and float16 scales [...] (the PyTorch reference of the C++ write)."""
    scale = (x.float().abs().amax(dim=-1) / 127).to(SCALE_DTYPE)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = torch.round(x.float() / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()[..., None]).to(dtype)
