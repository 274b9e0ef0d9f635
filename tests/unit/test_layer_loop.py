"""The decode step's C++ layer loop (services/engine/layer_loop.py) computes what the Python loop computes, bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from services.engine import kernels, layer_loop
from services.engine.devices import resolve_device
from services.engine.engine import Engine
from services.engine.kernels import CpuOps
from services.engine.model_runner import ModelRunner
from tests.unit.engine_helpers import limits, prompt, request

PROMPTS = [prompt(5), prompt(23, start=300), prompt(40, start=50)]  # 40: a second block of 16 from its first token


class Counted:
    """The runner's LayerLoop, counting the steps it runs."""

    def __init__(self, loop):
        self.loop, self.steps = loop, 0

    def run(self, *args):
        self.steps += 1
        return self.loop.run(*args)


def runner(path, dtype="float32", quantization="none", kv_cache_dtype="auto", cpu_kernels=True) -> ModelRunner:
    return ModelRunner(str(path), resolve_device("cpu", dtype), 16, 4 << 20, 64, cpu_kernels=cpu_kernels,
                       quantization=quantization, kv_cache_dtype=kv_cache_dtype)


def generate(model: ModelRunner) -> dict[str, tuple]:
    """Three requests decoding together (12 tokens each, the raw logprob of each), started one step apart."""
    engine = Engine(model, limits(), set())
    out: dict[str, list] = {}

    def step() -> None:
        for event in engine.step():
            out.setdefault(event.id, []).append((event.token_ids, [(p.logprob, p.top_ids) for p in event.logprobs]))

    for i, ids in enumerate(PROMPTS):
        engine.add_request(request(f"r{i}", ids, max_new_tokens=12, logprobs=2))
        step()
    while engine.has_work:
        step()
    return {rid: tuple(map(repr, parts)) for rid, parts in out.items()}


def loop_and_python(model: ModelRunner) -> tuple[dict, dict, int]:
    """The same requests with the loop and with the Python layers (the cache cleared between: same blocks)."""
    assert model.loop is not None, "the loop was not built"
    counted = Counted(model.loop)
    model.loop = counted
    with_loop = generate(model)
    model.loop = None
    without = generate(model)
    return with_loop, without, counted.steps


needs_kernels = pytest.mark.skipif(not isinstance(kernels.for_device(torch.device("cpu")), CpuOps),
                                   reason="no C++ kernels here")


@needs_kernels
@pytest.mark.parametrize("dtype,quantization,kv", [
    ("float32", "none", "auto"), ("bfloat16", "none", "auto"), ("float32", "int8", "auto"),
    ("float32", "int4", "auto"), ("bfloat16", "int4", "auto"), ("float32", "none", "int8"),
])
def test_the_loop_gives_the_python_layers_logprobs_bit_for_bit(tiny_model_dir, dtype, quantization, kv):
    with_loop, without, steps = loop_and_python(runner(tiny_model_dir, dtype, quantization, kv))
    assert with_loop == without
    assert steps >= 10  # the decode steps ran in the loop


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny random Qwen2: biases on q, k and v (added after the quantized products)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:  # transformers initializes biases at zero
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_the_loop_adds_the_projections_biases(qwen2_dir, quantization):
    with_loop, without, steps = loop_and_python(runner(qwen2_dir, "float32", quantization))
    assert with_loop == without and steps >= 10


def test_the_loop_is_not_built_where_a_layer_has_a_part_it_does_not_run(tmp_path, tiny_model_dir):
    config = Qwen3Config(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, architectures=["Qwen3ForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert runner(tmp_path).loop is None  # q and k normed per head
    assert runner(tiny_model_dir, cpu_kernels=False).loop is None  # PyTorch operations: no C++ at hand


@needs_kernels
def test_steps_with_prompt_rows_or_adapters_take_the_python_layers(tiny_model_dir):
    model = runner(tiny_model_dir)
    model.loop = counted = Counted(model.loop)
    engine = Engine(model, limits(), set())
    engine.add_request(request("a", prompt(9), max_new_tokens=2))
    engine.step()  # the prompt
    assert counted.steps == 0
    engine.step()  # its decode step
    assert counted.steps == 1
    plain = dict(chunks=[], prefill=None, lora=None, rope_cos=None)
    assert layer_loop.runs(SimpleNamespace(**plain))
    for part in (dict(chunks=[object()]), dict(prefill=object()), dict(lora=object()), dict(rope_cos=object())):
        assert not layer_loop.runs(SimpleNamespace(**{**plain, **part}))
