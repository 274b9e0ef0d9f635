"""vLLM's sampling fields on the OpenAI routes through the ``openai`` client: min_p, logit_bias, min_tokens, and
chat ``echo``, against the greedy answers of the default model."""

from __future__ import annotations

from tests.integration.test_openai_api import client


def test_min_p_logit_bias_min_tokens_and_chat_echo_do_what_vllm_does(smol_stack):
    """min_p 1 keeps only the most likely token (a high temperature draws the greedy text); a +100 logit_bias
    forces its token, greedy or drawn; a stop string does not end an answer before min_tokens; chat ``echo`` puts the assistant's last message before its continuation,
    streamed or not."""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, prompt="The capital of France is")
    greedy = api.completions.create(**ask, temperature=0, max_tokens=6).choices[0].text
    hot = [api.completions.create(**ask, temperature=1.5, seed=s, max_tokens=6, extra_body={"min_p": 1.0}).choices[0].text
           for s in (1, 2)]
    assert hot == [greedy, greedy]
    token = api.completions.create(**ask, temperature=0, max_tokens=1, logprobs=1).choices[0].logprobs.tokens[0]
    forced = 28  # ",": a token the greedy answer does not start with
    biased = api.completions.create(**ask, temperature=0, max_tokens=1, logit_bias={str(forced): 100}, logprobs=1)
    assert biased.choices[0].logprobs.tokens[0] == "," != token
    drawn = api.completions.create(**ask, temperature=1.0, seed=3, max_tokens=3, logit_bias={str(forced): 100})
    assert drawn.usage.completion_tokens == 3 and len(set(drawn.choices[0].text)) == 1
    paris = api.completions.create(**ask, temperature=0, max_tokens=6, stop=["Paris"]).choices[0]
    assert paris.text == " " and paris.finish_reason == "stop"
    held = api.completions.create(**ask, temperature=0, max_tokens=6, stop=["Paris"], extra_body={"min_tokens": 3})
    assert held.choices[0].text.startswith(" Paris") and held.usage.completion_tokens >= 3  # not before min_tokens
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, my name"}]
    chat = dict(model=smol_stack.model, messages=turn, max_tokens=5, temperature=0,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = api.chat.completions.create(**chat).choices[0].message.content
    echo = {**chat, "extra_body": {**chat["extra_body"], "echo": True}}
    assert api.chat.completions.create(**echo).choices[0].message.content == "Hello, my name" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(**echo, stream=True)
                       if c.choices)
    assert streamed == "Hello, my name" + plain
