"""The GPU's quantized layers (``quant_cuda.py``) checked on a CPU, where the same classes run PyTorch's CPU
int4 kernel and its reference fp8 GEMM: each layer is the product with its dequantized weight, the Q4 blocks
keep their values in the int4 kernel's layout, and the formats are refused where they do not run. The
engine on cuda with them (greedy tokens against the dequantized model) is in ``test_cuda_engine.py``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import linears
from services.engine.linears import check_format
from services.engine.quant import Q4Linear
from services.engine.kernels import FP8_MAX, TorchOps
from services.engine.quant_cuda import FP8_GEMV_ROWS, Fp8Linear, Int4Linear, quantize


def weight(n: int = 80, k: int = 192, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, k) * 0.05


@pytest.mark.parametrize("k", [64, 192, 512])  # the int4 kernel's inner tiles: 4, 2 (192 = 6 × 32), 8
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int4_is_the_product_with_the_q4_blocks_weights(k, rows):
    w, bias = weight(k=k), torch.randn(80)
    blocks = Q4Linear.from_float(w, bias)
    layer = Int4Linear.from_q4(blocks, torch.device("cpu"))
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    want = x.float() @ blocks.dequantized().T + bias
    got = layer(x).float()
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    # the kernel's scales and zeros are bfloat16 (the blocks' are float16) and it sums in bfloat16 tiles
    assert torch.allclose(got, want, atol=0.03, rtol=0.02), (got - want).abs().max()
    step = blocks.dequantized().abs().max() / 15  # about one code
    assert (layer.dequantized() - blocks.dequantized()).abs().max() < 0.02 * step + 1e-3


def test_int4_keeps_the_input_dtype_and_leading_dimensions():
    layer = Int4Linear.from_float(weight(k=64))
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 80)
    assert torch.allclose(out, layer(x.reshape(6, 64)).reshape(2, 3, 80))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, FP8_GEMV_ROWS + 24])
def test_fp8_is_the_product_of_rows_and_weights_in_e4m3(dtype, rows):
    """Up to FP8_GEMV_ROWS rows (decode: fp8_gemv) and more (prompts: _scaled_mm), the same product (at 96
    columns a decode row's one group of 128 columns has the row's scale)."""
    w, bias = weight(n=48, k=96), torch.randn(48)
    layer = Fp8Linear.from_float(w, bias)
    x = (torch.randn(rows, 96) * torch.logspace(-2, 1, rows)[:, None]).to(dtype)  # rows of very different sizes
    q, scale = TorchOps.fp8_rows(x.reshape(rows, 96))
    want = (q.float() * scale) @ layer.dequantized().T + bias
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 48)
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=1e-2), (got.float() - want).abs().max()
    # e4m3 keeps ~3 significant bits: within 1/16 of each weight's size, and each row's largest entry exact
    rel = (layer.dequantized() - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert rel.max() <= 1 / 16
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((rows,), FP8_MAX))


def test_fp8_decode_rows_take_a_scale_per_128_columns():
    """``fp8_gemv`` (a decode step's product) quantizes each 128 columns of a row over their own scale: columns
    100,000 times smaller than the row's first 128 keep e4m3's precision, where one scale per row (the
    prompts' ``fp8_rows``) rounds them to a few codes or zero."""
    layer = Fp8Linear.from_float(weight(n=48, k=384))
    torch.manual_seed(1)
    small = torch.randn(3, 384)
    small[:, :128] = 0
    big = torch.zeros(3, 384)
    big[:, :128] = torch.randn(3, 128) * 1e5
    got = layer.gemv(small + big, torch.float32) - layer.gemv(big, torch.float32)  # the small columns' share
    want = small @ layer.dequantized().T
    assert (got - want).norm() < 0.05 * want.norm()
    q, scale = TorchOps.fp8_rows(small + big)
    per_row = ((q.float() * scale)[:, 128:]) @ layer.dequantized()[:, 128:].T
    assert (per_row - want).norm() > 0.3 * want.norm()


def test_a_zero_row_stays_zero_in_fp8():
    layer = Fp8Linear.from_float(weight(n=16, k=32))
    out = layer(torch.zeros(2, 32))
    assert torch.equal(out, torch.zeros(2, 16))


def test_shapes_the_kernels_do_not_take_stay_float():
    odd = torch.nn.Linear(64, 24)  # 24 rows: not sixteens (fp8, and the CPU's int4 kernel)
    assert quantize(odd, "int4") is odd and quantize(odd, "fp8") is odd
    narrow = torch.nn.Linear(40, 16)  # 40 columns: not whole blocks of 32 nor sixteens
    assert quantize(narrow, "int4") is narrow and quantize(narrow, "fp8") is narrow


@pytest.mark.parametrize("fmt,cls", [("int4", Int4Linear), ("fp8", Fp8Linear)])
def test_a_models_layers_in_the_gpu_formats_keep_its_products(tiny_model_dir, fmt, cls):
    """``linears.build`` as on a GPU: every merged projection in the format, the lm_head in the model's dtype;
    each projection's product equals the float model's within the format's error."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    qkv_float = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().clone()
    layers = linears.build(model, torch.device("cpu"), torch.float32, 16, fmt, gpu_formats=True)
    assert all(isinstance(getattr(layer, name), cls) for layer in layers for name in ("qkv", "o", "gate_up", "down"))
    assert type(model.lm_head) is torch.nn.Linear
    x = torch.randn(4, qkv_float.shape[1])
    want = x @ qkv_float.T
    got = layers[0].qkv(x)
    assert (got - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_checkpoints_layers_go_to_the_int4_kernels_layout_as_stored(tiny_model_dir, tmp_path, method):
    """An AWQ or GPTQ folder on a GPU: its packed projections become the int4 kernel's layers holding the
    checkpoint's numbers (the lm_head keeps the model's dtype); the rest of the model follows to the device."""
    from services.engine.model_loading import load_model, prequantized_config
    from tests.unit.test_prequantized import write_checkpoint

    expected = write_checkpoint(tiny_model_dir, tmp_path / "model", method)
    folder = str(tmp_path / "model")
    model, _, source = load_model(folder, torch.device("cpu"), torch.float32, prequantized_config(folder))
    layers = linears.build(model, torch.device("cpu"), torch.float32, 16, method, source=source, gpu_formats=True)
    assert type(model.lm_head) is torch.nn.Linear and not any(p.is_meta for p in model.parameters())
    for index, layer in enumerate(layers):
        for name, keys in (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",))):
            module = getattr(layer, name)
            assert isinstance(module, Int4Linear)
            want = torch.cat([expected[index, key] for key in keys])
            x = torch.randn(3, want.shape[1], dtype=torch.bfloat16)
            ref = x.float() @ want.T
            assert (module(x).float() - ref).abs().max() < 0.01 * ref.abs().max() + 1e-3


def test_the_formats_are_refused_where_they_have_no_kernel():
    with pytest.raises(ValueError, match="'fp8' runs on cuda only"):
        check_format("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="'int8' runs on cpu only; on cuda: int4 or fp8"):
        check_format("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="'gguf' runs on cpu only"):
        check_format("gguf", torch.device("cuda"))
    with pytest.raises(ValueError, match="'int4' runs on cpu and cuda; the engine's device is xpu"):
        check_format("int4", torch.device("xpu"))  # torch_npu names its devices npu; this torch has none
    with pytest.raises(ValueError, match="folder's AWQ checkpoint runs on cpu and cuda; the engine's device is xpu"):
        check_format("awq", torch.device("xpu"))
    for fmt in ("none", "int8", "int4", "gguf", "awq", "gptq"):
        check_format(fmt, torch.device("cpu"))
