"""Merged and prepacked linears compute what transformers' separate nn.Linear layers compute."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from services.engine.devices import resolve_device
from services.engine.kernels import TorchOps
from services.engine.linears import PackedLinear, can_pack, layer_linears, merge
from services.engine.model_runner import ModelRunner

needs_onednn = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 300])
def test_packed_linear_equals_nn_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear, batch_hint=16)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_packed_linear_keeps_leading_dimensions():
    linear = nn.Linear(8, 4)
    x = torch.randn(2, 3, 8)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear, 4)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_merge_puts_outputs_side_by_side_with_missing_biases_as_zero():
    torch.manual_seed(0)
    parts = [nn.Linear(8, 3, bias=True), nn.Linear(8, 5, bias=False), nn.Linear(8, 2, bias=True)]
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(merge(parts)(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("config", [LlamaConfig(**SIZES), Qwen2Config(**SIZES)], ids=["llama", "qwen2-bias"])
def test_layer_linears_equal_the_layer_they_replace(config, pack):
    torch.manual_seed(0)
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    original = copy.deepcopy(layer)
    lin = layer_linears(layer, pack, batch_hint=4)
    x = torch.randn(6, 32)
    attn = original.self_attn
    with torch.inference_mode():
        q, k, v = lin.qkv(x).split(lin.qkv_sizes, dim=-1)
        torch.testing.assert_close(q, attn.q_proj(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(k, attn.k_proj(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, attn.v_proj(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lin.o(x), attn.o_proj(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lin.down(lin.act_mul(TorchOps(), lin.gate_up(x))), original.mlp(x), rtol=1e-4, atol=1e-5)
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")  # originals freed


def _runner(tmp_path, dtype: str) -> ModelRunner:
    config = LlamaConfig(**SIZES, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return ModelRunner(str(tmp_path), resolve_device("cpu", dtype), 16, 1 << 20, 8)


@needs_onednn
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_packs_on_cpu(tmp_path, dtype):
    if dtype == "bfloat16" and not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN has no bfloat16 kernels for this CPU")
    runner = _runner(tmp_path, dtype)
    assert isinstance(runner.model.lm_head, PackedLinear)
    assert isinstance(runner.linears[0].gate_up, PackedLinear) and isinstance(runner.linears[0].down, PackedLinear)


def test_runner_merges_without_packing_in_float16(tmp_path):
    runner = _runner(tmp_path, "float16")
    assert isinstance(runner.model.lm_head, nn.Linear)
    assert isinstance(runner.linears[0].qkv, nn.Linear) and runner.linears[0].qkv.out_features == 32 + 2 * 16
