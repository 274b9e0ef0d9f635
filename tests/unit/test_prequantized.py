"""AWQ and GPTQ 4-bit checkpoints (services/engine/prequantized.py): folders written here from the tiny random Llama
with each format's own packing (AWQ's GEMM column order, GPTQ's row packing and its zeros stored minus one) load
into the engine's int4 layers holding the checkpoint's numbers, and the engine gives the greedy tokens of the
float model holding them; formats it does not read are refused at start, named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine import kernels
from services.engine.model_runner import ModelRunner
from services.engine.prequantized import AWQ_ORDER
from services.engine.quant import Q4Linear, Q8Linear
from shared.model_folder import ModelFolderError, check
from tests.unit.engine_helpers import BLOCK, CPU, batch_greedy, block_bytes, float_linear

OPS = kernels.for_device(torch.device("cpu"))
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
GROUP = 32


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float → codes [K, N], zeros [K / group, N], float16 scales [K / group, N] (asymmetric, as AWQ
    and GPTQ store them: input rows first)."""
    n, k = w.shape
    g = w.T.reshape(k // group, group, n)
    low, high = g.amin(dim=1), g.amax(dim=1)
    scales = ((high - low) / 15).clamp(min=1e-6).to(torch.float16)
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    codes = (torch.round(g / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15)
    return codes.reshape(k, n).to(torch.int64), zeros.to(torch.int64), scales


def pack_columns(values: torch.Tensor, order) -> torch.Tensor:
    """[R, C] nibbles → int32 [R, C / 8], nibble i holding column 8c + order[i]."""
    r, c = values.shape
    grouped = values.reshape(r, c // 8, 8)[..., list(order)]
    packed = sum(grouped[..., i].numpy().astype(np.uint32) << np.uint32(4 * i) for i in range(8))
    return torch.from_numpy(np.ascontiguousarray(packed.astype(np.uint32)).view(np.int32))


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] nibbles → int32 [R / 8, C], nibble i holding row 8r + i."""
    r, c = values.shape
    grouped = values.reshape(r // 8, 8, c)
    packed = sum(grouped[:, i].numpy().astype(np.uint32) << np.uint32(4 * i) for i in range(8))
    return torch.from_numpy(np.ascontiguousarray(packed.astype(np.uint32)).view(np.int32))


def write_checkpoint(model_dir, folder, method: str) -> dict[tuple[int, str], torch.Tensor]:
    """The tiny model's folder as an AWQ or GPTQ checkpoint; returns each projection's numbers [N, K]."""
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    out, expected = {}, {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        key = next((k for k, module in PROJECTIONS.items() if prefix.endswith(module)), None)
        if key is None:
            out[name] = tensor.to(torch.float16)
            continue
        layer = int(prefix.split(".")[2])
        codes, zeros, scales = quantize_groups(tensor.float(), GROUP)
        expected[layer, key] = ((codes - zeros.repeat_interleave(GROUP, 0)) * scales.float().repeat_interleave(GROUP, 0)).T
        if method == "awq":
            out[f"{prefix}.qweight"] = pack_columns(codes, AWQ_ORDER)
            out[f"{prefix}.qzeros"] = pack_columns(zeros, AWQ_ORDER)
        else:
            out[f"{prefix}.qweight"] = pack_rows(codes)
            out[f"{prefix}.qzeros"] = pack_columns(zeros - 1, range(8))  # GPTQ's original format: zero minus one
            out[f"{prefix}.g_idx"] = torch.arange(codes.shape[0], dtype=torch.int32) // GROUP
        out[f"{prefix}.scales"] = scales
    (folder / "model.safetensors").unlink()
    save_file(out, str(folder / "model.safetensors"))
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"} if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"})
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def runner(folder, quantization: str = "none") -> ModelRunner:
    return ModelRunner(str(folder), CPU, block_size=BLOCK, kv_budget_bytes=64 * block_bytes(folder), max_blocks=10_000,
                       quantization=quantization)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_layers_hold_the_checkpoints_numbers(tiny_model_dir, tmp_path, method):
    expected = write_checkpoint(tiny_model_dir, tmp_path / "model", method)
    loaded = runner(tmp_path / "model")
    assert loaded.quantization == method
    for layer, lin in enumerate(loaded.linears):
        for name, keys in (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",))):
            module = getattr(lin, name)
            assert isinstance(module, Q4Linear)
            want = torch.cat([expected[layer, key] for key in keys])
            step = want.abs().max() / 7  # the offsets are float16: within 1/256 of a step
            assert torch.allclose(module.dequantized(), want, atol=float(step) / 256, rtol=0)
    assert not any(p.is_meta for p in loaded.model.parameters())


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_engine_gives_the_float_models_tokens(tiny_model_dir, tmp_path, method):
    """The reference: the float32 model holding the checkpoint's numbers (and the same int8 lm_head)."""
    expected = write_checkpoint(tiny_model_dir, tmp_path / "model", method)
    packed = runner(tmp_path / "model")
    reference = runner(tiny_model_dir, "int8")  # only for its int8 lm_head, replaced by the packed runner's
    for layer, lin in enumerate(reference.linears):
        lin.qkv = float_linear(torch.cat([expected[layer, k] for k in ("q", "k", "v")]))
        lin.o, lin.down = float_linear(expected[layer, "o"]), float_linear(expected[layer, "down"])
        lin.gate_up = float_linear(torch.cat([expected[layer, k] for k in ("gate", "up")]))
    reference.model.lm_head = packed.model.lm_head
    reference.model.model.embed_tokens.weight.data = packed.model.model.embed_tokens.weight.data  # float16-stored
    for mine, theirs in zip(packed.model.model.layers, reference.model.model.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(theirs, norm).weight.data = getattr(mine, norm).weight.data
    reference.model.model.norm.weight.data = packed.model.model.norm.weight.data
    assert batch_greedy(packed, new_tokens=10) == batch_greedy(reference, new_tokens=10)



def test_act_order_groups_across_blocks_load_as_int8(tiny_model_dir, tmp_path):
    """A desc_act GPTQ checkpoint whose groups are not whole blocks of 32 columns: int8, of the same numbers."""
    from services.engine.prequantized import PrequantizedLinears, unpack_rows

    folder = tmp_path / "model"
    write_checkpoint(tiny_model_dir, folder, "gptq")
    state = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.self_attn.o_proj"
    g_idx = torch.arange(64, dtype=torch.int32) % 2  # row i in group i % 2
    state[f"{prefix}.g_idx"] = g_idx
    save_file(state, str(folder / "model.safetensors"))
    source = PrequantizedLinears(folder, {"quant_method": "gptq", "group_size": GROUP}, OPS)
    layer = source.part(prefix, (64, 64))
    assert isinstance(layer, Q8Linear)
    codes = unpack_rows(state[f"{prefix}.qweight"]).float()
    zeros = (((state[f"{prefix}.qzeros"][..., None] >> torch.arange(0, 32, 4)) & 0xF).reshape(2, 64) + 1).float()
    scales = state[f"{prefix}.scales"].float()
    want = ((codes - zeros[g_idx.long()]) * scales[g_idx.long()]).T
    assert torch.allclose(layer.dequantized(), want, atol=float(want.abs().max()) / 127)


def test_an_int8_setting_on_a_quantized_folder_is_refused(tiny_model_dir, tmp_path):
    write_checkpoint(tiny_model_dir, tmp_path / "model", "awq")
    with pytest.raises(ValueError, match="already AWQ"):
        runner(tmp_path / "model", "int8")


@pytest.mark.parametrize("change, named", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"bits": 8}, "quantization_config.bits is 8"),
    ({"group_size": 16}, "group_size 16"),
    ({"version": "gemv"}, "version 'gemv'"),
])
def test_formats_the_engine_does_not_read_are_refused_at_start_by_name(tiny_model_dir, tmp_path, change, named):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=named):
        check(folder)


