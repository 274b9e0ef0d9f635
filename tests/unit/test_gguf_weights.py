"""Linear layers from a GGUF file (services/engine/gguf_weights.py): a GGUF written here from the tiny model the way
llama.cpp's converter writes one (q and k rows in its rotary order; Q4_1, with one layer's v in Q8_0 and its down in
Q6_K) loads into the engine's quantized layers with the gguf package's own dequantized numbers — exactly for Q4_1 —
and the engine gives the greedy tokens of the float model holding those numbers."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from safetensors.torch import load_file

from services.engine import kernels
from services.engine.gguf_weights import GgufError, GgufLinears, unrotate
from services.engine.model_runner import ModelRunner
from services.engine.quant import Q4Linear, Q8Linear
from tests.unit.engine_helpers import BLOCK, CPU, batch_greedy, block_bytes, float_linear

OPS = kernels.for_device(torch.device("cpu"))
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
              "down": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def types_of(layer: int, key: str, mixed: bool) -> T:
    if mixed and layer == 1 and key == "v":
        return T.Q8_0
    if mixed and layer == 1 and key == "down":
        return T.Q6_K
    return T.Q4_1


def write_gguf(model_dir, folder, mixed: bool) -> dict[tuple[int, str], np.ndarray]:
    """The tiny model's folder with a GGUF of its projections; returns each projection as the gguf package
    dequantizes it, in transformers' row order."""
    import json

    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = load_file(str(folder / "model.safetensors"))
    writer = GGUFWriter(str(folder / "tiny.gguf"), "llama")
    expected = {}
    for layer in range(config["num_hidden_layers"]):
        for key, module in PROJECTIONS.items():
            w = state[f"model.layers.{layer}.{module}.weight"].float().numpy()
            stored = llama_cpp_permute(w, heads if key == "q" else kv_heads) if key in ("q", "k") else w
            qtype = types_of(layer, key, mixed)
            if qtype == T.Q6_K and w.shape[1] % 256:
                qtype = T.Q8_0
            raw = quants.quantize(stored, qtype)
            writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[key]}.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
            back = quants.dequantize(raw, qtype).reshape(w.shape)
            if key in ("q", "k"):
                back = back[unrotate(w.shape[0], heads if key == "q" else kv_heads).numpy()]
            expected[layer, key] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("mixed", [False, True], ids=["q4_1", "mixed"])
def test_the_layers_hold_the_files_numbers(tiny_model_dir, tmp_path, mixed):
    folder = tmp_path / "model"
    expected = write_gguf(tiny_model_dir, folder, mixed)
    runner = ModelRunner(str(folder), CPU, block_size=BLOCK, kv_budget_bytes=64 * block_bytes(folder),
                         max_blocks=10_000, quantization="gguf")
    for layer, lin in enumerate(runner.linears):
        want_qkv = np.concatenate([expected[layer, key] for key in ("q", "k", "v")])
        want_gate_up = np.concatenate([expected[layer, key] for key in ("gate", "up")])
        for module, want in ((lin.qkv, want_qkv), (lin.o, expected[layer, "o"]), (lin.gate_up, want_gate_up),
                             (lin.down, expected[layer, "down"])):
            got = module.dequantized().numpy()
            if isinstance(module, Q4Linear):
                assert np.array_equal(got, want)
            else:  # converted to int8 (a merge of mixed formats, or a type other than Q4_0 / Q4_1)
                assert isinstance(module, Q8Linear) and mixed and layer == 1
                assert np.abs(got - want).max() <= np.abs(want).max() / 127


def test_the_engine_gives_the_float_models_tokens(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    expected = write_gguf(tiny_model_dir, folder, mixed=False)
    budget = 64 * block_bytes(folder)
    from_gguf = ModelRunner(str(folder), CPU, block_size=BLOCK, kv_budget_bytes=budget, max_blocks=10_000,
                            quantization="gguf")
    reference = ModelRunner(str(folder), CPU, block_size=BLOCK, kv_budget_bytes=budget, max_blocks=10_000,
                            quantization="int8")  # only for its int8 lm_head, the same as the GGUF runner's
    for layer, lin in enumerate(reference.linears):
        lin.qkv = float_linear(np.concatenate([expected[layer, k] for k in ("q", "k", "v")]))
        lin.o, lin.down = float_linear(expected[layer, "o"]), float_linear(expected[layer, "down"])
        lin.gate_up = float_linear(np.concatenate([expected[layer, k] for k in ("gate", "up")]))
    reference.model.lm_head = from_gguf.model.lm_head
    assert batch_greedy(from_gguf, new_tokens=10) == batch_greedy(reference, new_tokens=10)



def test_a_gguf_of_another_model_is_refused_by_tensor(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    write_gguf(tiny_model_dir, folder, mixed=False)
    reader = GgufLinears(folder / "tiny.gguf", 4, 2, OPS)
    with pytest.raises(GgufError, match=r"tensor blk.0.attn_q.weight is \[64, 64\], the model's is \[128, 64\]"):
        reader.layer(0, {"q": (128, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64),
                         "up": (128, 64), "down": (64, 128)})
    (folder / "tiny.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(GgufError, match="not a readable GGUF file"):
        GgufLinears(folder / "tiny.gguf", 4, 2, OPS)
