"""Engine.step() on real models across the step's shapes: Mix (prompt chunks beside decode rows),
prefix caching on the default model (the tiny model's cases: test_prefix_cache_steps), the PyTorch ops
(``cpu_kernels=False``, what cuda and npu run) and bfloat16.

The tiny random model: the same tokens as each prompt alone in Standard mode, and the same
log-probabilities within 1e-4. The default model: transformers' greedy ``generate`` (for bfloat16, our
float32 runner) within the near-tie rule of test_engine_outputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.devices import resolve_device
from services.engine.engine import Engine
from services.engine.model_runner import ModelRunner
from shared.messages import TokenEvent
from tests.unit.engine_helpers import (
    BLOCK, MIX, TOP, Run, alone, assert_pool_whole, assert_same_outputs, block_bytes, limits, make_runner, prompt,
    request, run_until_idle,
)
from tests.unit.test_engine_outputs import check_greedy_close

# ---- the default model: prompts, transformers' reference, runners -----------------------------

SHARED = ("You are a careful assistant. Read the question below and answer it in one short sentence, "
          "in plain words, without lists, without repeating the question, and without any greeting or "
          "closing remark. Keep the answer true, simple and friendly, and use British spelling throughout. ")
TEXTS = [
    "The capital of France is",
    "Here is a long story about a dragon who lived in the mountains and guarded a treasure of gold "
    "and jewels for a thousand years. One day,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    SHARED + "Question: what colour is the sky on a clear day? Answer:",
    SHARED + "Question: how many legs does a spider have? Answer:",
]
NEW_TOKENS = 10
EOS = 2
SMOL_HITS = 3 * BLOCK  # the last two prompts share 55 tokens: 3 whole blocks


@pytest.fixture(scope="module")
def smol_prompts(smol_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    assert max(len(p) for p in prompts) > 3 * MIX["prefill_chunk_size"]  # chunked over 4 steps
    assert common_prefix(prompts[3], prompts[4]) // BLOCK * BLOCK == SMOL_HITS  # the shared whole blocks
    return prompts


@pytest.fixture(scope="module")
def hf_reference(smol_dir, smol_prompts) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy generate for each prompt alone: (new token ids, logits per position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt_ids in smol_prompts:
            ids = torch.tensor([prompt_ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=EOS, eos_token_id=EOS,
                                 return_dict_in_generate=True, output_logits=True)
            results.append((out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits)[:, 0].float()))
    del model
    return results


@pytest.fixture(scope="module")
def smol_runner(smol_dir):
    return make_runner(smol_dir, num_blocks=48)


@pytest.fixture(scope="module")
def smol_torch_ops_runner(smol_dir):
    """The PyTorch ops (TorchOps), as on cuda and npu, on the CPU."""
    runner = ModelRunner(str(smol_dir), resolve_device("cpu", "float32"), block_size=BLOCK,
                         kv_budget_bytes=48 * block_bytes(smol_dir), max_blocks=48, cpu_kernels=False)
    assert not runner.ops.fused
    return runner


@pytest.fixture(scope="module")
def smol_bf16_runner(smol_dir):
    runner = ModelRunner(str(smol_dir), resolve_device("cpu", "bfloat16"), block_size=BLOCK,
                         kv_budget_bytes=48 * block_bytes(smol_dir), max_blocks=48)
    assert runner.k_cache.dtype == torch.bfloat16
    return runner


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_smol(runner, prompts, order: str = "together", logprobs: int | None = None, **kw) -> tuple[Engine, Run]:
    """Every prompt (max NEW_TOKENS, EOS ends), ``together`` in one go or ``one by one``; kw: Engine's
    prefix_cache and the limits."""
    engine = Engine(runner, limits(**{k: v for k, v in kw.items() if k != "prefix_cache"}), {EOS},
                    prefix_cache=kw.get("prefix_cache", False))
    run = Run()
    for i, ids in enumerate(prompts):
        engine.add_request(request(f"r{i}", ids, max_new_tokens=NEW_TOKENS, logprobs=logprobs))
        if order == "one by one":
            run = run_until_idle(engine, run, check_blocks=True)
    run = run_until_idle(engine, run, check_blocks=True)
    assert_pool_whole(engine)
    return engine, run


def check_hf(run: Run, hf_reference) -> None:
    for i, (theirs, logits) in enumerate(hf_reference):
        check_greedy_close(run.tokens[f"r{i}"], theirs, logits, TEXTS[i][-30:])
        assert run.reason(f"r{i}") == ("eos_token" if theirs[-1] == EOS else "length")


# ---- Mix: prompt chunks beside decode rows ----------------------------------------------------


@pytest.mark.parametrize("chunk", [16, 32])
def test_mix_equals_standard(tiny_runner, chunk):
    """Prompts of 3 to 75 tokens (up to 5 chunks), chunked beside each other's decode rows."""
    prompts = [prompt(n, start=30 + n) for n in (3, 75, 17, 40, 33)]
    runs = []
    for limit_kw in ({}, dict(mix=True, prefill_chunk_size=chunk)):
        engine = Engine(tiny_runner, limits(**limit_kw), set())
        for i, ids in enumerate(prompts):
            engine.add_request(request(f"r{i}", ids, max_new_tokens=8, logprobs=TOP))
        runs.append(run_until_idle(engine, check_blocks=True))
        assert_pool_whole(engine)
    assert_same_outputs(runs[1], runs[0])
    assert runs[1].steps >= runs[0].steps + math.ceil(168 / chunk) - 1  # the 168 prompt tokens, chunk by chunk


