"""Prompt logprobs through the whole stack: ``/v1/completions`` with ``echo`` and ``logprobs`` (what
lm-evaluation-harness's ``local-completions`` model sends for every log-likelihood request) and TGI's
``decoder_input_details``. Each prompt token's logprob equals transformers' log-softmax of the same weights
within 1e-4; lm-evaluation-harness runs a multiple-choice task against the server and scores it as its
``hf`` model does on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.test_openai_api import PROMPT, client, complete, post, stream_payloads
from tests.unit.test_prompt_logprobs import rank_range

IDS = [5965, 1462, 314, 11256, 380, 1153, 284, 339]  # PROMPT tokenized


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].log_softmax(dim=-1)


def test_echo_with_logprobs_gives_the_prompts_logprobs(tiny_stack, reference):
    done = client(tiny_stack).completions.create(model=tiny_stack.model, prompt=PROMPT, echo=True, logprobs=2,
                                                  max_tokens=3, temperature=0)
    choice = done.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(IDS) + 3 and "".join(lp.tokens) == choice.text and choice.text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for position in range(1, len(IDS)):
        assert abs(lp.token_logprobs[position] - float(reference[position - 1][IDS[position]])) < 1e-4
        top = reference[position - 1].topk(2).values.tolist()
        assert sorted(lp.top_logprobs[position].values(), reverse=True)[:2] == pytest.approx(top, abs=1e-4)
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    plain = complete(tiny_stack, prompt=PROMPT, logprobs=2, max_tokens=3, temperature=0)["choices"][0]["logprobs"]
    assert lp.token_logprobs[len(IDS):] == pytest.approx(plain["token_logprobs"], abs=1e-5)


def test_lm_eval_style_requests_with_token_ids_and_one_new_token(tiny_stack, reference):
    body = complete(tiny_stack, prompt=[IDS, IDS[:5]], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    first, second = body["choices"]
    assert len(first["logprobs"]["token_logprobs"]) == len(IDS) + 1 and len(second["logprobs"]["tokens"]) == 5 + 1
    for choice, n in ((first, len(IDS)), (second, 5)):
        got = choice["logprobs"]["token_logprobs"][1:n]
        want = [float(reference[p - 1][IDS[p]]) for p in range(1, n)]
        assert got == pytest.approx(want, abs=1e-4)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(tiny_stack, reference):
    """OpenAI's legacy API and vLLM take ``max_tokens: 0`` with ``echo``: the prompt and its logprobs, nothing
    generated (finish_reason length, no completion tokens); streamed too. Without echo, 0 stays a 400."""
    done = client(tiny_stack).completions.create(model=tiny_stack.model, prompt=PROMPT, echo=True, logprobs=1,
                                                  max_tokens=0, temperature=0)
    [choice] = done.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(IDS) and choice.logprobs.token_logprobs[0] is None
    want = [float(reference[p - 1][IDS[p]]) for p in range(1, len(IDS))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(IDS), 0)
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": [IDS, IDS[:5]], "stream": True, "echo": True, "logprobs": 1,
        "max_tokens": 0}))
    texts = {}
    for event in events:
        for c in event["choices"]:
            texts.setdefault(c["index"], []).append((c["text"], c["finish_reason"]))
    assert sorted(texts) == [0, 1] and all(chunks[-1] == ("", "length") for chunks in texts.values()), texts
    refused = post(tiny_stack, "/v1/completions", {"model": tiny_stack.model, "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_a_stream_echoes_the_prompt_with_its_logprobs_first(tiny_stack, reference):
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": PROMPT, "stream": True, "echo": True, "logprobs": 1, "max_tokens": 4,
        "temperature": 0}))
    head = events[0]["choices"][0]
    assert head["text"] == PROMPT and head["logprobs"]["token_logprobs"][0] is None
    assert head["logprobs"]["token_logprobs"][1] == pytest.approx(float(reference[0][IDS[1]]), abs=1e-4)
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"]) == len(IDS) + 4


def test_tgi_decoder_input_details_carry_the_prefill_logprobs(tiny_stack, reference):
    r = post(tiny_stack, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2,
                                                                        "decoder_input_details": True}})
    prefill = r.json()["details"]["prefill"]
    assert [t["id"] for t in prefill] == IDS and prefill[0]["logprob"] is None
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(
        [float(reference[p - 1][IDS[p]]) for p in range(1, len(IDS))], abs=1e-4)


QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("The opposite of hot is", [" loud", " cold", " green", " fast"], 1),
    ("Two plus two equals", [" seven", " one", " four", " ten"], 2),
    ("The color of the sky on a clear day is", [" blue", " purple", " black", " brown"], 0),
    ("A baby cat is called a", [" puppy", " calf", " foal", " kitten"], 3),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Rankine", " Newton"], 0),
    ("The largest planet in our solar system is", [" Mars", " Jupiter", " Venus", " Mercury"], 1),
    ("Bees make", [" milk", " silk", " honey", " wool"], 2),
]


def write_task(folder) -> str:
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "sb_mc.yaml").write_text(
        "task: sb_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    return "sb_mc"


def test_lm_eval_harness_scores_switchboard_as_its_hf_model(smol_stack, smol_dir, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    task = write_task(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))
    served = simple_evaluate(
        model="local-completions", tasks=[task], task_manager=tasks, log_samples=True,
        model_args=f"base_url={smol_stack.url}/v1/completions,model={smol_stack.model},tokenizer={smol_dir},"
                   "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    local = simple_evaluate(model="hf", tasks=[task], task_manager=tasks, log_samples=True,
                            model_args=f"pretrained={smol_dir},dtype=float32,device=cpu")
    assert served["results"][task]["acc,none"] == local["results"][task]["acc,none"] >= 0.5
    ours = [float(r[0][0]) for s in served["samples"][task] for r in s["resps"]]
    theirs = [float(r[0][0]) for s in local["samples"][task] for r in s["resps"]]
    assert len(ours) == sum(len(c) for _, c, _ in QUESTIONS)
    assert ours == pytest.approx(theirs, abs=1e-3)  # each choice's log-likelihood


def test_an_echoed_prompt_of_ids_splitting_characters_reads_as_its_text(tiny_stack, smol_dir):
    """Token ids of an emoji prompt (byte-level BPE spreads each emoji over tokens): echo gives the decoded
    prompt, not one U+FFFD per token, and with logprobs the tokens join into the text and their offsets index it,
    whole and streamed."""
    from transformers import AutoTokenizer

    text = "Emoji: 😀😃😄"
    ids = AutoTokenizer.from_pretrained(smol_dir)(text, add_special_tokens=False).input_ids
    body = complete(tiny_stack, prompt=ids, echo=True, max_tokens=2, temperature=0)
    assert body["choices"][0]["text"].startswith(text)
    [choice] = complete(tiny_stack, prompt=ids, echo=True, logprobs=2, max_tokens=2, temperature=0)["choices"]
    lp = choice["logprobs"]
    assert choice["text"].startswith(text) and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]
    events = stream_payloads(post(tiny_stack, "/v1/completions", {
        "model": tiny_stack.model, "prompt": ids, "stream": True, "echo": True, "logprobs": 2, "max_tokens": 2,
        "temperature": 0}))
    streamed = [t for e in events if e["choices"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def check_vllm_prompt_logprobs(got: list, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's shape: null first, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the token first, then its
    k likeliest (ranks 1..k)."""
    assert len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        row, entry = reference[position - 1], got[position]
        keys = list(entry)
        assert keys[0] == str(ids[position]), (position, keys)
        own = entry[keys[0]]
        assert own["logprob"] == pytest.approx(float(row[ids[position]]), abs=1e-4)
        low, high = rank_range(row, ids[position])
        assert low <= own["rank"] <= high and isinstance(own["decoded_token"], str)
        top = row.topk(k)
        alternatives = {int(key): value for key, value in entry.items() if int(key) != ids[position]}
        for rank, (token, logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            if token != ids[position]:
                assert alternatives[token]["rank"] == rank
                assert alternatives[token]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert len(alternatives) == k - (ids[position] in top.indices.tolist())


def test_vllm_prompt_logprobs_on_completions_and_chat(tiny_stack, tiny_model_dir, reference):
    """vLLM's ``prompt_logprobs`` (what scoring and reward pipelines send through the openai SDK's extra_body):
    per choice on completions, top-level on chat, each prompt token's logprob and rank equal to transformers'
    log-softmax; with echo and logprobs too, the echoed part keeps its own number of alternatives."""
    sdk = client(tiny_stack)
    done = sdk.completions.create(model=tiny_stack.model, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    check_vllm_prompt_logprobs(done.choices[0].model_extra["prompt_logprobs"], IDS, reference, 2)
    body = complete(tiny_stack, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=0, echo=True, logprobs=1)
    check_vllm_prompt_logprobs(body["choices"][0]["prompt_logprobs"], IDS, reference, 0)
    echoed = body["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(top) <= 2 for top in echoed[1:]), echoed
    body = complete(tiny_stack, prompt=PROMPT, max_tokens=1, prompt_logprobs=3, echo=True, logprobs=1)
    assert all(len(top) <= 2 for top in body["choices"][0]["logprobs"]["top_logprobs"][1:])
    check_vllm_prompt_logprobs(body["choices"][0]["prompt_logprobs"], IDS, reference, 3)
    said = sdk.chat.completions.create(model=tiny_stack.model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    ids = said.model_extra["prompt_token_ids"]
    assert len(ids) == said.usage.prompt_tokens
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        chat_reference = model(torch.tensor([ids])).logits[0].log_softmax(dim=-1)
    check_vllm_prompt_logprobs(said.model_extra["prompt_logprobs"], ids, chat_reference, 1)


def test_prompt_logprobs_refusals(tiny_stack):
    for body in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                 {"prompt_logprobs": -2}, {"prompt_logprobs": "1"}, {"prompt_logprobs": True}):
        for path, extra in (("/v1/completions", {"prompt": PROMPT}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            r = post(tiny_stack, path, {"model": tiny_stack.model, **extra, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", (path, body, r.text)