def test_the_start_check_refuses_quantizing_a_quantized_folder(tiny_model_dir, tmp_path):
    write_checkpoint(tiny_model_dir, tmp_path / "model", "gptq")
    check(tmp_path / "model")
    with pytest.raises(ModelFolderError, match="already GPTQ"):
        check(tmp_path / "model", "int4")


def test_an_older_checkpoints_quantize_config_json_is_read(tiny_model_dir, tmp_path):
    """AutoGPTQ's older folders (TheBloke's) keep the settings in quantize_config.json, config.json saying nothing:
    read as config.json's would be (they were served as a float model of random projections)."""
    expected = write_checkpoint(tiny_model_dir, tmp_path / "model", "gptq")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    settings = config.pop("quantization_config")
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    (tmp_path / "model" / "quantize_config.json").write_text(json.dumps({k: v for k, v in settings.items()
                                                                         if k != "quant_method"}))
    check(tmp_path / "model")
    loaded = runner(tmp_path / "model")
    assert loaded.quantization == "gptq"
    want = expected[0, "o"]
    assert torch.allclose(loaded.linears[0].o.dequantized(), want, atol=float(want.abs().max() / 7) / 256, rtol=0)


def test_a_projection_the_checkpoint_keeps_float_is_int8_of_its_weight(tiny_model_dir, tmp_path):
    """AutoAWQ's modules_to_not_convert: a projection stored as a float ``.weight`` among packed ones is served
    (int8 of its weight), not a traceback for a missing qweight."""
    folder = tmp_path / "model"
    write_checkpoint(tiny_model_dir, folder, "awq")
    state = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"
    weight = load_file(str(tiny_model_dir / "model.safetensors"))[f"{prefix}.weight"]
    for name in ("qweight", "qzeros", "scales"):
        del state[f"{prefix}.{name}"]
    save_file({**state, f"{prefix}.weight": weight}, str(folder / "model.safetensors"))
    loaded = runner(folder)
    assert isinstance(loaded.linears[0].down, Q8Linear) and isinstance(loaded.linears[1].down, Q4Linear)
    assert torch.allclose(loaded.linears[0].down.dequantized(), weight.float(), atol=float(weight.abs().max()) / 127)


def test_a_tensor_the_checkpoint_lacks_is_named_at_start(tiny_model_dir, tmp_path):
    """A start-up error (ModelFolderError: one line, exit 2), not a traceback."""
    folder = tmp_path / "model"
    write_checkpoint(tiny_model_dir, folder, "awq")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.qzeros"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelFolderError, match="model.layers.1.self_attn.k_proj.qzeros"):
        runner(folder)
