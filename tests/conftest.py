"""Shared fixtures: the default model, a tiny random-weight Llama, configs on free ports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from switchboard.natsd import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "config.json"
SMOL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The engine's Triton kernels run on the CPU through Triton's interpreter (tests/unit/test_triton_kernels.py).
# Triton reads this when it is first imported, which a library any test imports may do first; the GPU run of
# tests/unit/test_cuda_engine.py (SWITCHBOARD_GPU_TOKENIZER set) compiles them for the device instead.
if not os.environ.get("SWITCHBOARD_GPU_TOKENIZER"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The default model, prepared by `make test` (switchboard prepare-model)."""
    if not (SMOL_DIR / ".switchboard-complete").exists():
        pytest.fail(f"{SMOL_DIR} is missing: run `make model` (or `make test`, which prepares it)")
    return SMOL_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_dir) -> Path:
    """A 2-layer, hidden-64 random-weight Llama with SmolLM2's tokenizer: fast plumbing, noise text."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smol_dir)


def make_tiny_model(path: Path, smol_dir: Path = SMOL_DIR, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2) -> Path:
    """The tiny random Llama of ``tiny_model_dir``, written into ``path`` (benchmarks use it too, some wider)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_config(directory: Path, model_dir: Path, **sections) -> Path:
    """The default config.json on free ports, pointing at ``model_dir``; ``sections`` patch keys.

    e.g. ``write_config(tmp, model, ServerConfig={"tokenTimeout": 5})``.
    """
    data = json.loads(DEFAULT_CONFIG.read_text())
    data["ServerConfig"].update({"port": free_port(), "managementPort": free_port(), "metricsPort": free_port()})
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(model_dir)
    data["Switchboard"]["shutdownGraceSeconds"] = 5  # a stack stopped with a stream still open stops soon
    for section, values in sections.items():
        target = data
        for key in section.split("."):
            target = target[key]
        target.update(values)
    path = directory / "config.json"
    path.write_text(json.dumps(data, indent=2))
    return path


@pytest.fixture(scope="session")
def smolvlm_dir(tmp_path_factory, smol_dir) -> Path:
    """A SmolVLM (Idefics3) whose text model is the real SmolLM2 and whose vision tower is tiny and
    random (``tests.vlm_models``): transformers' own generate is the oracle for its outputs."""
    from tests.vlm_models import make_smolvlm

    return make_smolvlm(tmp_path_factory.mktemp("smolvlm"), smol_dir)


@pytest.fixture(scope="session")
def spans():
    """Every span this process ends, in memory (cleared by the test that reads it)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory
