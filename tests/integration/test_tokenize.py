"""vLLM's /tokenize and /detokenize on the tiny stack: the counts equal the prompt_tokens /v1/completions and
/v1/chat/completions report for the same input, /detokenize inverts /tokenize, bad bodies get OpenAI-shaped 4xx."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.test_openai_api import chat, complete

TEXT = "The lighthouse keeper climbed the stair"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the lamp?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30)


def test_a_prompts_count_is_what_a_completion_reports_and_detokenize_inverts_it(tiny_stack):
    got = post(tiny_stack, "/tokenize", {"model": tiny_stack.model, "prompt": TEXT, "return_token_strs": True}).json()
    usage = complete(tiny_stack, prompt=TEXT, max_tokens=1, temperature=0)["usage"]
    assert got["count"] == len(got["tokens"]) == usage["prompt_tokens"]
    assert got["max_model_len"] == 2560 and len(got["token_strs"]) == got["count"]
    assert post(tiny_stack, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": TEXT}
    plain = post(tiny_stack, "/tokenize", {"prompt": TEXT}).json()
    assert plain["tokens"] == got["tokens"] and plain["token_strs"] is None


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_a_conversations_count_is_what_a_chat_reports(smol_stack, tools):
    """On the default model (the tiny stack takes 64 prompt tokens; tools take more)."""
    extra = {"tools": tools} if tools else {}
    got = post(smol_stack, "/tokenize", {"messages": MESSAGES, **extra}).json()
    usage = chat(smol_stack, messages=MESSAGES, max_tokens=1, temperature=0, **extra)["usage"]
    assert got["count"] == usage["prompt_tokens"]
    bare = post(smol_stack, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **extra}).json()
    assert bare["count"] < got["count"] and got["tokens"][: bare["count"]] == bare["tokens"]


def test_a_chat_continues_the_final_message_or_adds_no_turn_as_tokenize_renders_it(smol_stack):
    """vLLM's continue_final_message and add_generation_prompt on /v1/chat/completions: the prompt is the one
    /tokenize renders with the same flags; a developer message is a system message (OpenAI's newer name)."""
    open_turn = [*MESSAGES, {"role": "assistant", "content": "The lamp is"}]
    for flags in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False},
                  {"add_generation_prompt": False}):
        got = post(smol_stack, "/tokenize", {"messages": open_turn, **flags}).json()
        answer = chat(smol_stack, messages=open_turn, max_tokens=4, temperature=0, **flags)
        assert answer["usage"]["prompt_tokens"] == got["count"], flags
    plain = post(smol_stack, "/tokenize", {"messages": open_turn}).json()["count"]
    continued = post(smol_stack, "/tokenize", {"messages": open_turn, "continue_final_message": True}).json()["count"]
    assert continued < plain  # the assistant's message left open: no end of turn, no new turn
    developer = [{"role": "developer", "content": MESSAGES[0]["content"]}, MESSAGES[1]]
    as_system = post(smol_stack, "/tokenize", {"messages": MESSAGES}).json()
    assert post(smol_stack, "/tokenize", {"messages": developer}).json() == as_system
    assert chat(smol_stack, messages=developer, max_tokens=1, temperature=0)["usage"]["prompt_tokens"] == \
        as_system["count"]
    # chat_template_kwargs' add_generation_prompt / continue_final_message override the fields, as vLLM merges them
    # (it was a 400 quoting Python: "got multiple values for keyword argument")
    for kwargs, flags in (({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                          ({"continue_final_message": True}, {"continue_final_message": True})):
        by_flags = post(smol_stack, "/tokenize", {"messages": open_turn, **flags}).json()["count"]
        assert post(smol_stack, "/tokenize", {"messages": open_turn, "chat_template_kwargs": kwargs}).json()[
            "count"] == by_flags
        assert chat(smol_stack, messages=open_turn, max_tokens=1, temperature=0, chat_template_kwargs=kwargs)[
            "usage"]["prompt_tokens"] == by_flags


def test_an_assistants_earlier_refusal_is_what_it_said(smol_stack):
    """OpenAI returns a refusal as ``refusal`` beside a null content; clients send it back so, or as refusal
    parts: the conversation is the one with that text as the assistant's content (they were 400s)."""
    said = [MESSAGES[1], {"role": "assistant", "content": "I can't help with that."}, {"role": "user", "content": "Why?"}]
    expected = post(smol_stack, "/tokenize", {"messages": said}).json()["count"]
    for assistant in ({"role": "assistant", "content": None, "refusal": "I can't help with that."},
                      {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}):
        messages = [said[0], assistant, said[2]]
        assert post(smol_stack, "/tokenize", {"messages": messages}).json()["count"] == expected
        assert chat(smol_stack, messages=messages, max_tokens=1, temperature=0)["usage"]["prompt_tokens"] == expected


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages[0].content }}"}, "chat_template"),  # ignored
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ x }}"}},
     "chat_template_kwargs.chat_template"),
    ("/v1/chat/completions", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}], "tools": TOOLS}, "messages[0].role"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10_000_000]}, "tokens"),
])
def test_bad_bodies_get_openai_shaped_4xx(tiny_stack, path, body, param):
    r = post(tiny_stack, path, {"model": tiny_stack.model, **body} if path.startswith("/v1/") else body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    r = httpx.post(tiny_stack.url + path, content=b"{not json", timeout=30)
    assert r.status_code == 400 and "error" in r.json()
