"""The scheduler driven by hand (no model): Mix (chunked prefill beside decode) and Standard steps."""

from __future__ import annotations

from services.engine.block_manager import BlockManager, blocks_for
from services.engine.scheduler import Limits, Scheduled, Scheduler
from services.engine.sequence import Sequence, Status
from shared.messages import Sampling

BLOCK = 16
TOKEN = 7


def scheduler(num_blocks: int = 256, prefix_cache: bool = False, **limits) -> Scheduler:
    limits.setdefault("max_batch_size", 8)
    limits.setdefault("max_prefill_batch_size", 8)
    limits.setdefault("max_prefill_tokens", 4096)
    limits.setdefault("max_seq_len", 4096)
    return Scheduler(Limits(**limits), BlockManager(num_blocks, BLOCK, prefix_cache), set())


def seq(name: str, n: int, max_new_tokens: int = 100, start: int = 1000) -> Sequence:
    return Sequence(name, list(range(start, start + n)), Sampling(max_new_tokens=max_new_tokens))


def step(sched: Scheduler) -> list[Scheduled]:
    """What the engine does: schedule, (run the model), computed, postprocess the sampling rows."""
    items = sched.schedule()
    sampled = [item.seq for item in items if item.samples]
    sched.computed(items)
    for done in sched.postprocess(sampled, [TOKEN] * len(sampled)):
        sched.finish(done.seq)
    sched.blocks.check(sched.running)
    return items


def rows(items: list[Scheduled]) -> list[tuple[str, int]]:
    return [(item.seq.id, item.num_tokens) for item in items]


def test_mix_splits_a_long_prompt_while_every_step_decodes():
    sched = scheduler(mix=True, prefill_chunk_size=256)
    decoders = [seq(f"d{i}", 10, start=100 * i) for i in range(4)]
    for s in decoders:
        sched.add(s)
    assert rows(step(sched)) == [(s.id, 10) for s in decoders]
    long = seq("long", 1000)
    sched.add(long)
    chunks = []
    while long.num_computed < len(long) - 1:
        before = [len(s) for s in decoders]
        items = step(sched)
        assert rows(items[:4]) == [(s.id, 1) for s in decoders]  # decode rows first, every step
        assert [len(s) for s in decoders] == [n + 1 for n in before]
        assert len(items) == 5 and items[4].seq is long
        chunks.append(items[4].num_tokens)
        assert len(long.block_table) == blocks_for(1000 + 100, BLOCK)  # all it reserves, from admission
    assert chunks == [256, 256, 256, 232]
    assert len(long) == 1001 and long.num_generated == 1
    assert rows(step(sched)) == [(s.id, 1) for s in decoders] + [("long", 1)]


def test_mix_continues_a_partial_prompt_before_admitting_the_next():
    sched = scheduler(mix=True, prefill_chunk_size=256)
    a, b = seq("a", 300), seq("b", 300, start=5000)
    sched.add(a)
    sched.add(b)
    assert rows(step(sched)) == [("a", 256)]
    assert rows(step(sched)) == [("a", 44)]  # b is admitted, but its first piece (256) waits for a whole budget
    assert rows(step(sched)) == [("a", 1), ("b", 256)]
    assert rows(step(sched)) == [("a", 1), ("b", 44)]
    assert rows(step(sched)) == [("a", 1), ("b", 1)]


def test_mix_pieces_end_at_multiples_of_the_chunk_size_whatever_else_runs():
    sched = scheduler(mix=True, prefill_chunk_size=64)
    short, long = seq("short", 40), seq("long", 150, start=5000)
    sched.add(short)
    sched.add(long)
    assert rows(step(sched)) == [("short", 40)]  # long's first piece (64) does not fit the 24 left
    assert rows(step(sched)) == [("short", 1), ("long", 64)]
    assert rows(step(sched)) == [("short", 1), ("long", 64)]
    assert rows(step(sched)) == [("short", 1), ("long", 22)]


def test_mix_admits_within_max_prefill_batch_size_and_the_free_blocks():
    sched = scheduler(num_blocks=2, mix=True, max_prefill_batch_size=2)
    for i in range(4):  # each reserves 10 + 5 tokens: one block
        sched.add(seq(f"s{i}", 10, max_new_tokens=5, start=100 * i))
    assert rows(step(sched)) == [("s0", 10), ("s1", 10)]
    for _ in range(4):
        assert rows(step(sched)) == [("s0", 1), ("s1", 1)]  # no block for s2
    assert not sched.running  # both reached 5 tokens
    assert rows(step(sched)) == [("s2", 10), ("s3", 10)]


def test_mix_reuses_a_cached_prefix_and_prefills_only_the_rest():
    sched = scheduler(prefix_cache=True, mix=True, prefill_chunk_size=32)
    a = seq("a", 80)
    sched.add(a)
    while a.is_prefilling or a.num_generated == 0:
        step(sched)
    b = seq("b", 70)  # the same first 70 tokens: 4 whole blocks cached
    sched.add(b)
    items = step(sched)
    assert rows(items) == [("a", 1), ("b", 6)]
    assert b.block_table[:4] == a.block_table[:4]
    assert sched.blocks.prefix_hit_tokens == 64


def test_mix_a_cache_hit_crossing_a_chunk_boundary_takes_one_step():
    """Chunks of 32, blocks of 16: b finds 3 blocks (48 tokens) cached and computes 30 more, 48-64 and 64-78:
    two segments of the fixed boundaries, in one step (each attends as a step of its own would)."""
    sched = scheduler(prefix_cache=True, mix=True, prefill_chunk_size=32)
    a = seq("a", 80)
    sched.add(a)
    while a.is_prefilling or a.num_generated == 0:
        step(sched)
    b = seq("b", 78)
    b.token_ids[48:] = list(range(9000, 9030))  # the same first 48 tokens only
    sched.add(b)
    items = step(sched)
    assert rows(items) == [("a", 1), ("b", 30)] and items[1].segment == 32
    assert sched.blocks.prefix_hit_tokens == 48
    c = seq("c", 100, start=7000)  # nothing cached: one segment a step, as before
    sched.add(c)
    assert rows(step(sched))[-1] == ("c", 32)