def test_a_long_prompt_is_chunked_while_every_decoding_request_gets_a_token_each_step(tiny_runner):
    chunk, long_len = 16, 70
    early = {"a": prompt(5, start=11), "b": prompt(7, start=23)}
    late = prompt(long_len, start=40)
    expected = alone(tiny_runner, {**early, "late": late}, 20)
    engine = Engine(tiny_runner, limits(mix=True, prefill_chunk_size=chunk), set())
    for rid, ids in early.items():
        engine.add_request(request(rid, ids, max_new_tokens=20, logprobs=TOP))
    run = Run()
    run.record(engine.step())  # both prompts (12 tokens) fit one chunk
    assert sorted(run.tokens) == ["a", "b"]
    engine.add_request(request("late", late, max_new_tokens=20, logprobs=TOP))
    chunk_steps = math.ceil(long_len / chunk)
    for k in range(1, chunk_steps + 1):
        events = engine.step()
        run.record(events)
        assert sorted(e.id for e in events) == (["a", "b", "late"] if k == chunk_steps else ["a", "b"])
        assert all(len(e.token_ids) == 1 for e in events)
        assert engine.seqs["late"].num_computed == min(k * chunk, long_len)
        engine.blocks.check(engine.scheduler.running)
    assert len(run.tokens["late"]) == 1 and len(run.tokens["a"]) == 1 + chunk_steps
    run = run_until_idle(engine, run, check_blocks=True)
    assert_same_outputs(run, expected)
    assert_pool_whole(engine)


def test_mix_greedy_matches_hf_generate_on_the_default_model(smol_runner, smol_prompts, hf_reference):
    _, run = run_smol(smol_runner, smol_prompts, **MIX)
    check_hf(run, hf_reference)


def test_prefix_cache_on_the_default_model_matches_hf_generate(smol_runner, smol_prompts, hf_reference):
    """One by one (Standard) and together (Mix): the second shared-prefix prompt finds the first's blocks."""
    engine, run = run_smol(smol_runner, smol_prompts, order="one by one", prefix_cache=True)
    check_hf(run, hf_reference)
    assert engine.blocks.prefix_hit_tokens == SMOL_HITS
    engine, run = run_smol(smol_runner, smol_prompts, prefix_cache=True, **MIX)
    check_hf(run, hf_reference)
    assert engine.blocks.prefix_hit_tokens == SMOL_HITS  # the last prompt is admitted after the one before is computed


# ---- the PyTorch ops (cuda, npu) --------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, dict(prefix_cache=True, **MIX)], ids=["standard", "mix-prefix-cache"])
def test_torch_ops_greedy_matches_hf_generate(smol_torch_ops_runner, smol_prompts, hf_reference, kw):
    engine, run = run_smol(smol_torch_ops_runner, smol_prompts, **kw)
    check_hf(run, hf_reference)
    assert engine.blocks.prefix_hit_tokens == (SMOL_HITS if kw else 0)


# ---- bfloat16 ---------------------------------------------------------------------------------

# bfloat16 keeps 8 significant bits: the logits (|x| of 10 to 30) come out in steps of 0.06 to 0.125, so
# two candidates closer than about two steps may tie or swap. The first difference from float32 must
# be float32's second choice, within that gap.
BF16_MAX_GAP = 0.3


def check_close_to_events(ours: list[int], reference: list[TokenEvent], name: str, max_gap: float) -> None:
    """check_greedy_close against our own float32 run, whose events carry their top-2 logprobs."""
    theirs = [e.token_ids[0] for e in reference]
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        top = reference[position].logprobs[0]
        gap = top.top_logprobs[0] - top.top_logprobs[1]
        assert a in top.top_ids, f"{name}: position {position}: {a} is not in float32's top-2"
        assert gap < max_gap, f"{name}: position {position}: {a} != {b} and float32's top-2 gap is {gap:.4f}"
        return
    assert len(ours) == len(theirs), f"{name}: {len(ours)} tokens vs {len(theirs)}"


