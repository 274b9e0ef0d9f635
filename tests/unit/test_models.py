"""Each supported architecture, as a tiny random model, decodes exactly like HF `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
)

from services.engine.devices import resolve_device
from services.engine.engine import Engine, Limits
from services.engine.model_runner import ModelRunner, UnsupportedModel
from shared.messages import EngineRequest, Sampling

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SIZES, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=16, use_sliding_window=False),
}
PROMPTS = [[5, 17, 42, 99, 3], [7, 8], list(range(100, 137))]


@pytest.mark.parametrize("name", CONFIGS)
def test_architecture_matches_hf_generate(tmp_path, name):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config.architectures = [config.architectures[0] if config.architectures else _arch(name)]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    runner = ModelRunner(str(tmp_path), resolve_device("cpu", "float32"), block_size=16,
                         kv_budget_bytes=16 << 20, max_blocks=64)
    engine = Engine(runner, Limits(8, 8, 1024, 256), set())
    for i, ids in enumerate(PROMPTS):
        engine.add_request(EngineRequest(id=str(i), prompt_ids=ids, reply_to="-",
                                         sampling=Sampling(do_sample=False, max_new_tokens=10)))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_work:
        for event in engine.step():
            outputs[event.id] += event.token_ids
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for i, ids in enumerate(PROMPTS):
        expected = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert outputs[str(i)] == expected[0, len(ids):].tolist(), (name, i)


def _arch(name: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[name]


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
    config.architectures = ["GPT2LMHeadModel"]
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        ModelRunner(str(tmp_path), resolve_device("cpu", "float32"), 16, 1 << 20, 8)
