"""Helpers for driving Engine.step() directly in tests (no NATS)."""

from __future__ import annotations

import pytest
import torch

from services.engine.devices import resolve_device
from services.engine.engine import Engine, Limits
from services.engine.model_runner import ModelRunner
from shared.messages import EngineRequest, Sampling, TokenEvent

BLOCK = 16
MIX = dict(mix=True, prefill_chunk_size=16)  # Limits of templateType Mix with small chunks
CPU = resolve_device("cpu", "float32")


def block_bytes(path) -> int:
    """K and V, every layer, one block of float32."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * BLOCK * config.num_key_value_heads * head_dim * 4


def make_runner(path, num_blocks: int) -> ModelRunner:
    """A runner whose KV budget holds ``num_blocks`` blocks (and a bit more, less than one block)."""
    budget = num_blocks * block_bytes(path) + block_bytes(path) // 2
    runner = ModelRunner(str(path), CPU, block_size=BLOCK, kv_budget_bytes=budget, max_blocks=10_000)
    assert runner.num_blocks == num_blocks
    assert runner.block_bytes == block_bytes(path)
    return runner


def limits(max_batch_size=8, max_prefill_batch_size=8, max_prefill_tokens=4096, max_seq_len=2048, **kw) -> Limits:
    return Limits(max_batch_size, max_prefill_batch_size, max_prefill_tokens, max_seq_len, **kw)


def request(rid: str, prompt_ids: list[int], priority: int = 3, deadline: float | None = None,
            **sampling) -> EngineRequest:
    sampling.setdefault("do_sample", False)
    return EngineRequest(id=rid, prompt_ids=prompt_ids, sampling=Sampling(**sampling), reply_to="x",
                         priority=priority, deadline=deadline)


def media_request(processor, rid: str, content: list[dict], items: list[tuple[str, bytes]],
                  max_new_tokens: int) -> EngineRequest:
    """What the tokenizer service sends the engine for a one-turn chat: ``content`` rendered by the
    model's template and the ``items`` ((kind, bytes) in order) through its processor
    (``services.tokenizer.media.multimodal.MediaProcessor``); a chat without items takes the text path."""
    from shared.messages import GenerateRequest

    chat = GenerateRequest(id=rid, model="m", reply_to="x", messages=[{"role": "user", "content": content}])
    text = processor.prompt_text(chat, processor.processor.tokenizer)
    if not items:  # what services/tokenizer/encoder.py does
        ids = processor.processor.tokenizer(text, add_special_tokens=False).input_ids
        return request(rid, ids, max_new_tokens=max_new_tokens)
    prepared = processor.process(text, items)
    req = request(rid, prepared.ids, max_new_tokens=max_new_tokens)
    req.media = prepared.media
    return req


def prompt(n: int, start: int = 100) -> list[int]:
    return [start + (7 * i) % 500 for i in range(n)]


class Run:
    """Everything the engine said, per request."""

    def __init__(self):
        self.events: list[TokenEvent] = []
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, TokenEvent] = {}
        self.steps = 0

    def record(self, events: list[TokenEvent]) -> None:
        for event in events:
            assert event.id not in self.finish, f"event for {event.id} after it finished"
            self.events.append(event)
            self.tokens.setdefault(event.id, []).extend(event.token_ids)
            if event.finish_reason is not None:
                self.finish[event.id] = event

    def reason(self, rid: str) -> str | None:
        return self.finish[rid].finish_reason if rid in self.finish else None


def run_until_idle(engine: Engine, run: Run | None = None, max_steps: int = 1000, check_blocks: bool = False) -> Run:
    """Step until the engine is idle; with ``check_blocks``, the block manager's invariants (reference
    counts included) are asserted after every step."""
    run = run or Run()
    while engine.has_work:
        run.record(engine.step())
        run.steps += 1
        if check_blocks:
            engine.blocks.check(engine.scheduler.running)
        assert run.steps <= max_steps, "the engine made no progress"
    return run


def assert_pool_whole(engine: Engine) -> None:
    assert engine.blocks.num_free == engine.runner.num_blocks
    assert sorted(engine.blocks.free_blocks) == list(range(engine.runner.num_blocks))
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.seqs
    engine.blocks.check([])  # no block held, cached blocks consistent


def batch_greedy(runner: ModelRunner, prompts=((5, 9, 22, 31), (7, 3, 100, 200, 4, 8)), new_tokens: int = 10
                 ) -> dict[str, list[int]]:
    """The prompts together in one engine (ids r0, r1, …), ``new_tokens`` each, ignoring EOS."""
    engine = Engine(runner, limits(), {2})
    for i, ids in enumerate(prompts):
        engine.add_request(request(f"r{i}", list(ids), max_new_tokens=new_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for event in engine.step():
            tokens.setdefault(event.id, []).extend(event.token_ids)
    assert all(len(t) == new_tokens for t in tokens.values())
    return tokens


def float_linear(weight) -> torch.nn.Linear:
    """An nn.Linear holding ``weight`` [out, in] (a tensor or an array) in float32."""
    weight = torch.as_tensor(weight).float().contiguous()
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear.requires_grad_(False)


def greedy_reference(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt generated alone, ignoring EOS."""
    out = []
    for ids in prompts:
        engine = Engine(runner, limits(), set())
        engine.add_request(request("g", ids, max_new_tokens=new_tokens))
        out.append(run_until_idle(engine).tokens["g"])
    return out


# ---- the tiny model: same tokens, same log-probabilities --------------------------------------
#
# The tiny random model's greedy choice barely depends on attention (it mostly repeats the last
# token), so equal tokens alone prove little there: its events carry the raw log-probabilities of
# the chosen and the top-5 tokens, and those must agree within LOGPROB_ATOL too. The step's ways of
# attending (fresh causal prompt, chunk over cached positions, paged decode) differ by ~1e-6; dropping
# one cached key, say, moves them by 1e-3 to 4e-2.

LOGPROB_ATOL = 1e-4
TOP = 5


def outputs(run: Run) -> dict[str, list[tuple[int, float, list[float]]]]:
    """Per request: (token, its logprob, the top logprobs) of each event."""
    out: dict[str, list] = {}
    for e in run.events:
        if e.token_ids:
            out.setdefault(e.id, []).append((e.token_ids[0], e.logprobs[0].logprob, e.logprobs[0].top_logprobs))
    return out


def assert_same_outputs(ours: Run, theirs: Run) -> None:
    assert ours.tokens == theirs.tokens
    a, b = outputs(ours), outputs(theirs)
    assert a.keys() == b.keys()
    for rid in a:
        for position, ((_, lp, top), (_, their_lp, their_top)) in enumerate(zip(a[rid], b[rid])):
            assert [lp, *top] == pytest.approx([their_lp, *their_top], abs=LOGPROB_ATOL), f"{rid} at {position}"


def alone(runner, prompts: dict[str, list[int]], max_new_tokens: int, **sampling) -> Run:
    """Each prompt alone in a fresh engine (Standard, no cache): the reference outputs."""
    run = Run()
    for rid, ids in prompts.items():
        engine = Engine(runner, limits(), set())
        engine.add_request(request(rid, ids, max_new_tokens=max_new_tokens, logprobs=TOP, **sampling))
        run_until_idle(engine, run)
    return run
