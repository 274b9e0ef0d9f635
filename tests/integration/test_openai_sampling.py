"""vLLM's sampling fields on the OpenAI routes through the ``openai`` client: min_p, logit_bias, min_tokens, and
chat ``echo``, against the greedy answers of the default model."""

from __future__ import annotations

from tests.integration.test_openai_api import MESSAGES, client, complete, post, stream_payloads

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|> (its EOS)


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


def test_vllm_reporting_extras_usage_so_far_token_ids_stop_reason_and_the_end_token(smol_stack):
    """stream_options.continuous_usage_stats puts each choice's usage so far on every chunk;
    return_tokens_as_token_ids shows logprobs' tokens as "token_id:<id>"; chat choices carry vLLM's
    stop_reason; a sampled end token is shown by its own text in logprobs (the answer leaves it out)."""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, prompt="The capital of France is", temperature=0, max_tokens=4)
    chunks = list(api.completions.create(**ask, stream=True, extra_body={
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    seen = [c.usage.completion_tokens for c in chunks if c.choices]
    assert seen == sorted(seen) and seen[-1] == 4 and chunks[-1].usage.completion_tokens == 4
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    plain = api.completions.create(**ask, logprobs=2)
    ids = api.completions.create(**ask, logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert ids.choices[0].text == plain.choices[0].text
    assert all(t.startswith("token_id:") for t in ids.choices[0].logprobs.tokens)
    assert all(k.startswith("token_id:") for top in ids.choices[0].logprobs.top_logprobs for k in top)
    hi = dict(model=smol_stack.model, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=40)
    chat = api.chat.completions.create(**hi, logprobs=True, top_logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert all(e.token.startswith("token_id:") and bytes(e.bytes).decode() == e.token for e in chat.logprobs.content)
    answer = api.chat.completions.create(**hi, logprobs=True, top_logprobs=1).choices[0]
    assert answer.finish_reason == "stop" and answer.logprobs.content[-1].token == "<|im_end|>"
    assert answer.logprobs.content[-1].top_logprobs[0].token == "<|im_end|>"
    word = answer.message.content.split()[1]
    stopped = api.chat.completions.create(**hi, stop=[word]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == word


def test_cache_salt_keeps_cached_blocks_among_requests_of_the_same_salt_and_request_id_names_the_answer(tiny_stack):
    """vLLM's cache_salt: a prompt seen before under another salt (or none) finds nothing in the prefix cache,
    one seen under the same salt does (blocks of 16); request_id is the answer's id; add_special_tokens is
    taken on completions (SmolLM2's tokenizer adds none: the same count either way)."""
    prompt = " ".join(f"salt{i}" for i in range(20))
    cached = []
    for salt in (None, "tenant-a", "tenant-b", "tenant-a"):
        extra = {"cache_salt": salt} if salt else {}
        cached.append(complete(tiny_stack, prompt=prompt, max_tokens=1, temperature=0, **extra)
                      ["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[:3] == [0, 0, 0] and cached[3] >= 16
    answer = client(tiny_stack).chat.completions.create(
        model=tiny_stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"request_id": "mine-1", "documents": [{"title": "t", "text": "x"}]})
    assert answer.id == "chatcmpl-mine-1"
    plain = complete(tiny_stack, prompt=prompt, max_tokens=1, temperature=0, add_special_tokens=False)
    assert plain["usage"]["prompt_tokens"] == complete(tiny_stack, prompt=prompt, max_tokens=1)["usage"]["prompt_tokens"]


def test_skip_special_tokens_false_shows_special_tokens_but_not_the_eos_that_ends_the_answer(tiny_stack):
    """vLLM's ``skip_special_tokens: false``: special tokens' text is in the answer (forced here with logit_bias),
    streamed or not; the EOS an answer ends on is left out unless include_stop_str_in_output, as vLLM leaves it."""
    forced = {"logit_bias": {str(IM_START): 100}, "max_tokens": 3, "temperature": 0}
    assert complete(tiny_stack, **forced)["choices"][0]["text"] == ""
    assert complete(tiny_stack, skip_special_tokens=False, **forced)["choices"][0]["text"] == "<|im_start|>" * 3
    events = stream_payloads(post(tiny_stack, "/v1/chat/completions", {
        "model": tiny_stack.model, "messages": MESSAGES, "stream": True, "skip_special_tokens": False, **forced}))
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == "<|im_start|>" * 3
    ending = {"logit_bias": {str(IM_END): 100}, "max_tokens": 3, "temperature": 0, "skip_special_tokens": False}
    ended = complete(tiny_stack, **ending)
    assert ended["choices"][0]["text"] == "" and ended["choices"][0]["finish_reason"] == "stop"
    assert ended["usage"]["completion_tokens"] == 1
    kept = complete(tiny_stack, include_stop_str_in_output=True, **ending)["choices"][0]["text"]
    assert kept == "<|im_end|>"


def test_bad_words_and_allowed_token_ids_hold_the_answer_as_vllms_do(smol_stack):
    """vLLM's ``bad_words`` ban a word at the answer's start and after a space (a one-token word always, a longer
    one's last token once the rest is written); ``allowed_token_ids`` keep every token, greedy or drawn, streamed
    or not, inside the set. (Greedy: " Paris" for the capital, " Western Europe" for the country's place.)"""
    api = client(smol_stack)
    ask = dict(model=smol_stack.model, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert api.completions.create(**ask).choices[0].text.startswith(" Paris")
    assert "Paris" not in api.completions.create(**ask, extra_body={"bad_words": ["Paris"]}).choices[0].text
    place = dict(model=smol_stack.model, prompt="Paris is the capital of France, a country in", temperature=0,
                 max_tokens=4)
    assert api.completions.create(**place).choices[0].text.startswith(" Western Europe")
    banned = api.completions.create(**place, extra_body={"bad_words": ["Western Europe"]}).choices[0].text
    assert banned.startswith(" Western") and not banned.startswith(" Western Europe"), banned
    allowed = [260, 253, 354]  # " the" " a" " an" (any three ids do)
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
        body = complete(smol_stack, prompt="The capital of France is", max_tokens=5, allowed_token_ids=allowed,
                        return_token_ids=True, **extra)
        assert set(body["choices"][0]["token_ids"]) <= set(allowed), body
    events = stream_payloads(post(smol_stack, "/v1/chat/completions", {
        "model": smol_stack.model, "messages": MESSAGES, "stream": True, "max_tokens": 4, "seed": 2,
        "allowed_token_ids": allowed, "return_token_ids": True}))
    streamed = [i for e in events for c in e["choices"] for i in c.get("token_ids", [])]
    assert len(streamed) == 4 and set(streamed) <= set(allowed), streamed


def test_bad_words_and_allowed_token_ids_refusals(tiny_stack):
    for body, param in (({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                        ({"allowed_token_ids": ["5"]}, "allowed_token_ids"),
                        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),  # past the vocabulary
                        ({"bad_words": "Paris"}, "bad_words"), ({"bad_words": [" "]}, "bad_words"),
                        ({"bad_words": [5]}, "bad_words"), ({"bad_words": ["x"] * 1025}, "bad_words"),
                        # no token left: the allow-list is all bad words, or all ending ids under min_tokens
                        ({"allowed_token_ids": [7042], "bad_words": [" Paris"]}, "allowed_token_ids"),
                        ({"allowed_token_ids": [30], "stop_token_ids": [30], "min_tokens": 3}, "allowed_token_ids")):
        for path, extra in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            r = post(tiny_stack, path, {"model": tiny_stack.model, **extra, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = post(tiny_stack, "/v1/completions", {"model": tiny_stack.model, "prompt": "Hi", "logprobs": 10})
    assert r.status_code == 400 and r.json()["error"]["message"] == "logprobs should be in range [0, 5], got 10."
    kept = post(tiny_stack, "/v1/completions", {"model": tiny_stack.model, "prompt": "Hi", "max_tokens": 3,
                                                "allowed_token_ids": [7042, 30], "bad_words": [" Paris"],
                                                "return_token_ids": True})
    assert set(kept.json()["choices"][0]["token_ids"]) == {30}, kept.text  # one allowed token is not a bad word