def test_standard_steps_are_prefill_only_or_decode_only():
    sched = scheduler(prefill_chunk_size=64)
    decoders = [seq(f"d{i}", 10, start=100 * i) for i in range(4)]
    for s in decoders:
        sched.add(s)
    assert rows(step(sched)) == [(s.id, 10) for s in decoders]
    assert rows(step(sched)) == [(s.id, 1) for s in decoders]
    long = seq("long", 1000)
    sched.add(long)
    items = step(sched)
    assert rows(items) == [("long", 1000)] and items[0].seq.num_generated == 1
    assert rows(step(sched)) == [(s.id, 1) for s in decoders] + [("long", 1)]


def test_standard_prefill_of_a_cached_prefix_is_only_the_remainder():
    sched = scheduler(prefix_cache=True)
    a = seq("a", 40)
    sched.add(a)
    step(sched)
    b = seq("b", 40)
    sched.add(b)
    assert rows(step(sched)) == [("b", 40 - 32)]


def test_samples_is_true_only_for_a_step_that_reaches_the_last_token():
    s = seq("s", 100)
    assert not Scheduled(s, 99).samples
    assert Scheduled(s, 100).samples
    s.num_computed = 60
    assert Scheduled(s, 40).samples and not Scheduled(s, 39).samples
    s.num_computed = 99
    assert Scheduled(s, 1).samples


def test_computed_advances_num_computed_and_caches_full_blocks():
    sched = scheduler(prefix_cache=True, mix=True, prefill_chunk_size=20)
    a = seq("a", 50)
    sched.add(a)
    items = sched.schedule()
    assert a.num_computed == 0 and rows(items) == [("a", 20)]
    sched.computed(items)
    assert a.num_computed == 20
    assert sched.blocks.cached_tokens(seq("probe", 60)) == BLOCK
    sched.computed(sched.schedule())
    assert a.num_computed == 40 and sched.blocks.cached_tokens(seq("probe", 60)) == 2 * BLOCK


def test_preemption_resets_num_computed_and_readmission_hits_the_cache():
    sched = scheduler(num_blocks=4, prefix_cache=True, max_preempt_count=1)
    a, b = seq("a", 31, max_new_tokens=3), seq("b", 31, start=2000)
    sched.add(a)
    sched.add(b)
    assert rows(step(sched)) == [("a", 31), ("b", 31)]
    assert rows(step(sched)) == [("a", 1), ("b", 1)]  # position 31: still in each one's 2nd block
    items = step(sched)  # a needs a 3rd block: b, the newest, is preempted
    assert rows(items) == [("a", 1)]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert a.status is Status.FINISHED  # its 3rd token: length
    assert len(b) == 33
    assert rows(step(sched)) == [("b", 33 - BLOCK)]  # b's first block survived eviction, its 2nd did not
    assert b.num_generated == 3


def test_mix_preempts_a_half_prefilled_prompt_for_a_decoding_one():
    sched = scheduler(num_blocks=4, mix=True, prefill_chunk_size=4, max_preempt_count=1)
    a, c = seq("a", 31), seq("c", 32, start=3000)
    sched.add(a)
    assert rows(step(sched)) == [("a", 4)]
    while a.is_prefilling:
        step(sched)
    sched.add(c)  # a decodes position 31; c takes the 2 blocks left
    assert rows(step(sched)) == [("a", 1), ("c", 4)]
    assert rows(step(sched)) == [("a", 1)]  # position 32 needs a 3rd block: c, the newest, gives its own
    assert c.status is Status.WAITING and c.num_computed == 0 and not c.block_table


def test_shortest_order_lets_a_mostly_cached_turn_pass_a_long_prompt():
    """prefillOrder "shortest": a conversation's next turn (its history cached, a few new tokens) goes ahead of
    another's long first prompt instead of waiting for all of its pieces; "arrival" keeps the order."""
    for order, want in (("arrival", ["long", "long", "long", "long", "turn"]),
                        ("shortest", ["long", "turn", "long", "long", "long"])):
        sched = scheduler(prefix_cache=True, mix=True, prefill_chunk_size=64, prefill_order=order)
        history = seq("history", 96, max_new_tokens=1)
        sched.add(history)
        while sched.seqs:
            step(sched)  # its blocks are cached now
        long = seq("long", 250, start=5000)
        sched.add(long)
        first = step(sched)
        turn = Sequence("turn", history.token_ids[:96] + [3, 4, 5, 6, 7], Sampling(max_new_tokens=3))
        sched.add(turn)
        prefilling = [first[0].seq.id]
        for _ in range(4):
            prefilling += [item.seq.id for item in step(sched) if item.num_tokens > 1]
        assert [name for name in prefilling if name in ("long", "turn")][:5] == want, order
        assert turn.cached_tokens == 96


def test_shortest_order_still_advances_a_long_prompt_under_a_stream_of_short_ones():
    sched = scheduler(mix=True, prefill_chunk_size=64, prefill_order="shortest", max_batch_size=64)
    long = seq("long", 200, start=5000)
    sched.add(long)
    for i in range(40):  # a new 60-token prompt every step: each fills most of a step's budget
        sched.add(seq(f"s{i}", 60, max_new_tokens=1, start=10000 + 100 * i))
        step(sched)
        if long.num_generated:
            break
    assert long.num_generated == 1  # passed over at most STARVING_STEPS steps a piece
