"""vLLM's ``return_token_ids`` on chat and completions, bodies and streams (tiny random model)."""

from __future__ import annotations

from tests.integration.test_openai_api import MESSAGES, PROMPT, chat, complete, post, stream_payloads


def streamed_ids(events: list[dict], top_level: bool) -> tuple[list, list[int]]:
    """A stream's ``prompt_token_ids`` (each place it came) and its chunks' ``token_ids`` joined."""
    prompts = [e["prompt_token_ids"] for e in events if "prompt_token_ids" in e] if top_level else \
        [c["prompt_token_ids"] for e in events for c in e["choices"] if "prompt_token_ids" in c]
    return prompts, [i for e in events for c in e["choices"] for i in c.get("token_ids", [])]


def test_return_token_ids_give_the_prompts_and_the_answers_ids(tiny_stack, smol_dir):
    """vLLM's ``return_token_ids`` (what RL rollout clients read): the prompt's token ids and the answer's (those
    its logprobs name), in bodies and streams, where the first chunk carries the prompt's and each chunk its
    tokens' ids, also the tokens a stop string held text back on."""
    from transformers import AutoTokenizer
    prompt_ids = AutoTokenizer.from_pretrained(smol_dir)(PROMPT)["input_ids"]
    seeded = {"seed": 11, "max_tokens": 12, "return_token_ids": True}
    body = complete(tiny_stack, logprobs=0, return_tokens_as_token_ids=True, **seeded)
    [choice] = body["choices"]
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    text = choice["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"noise text too short to pick a stop string from: {text!r}"
    cut = complete(tiny_stack, stop=stop, **seeded)["choices"][0]
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": PROMPT, "stream": True, "stop": stop, **seeded}))
    assert streamed_ids(events, top_level=False) == ([prompt_ids], cut["token_ids"])
    said = chat(tiny_stack, **seeded)
    assert len(said["prompt_token_ids"]) == said["usage"]["prompt_tokens"]
    assert len(said["choices"][0]["token_ids"]) == said["usage"]["completion_tokens"]
    events = stream_payloads(post(tiny_stack, "/v1/chat/completions", {
        "model": tiny_stack.model, "messages": MESSAGES, "stream": True, **seeded}))
    assert streamed_ids(events, top_level=True) == ([said["prompt_token_ids"]], said["choices"][0]["token_ids"])
