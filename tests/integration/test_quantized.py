"""The default model served from quantized weights (Switchboard.quantization: int4 with int8 K/V, and its own Q4_1
GGUF), end to end through the openai client: a sensible answer, the formats in /info, /v1/models and /v1/config, and
the prompt's perplexity within the target of the float model's."""

from __future__ import annotations

import math

import httpx
import pytest
from openai import OpenAI

from tests.integration.stack import running_stack

TEXT = ("The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only people who saw it "
        "up close were the keeper and the men who brought his supplies. Every evening the keeper climbed the spiral "
        "stair to light the lamp, trimmed the wick, polished the lens and wound the clockwork that turned the light.")


@pytest.fixture(scope="module", params=[("int4", "int8"), ("gguf", "auto")], ids=["int4-int8kv", "gguf"])
def quantized_stack(request, tmp_path_factory, smol_dir):
    quantization, kv = request.param
    with running_stack(tmp_path_factory.mktemp(quantization), smol_dir,
                       Switchboard={"quantization": quantization, "kvCacheDtype": kv}) as stack:
        stack.quantization, stack.kv_dtype = quantization, "float32" if kv == "auto" else kv
        yield stack


def perplexity(stack) -> float:
    done = OpenAI(base_url=stack.url + "/v1", api_key="x").completions.create(
        model=stack.model, prompt=TEXT, max_tokens=1, echo=True, logprobs=0, temperature=0)
    logprobs = [lp for lp in done.choices[0].logprobs.token_logprobs if lp is not None][:-1]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_the_quantized_default_model_answers_through_the_openai_client(quantized_stack, smol_stack):
    client = OpenAI(base_url=quantized_stack.url + "/v1", api_key="x")
    answer = client.chat.completions.create(model=quantized_stack.model, temperature=0, max_tokens=20,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content
    info = httpx.get(quantized_stack.mgmt_url + "/info", timeout=10).json()
    assert info["models"][0]["model_quantization"] == quantized_stack.quantization
    assert info["models"][0]["model_kv_cache_dtype"] == quantized_stack.kv_dtype
    card = client.models.retrieve(quantized_stack.model)
    assert (card.quantization, card.kv_cache_dtype) == (quantized_stack.quantization, quantized_stack.kv_dtype)
    config = httpx.get(quantized_stack.mgmt_url + "/v1/config", timeout=10).json()
    assert (config["quantization"], config["kvCacheDtype"]) == (quantized_stack.quantization, quantized_stack.kv_dtype)
    assert perplexity(quantized_stack) <= perplexity(smol_stack) * 1.05
