"""End to end on the default model: real text, HF parity, and TGI's own client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from text_generation import AsyncClient, Client
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "My name is Olivier and I"


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def generate(stack, inputs: str, **parameters) -> dict:
    r = httpx.post(stack.url + "/generate", json={"inputs": inputs, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_answers_paris(smol_stack, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = generate(smol_stack, prompt, max_new_tokens=20, do_sample=False, details=True)
    assert "Paris" in body["generated_text"]
    assert body["details"]["finish_reason"] == "eos_token"
    assert body["details"]["tokens"][-1]["special"] is True


def test_greedy_equals_hf_generate_token_for_token(smol_stack, smol_dir, tokenizer):
    body = generate(smol_stack, PROMPT, max_new_tokens=20, do_sample=False, details=True)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    expected = out[0, ids.shape[1]:].tolist()
    assert [t["id"] for t in body["details"]["tokens"]] == expected
    assert body["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert body["generated_text"].startswith("'m here to help you with your business.")


def test_text_generation_client(smol_stack):
    client = Client(smol_stack.url, timeout=120)
    response = client.generate(PROMPT, max_new_tokens=10)
    assert response.generated_text.startswith("'m here to help you")
    assert response.details.finish_reason.value == "length"
    assert response.details.generated_tokens == 10
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=10))
    assert "".join(r.token.text for r in streamed) == response.generated_text
    assert streamed[-1].generated_text == response.generated_text
    assert all(r.details is None for r in streamed[:-1])
    sampled = [client.generate(PROMPT, max_new_tokens=12, do_sample=True, temperature=0.8, seed=5, top_p=0.9)
               for _ in range(2)]
    assert sampled[0].generated_text == sampled[1].generated_text
    assert sampled[0].details.seed == 5


async def test_async_client_concurrent_requests_match_sequential(smol_stack):
    client = AsyncClient(smol_stack.url, timeout=120)
    prompts = [PROMPT, "The capital of Germany is", "Once upon a time", "def fibonacci(n):"]
    alone = [(await client.generate(p, max_new_tokens=8)).generated_text for p in prompts]
    together = await asyncio.gather(*(client.generate(p, max_new_tokens=8) for p in prompts))
    assert [r.generated_text for r in together] == alone


def test_client_sees_validation_errors(smol_stack):
    from text_generation.errors import ValidationError

    client = Client(smol_stack.url, timeout=60)
    with pytest.raises(ValidationError, match="truncate"):
        client.generate(PROMPT, max_new_tokens=5, truncate=0)
    with pytest.raises(ValidationError, match="tokens"):
        client.generate("word " * 3000, max_new_tokens=5)
    assert client.generate(PROMPT, max_new_tokens=2).generated_text
