"""Quantized linear layers (services/engine/quant.py, csrc/quant_ops.cpp): each equals the product with its own
dequantized weight (of the activations as the int8 kernel quantizes them, where it does: W8A8 on AVX-512 VNNI),
int4's layout is GGUF's Q4_1 (the gguf package's reference dequantizes it to the same numbers), and an engine
serving quantized weights gives the tokens of the same model with those weights dequantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from services.engine import kernels
from services.engine.model_runner import ModelRunner
from services.engine.quant import BLOCK, Q4Linear, Q8Linear, pack_q4, quantize, unpack_q4
from tests.unit.engine_helpers import BLOCK as KV_BLOCK
from tests.unit.engine_helpers import CPU, batch_greedy, block_bytes

OPS = kernels.for_device(torch.device("cpu"))
KERNELS = OPS if hasattr(OPS, "q8_linear") else None


def weight(n: int = 72, k: int = 96, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, k) * 0.05


def operands(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and the dequantized weight as the layer's kernel multiplies them: on VNNI the int8 kernel's activations
    quantized per block of 32 (W8A8, for a width of whole pairs of blocks) or per row to int16 (W8A16, the
    lm_head); rounded to bfloat16 by the int4 kernel on AVX-512 BF16; as they are otherwise."""
    if isinstance(layer, Q8Linear) and KERNELS is not None and (x.shape[-1] % 64 == 0 or not layer.int8_activations):
        return KERNELS.q8_activations(x.float(), layer.int8_activations), layer.dequantized()
    if isinstance(layer, Q4Linear) and layer.kernels is not None:
        return tuple(KERNELS.q4_operands(x, *layer.canonical()))
    return x.float(), layer.dequantized()


@pytest.mark.parametrize("cls", [Q8Linear, Q4Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 40])
@pytest.mark.parametrize("k", [96, 128])
def test_a_quantized_linear_is_the_product_with_its_dequantized_weight(cls, dtype, rows, k):
    w, bias = weight(k=k), torch.randn(72)
    layer = cls.from_float(w, bias, KERNELS)
    x = torch.randn(2, rows, k).to(dtype)
    got = layer(x).float()
    a, deq = operands(layer, x)
    want = (a @ deq.T + bias).to(dtype).float()
    assert got.shape == (2, rows, 72)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (got - want).abs().max()


@pytest.mark.parametrize("cls", [Q8Linear, Q4Linear])
def test_the_kernels_and_pytorch_dequantize_alike_and_within_the_formats_error(cls):
    w = weight()
    with_kernels, plain = cls.from_float(w, kernels=KERNELS), cls.from_float(w)
    deq = plain.dequantized()
    assert torch.equal(with_kernels.dequantized(), deq)
    assert torch.equal(plain(torch.eye(96)), deq.T)  # the PyTorch path runs the same weights
    blocks = w.reshape(72, -1, BLOCK)
    if cls is Q8Linear:  # one scale per row
        spread = (w.abs().amax(1) / 127)[:, None].expand(72, blocks.shape[1])
    else:
        spread = (blocks.amax(-1) - blocks.amin(-1)) / 15
    error = (deq - w).abs().reshape(72, -1, BLOCK).amax(-1)
    assert torch.all(error <= spread * 0.5 * 1.01 + 1e-6)
    rows = 80 if getattr(with_kernels, "packed", False) else 72  # the kernel's layout: groups of 16 rows
    assert with_kernels.nbytes < rows * 96 * (1.1 if cls is Q8Linear else 0.65)


@pytest.mark.skipif(KERNELS is None, reason="needs the C++ kernels")
@pytest.mark.parametrize("rows", [1, 5])
def test_the_int4_kernel_on_ggufs_layout_is_the_product_with_the_dequantized_weight(rows):
    """The kernel CPUs without AVX-512 BF16 run (GGUF's layout, float activations), whatever this CPU has."""
    layer = Q4Linear.from_float(weight(), kernels=KERNELS)
    x = torch.randn(rows, 96)
    got = KERNELS.q4_linear(x, *layer.canonical())
    assert torch.allclose(got, x @ layer.dequantized().T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [72, 50, 16])