@pytest.fixture(scope="module")
def float32_events(smol_runner, smol_prompts) -> Run:
    return run_smol(smol_runner, smol_prompts, logprobs=2)[1]


@pytest.mark.parametrize("kw", [{}, dict(prefix_cache=True, **MIX)], ids=["standard", "mix-prefix-cache"])
def test_bfloat16_greedy_matches_float32(smol_bf16_runner, float32_events, smol_prompts, kw):
    reference = float32_events
    engine, run = run_smol(smol_bf16_runner, smol_prompts, **kw)
    assert engine.blocks.prefix_hit_tokens == (SMOL_HITS if kw else 0)
    for i in range(len(smol_prompts)):
        theirs = [e for e in reference.events if e.id == f"r{i}" and e.token_ids]
        check_close_to_events(run.tokens[f"r{i}"], theirs, TEXTS[i][-30:], BF16_MAX_GAP)


# ---- int8 K/V (Switchboard.kvCacheDtype "int8") -----------------------------------------------


@pytest.fixture(scope="module", params=[True, False], ids=["kernels", "torch-ops"])
def smol_int8_kv_runner(smol_dir, request):
    runner = ModelRunner(str(smol_dir), resolve_device("cpu", "float32"), block_size=BLOCK,
                         kv_budget_bytes=48 * block_bytes(smol_dir), max_blocks=10_000, kv_cache_dtype="int8",
                         cpu_kernels=request.param)
    assert runner.k_cache.dtype == torch.int8 and runner.ops.fused == request.param
    return runner


@pytest.mark.parametrize("kw", [{}, dict(prefix_cache=True, **MIX)], ids=["standard", "mix-prefix-cache"])
def test_int8_kv_greedy_matches_float32(smol_int8_kv_runner, float32_events, smol_prompts, kw):
    """Within the near-tie rule of the float32 cache's own run; chunks and cached prefixes read the same codes."""
    engine, run = run_smol(smol_int8_kv_runner, smol_prompts, **kw)
    assert engine.blocks.prefix_hit_tokens == (SMOL_HITS if kw else 0)
    for i in range(len(smol_prompts)):
        theirs = [e for e in float32_events.events if e.id == f"r{i}" and e.token_ids]
        check_close_to_events(run.tokens[f"r{i}"], theirs, TEXTS[i][-30:], BF16_MAX_GAP)


def test_int8_kv_holds_four_times_float32s_tokens_in_the_same_budget(smol_dir, smol_int8_kv_runner):
    float_blocks = 48  # the budget the fixture gave: 48 float32 blocks
    assert smol_int8_kv_runner.num_blocks >= 3.8 * float_blocks
    assert smol_int8_kv_runner.block_bytes * 1.93 <= block_bytes(smol_dir) / 2  # 64 + 2 bytes a head, not 128


def test_int8_kv_chunked_equals_unchunked_and_preemption_finishes(tiny_model_dir):
    """The tiny model on a pool of 6 blocks: Mix chunks give each prompt's tokens alone, and a pool too small
    for every request at once preempts and still finishes all with the same tokens."""
    def runner(blocks):
        budget = int(blocks * BLOCK * token_bytes_int8(tiny_model_dir)) + 1
        return ModelRunner(str(tiny_model_dir), resolve_device("cpu", "float32"), block_size=BLOCK,
                           kv_budget_bytes=budget, max_blocks=blocks, kv_cache_dtype="int8")
    prompts = {f"r{i}": prompt(40 + 7 * i, 100 + i) for i in range(3)}
    big = runner(64)
    reference = alone(big, prompts, max_new_tokens=12)
    engine = Engine(big, limits(**MIX), set())
    assert_same_outputs(run_prompts(engine, prompts, 12), reference)
    small = Engine(runner(10), limits(max_preempt_count=2), set(), prefix_cache=True)
    assert_same_outputs(run_prompts(small, prompts, 12), reference)
    assert small.scheduler.num_preemptions > 0


def token_bytes_int8(path) -> float:
    from services.engine.kv_cache import token_bytes
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    return token_bytes(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                       torch.float32, "int8")


def run_prompts(engine: Engine, prompts: dict[str, list[int]], max_new_tokens: int) -> Run:
    for rid, ids in prompts.items():
        engine.add_request(request(rid, ids, max_new_tokens=max_new_tokens, logprobs=TOP))
    run = run_until_idle(engine, Run(), check_blocks=True)
    assert_pool_whole(engine)
    return run