def test_int4_in_the_kernels_layout_unpacks_to_the_same_weights(n):
    """``pack_q4`` (16 rows interleaved, the last group padded) and ``unpack_q4`` are inverses, whatever the
    row count; the packed layer holds no more than the padding beyond GGUF's bytes."""
    plain = Q4Linear.from_float(weight(n=n))
    packed = pack_q4(*plain.canonical())
    assert packed[0].shape == (-(-n // 16) * 16, 48) and packed[1].shape == packed[2].shape == (-(-n // 16), 3, 16)
    for mine, theirs in zip(unpack_q4(*packed, n), plain.canonical()):
        assert torch.equal(mine, theirs)


def test_int4_is_gguf_q4_1():
    """The gguf package's Q4_1 blocks (d, m, codes), split into our tensors, dequantize to its own numbers."""
    w = weight().numpy()
    raw = quants.quantize(w, GGMLQuantizationType.Q4_1)  # [72, blocks * 20 bytes]
    blocks = raw.reshape(72, -1, 20)
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0])
    m = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0])
    layer = Q4Linear(torch.from_numpy(np.ascontiguousarray(blocks[..., 4:]).reshape(72, 48)), d, m, kernels=KERNELS)
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1).astype(np.float32))
    assert torch.equal(layer.dequantized(), reference)


@pytest.mark.skipif(KERNELS is None or not KERNELS.int8_activations, reason="W8A8 needs AVX-512 VNNI")
def test_int8_activations_are_quantized_per_block_of_32():
    x = torch.randn(3, 128) * torch.tensor([0.01] * 32 + [10.0] * 32 + [1.0] * 64)  # blocks of very different range
    got = KERNELS.q8_activations(x, True)
    blocks = x.reshape(3, 4, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(got.reshape(3, 4, 32), torch.round(blocks / scale) * scale, rtol=0, atol=1e-6)


@pytest.mark.skipif(KERNELS is None or not KERNELS.int8_activations, reason="W8A16 in int16 needs AVX-512 VNNI")
def test_the_lm_head_takes_its_activations_in_int16_per_row():
    """Int16 with one scale a row: a row's small values keep ~4 digits next to a large one (int8 per block kept 2)."""
    x = torch.randn(3, 128) * torch.tensor([0.01] * 32 + [10.0] * 32 + [1.0] * 64)
    got = KERNELS.q8_activations(x, False)
    scale = x.abs().amax(-1, keepdim=True) / 32767
    assert torch.allclose(got, torch.round(x / scale) * scale, rtol=0, atol=1e-6)
    assert (got - x).abs().max() <= scale.max() / 2 + 1e-7
    head = Q8Linear.from_float(weight(n=40, k=128), kernels=KERNELS, int8_activations=False)
    want = x @ head.dequantized().T
    assert torch.allclose(head(x), want, rtol=0, atol=2e-3), (head(x) - want).abs().max()


def test_a_width_that_is_no_whole_number_of_blocks_stays_float():
    linear = torch.nn.Linear(40, 8)
    assert quantize(linear, "int8") is linear and quantize(linear, "none") is linear


@pytest.fixture(scope="module")
def budget(tiny_model_dir):
    return 64 * block_bytes(tiny_model_dir)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_an_engine_on_quantized_weights_gives_the_dequantized_models_tokens(tiny_model_dir, budget, fmt):
    """The reference: the same runner whose quantized layers run their dequantized weights as float products."""
    quantized = ModelRunner(str(tiny_model_dir), CPU, block_size=KV_BLOCK, kv_budget_bytes=budget, max_blocks=10_000,
                            quantization=fmt)
    reference = ModelRunner(str(tiny_model_dir), CPU, block_size=KV_BLOCK, kv_budget_bytes=budget, max_blocks=10_000,
                            quantization=fmt)
    for mine, theirs in zip(quantized.linears, reference.linears):
        for name in ("qkv", "o", "gate_up", "down"):
            q = getattr(mine, name)
            setattr(theirs, name, Dequantized(q))
    reference.model.lm_head = Dequantized(quantized.model.lm_head)
    assert isinstance(quantized.linears[0].qkv, Q8Linear if fmt == "int8" else Q4Linear)
    assert isinstance(quantized.model.lm_head, Q8Linear) and not quantized.model.lm_head.int8_activations
    assert batch_greedy(quantized, new_tokens=12) == batch_greedy(reference, new_tokens=12)


class Dequantized(torch.nn.Module):
    """A quantized layer's float reference: its dequantized weight times the activations it multiplies."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, weight = operands(self.layer, x)
        return (a @ weight.T).to(x.dtype)


def test_quantization_is_refused_off_the_cpu(tiny_model_dir, budget):
    from services.engine.devices import Device

    with pytest.raises(ValueError, match="runs on cpu only"):
        ModelRunner(str(tiny_model_dir), Device("cuda", torch.bfloat16), block_size=KV_BLOCK,
                    kv_budget_bytes=budget, max_blocks=10_000, quantization="int8")
