"""Iteration-level scheduling: who runs in the next step and how many of its tokens, and what
finishing means.

Standard: a step either prefills newly admitted prompts whole or decodes every running sequence.
Mix (SplitFuse): every step decodes every running sequence and also computes up to
prefillChunkSize prompt tokens, so a long prompt is spread over steps and never stalls decoding.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, Status
from shared.messages import FinishReason


LOOKAHEAD = 32  # prefillOrder "shortest": waiting prompts looked at per step
STARVING_STEPS = 8  # prefillOrder "shortest": a prompt passed over this many steps in a row goes first


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_prefill_batch_size: int
    max_prefill_tokens: int
    max_seq_len: int
    token_timeout_s: float = float("inf")
    max_preempt_count: int = 0  # preemptions allowed per step; 0 = off: admission reserves whole sequences
    max_queue_delay_s: float = 0.0  # an idle engine waits this long for a fuller first prefill batch
    prefill_chunk_size: int = 512  # Mix: prompt tokens per step, next to one token per decoding sequence
    mix: bool = False  # templateType Mix: prefill in chunks inside decode steps; else Standard
    prefill_order: str = "arrival"  # Mix: "arrival" or "shortest" (Switchboard.prefillOrder; config's default "shortest")


@dataclass(frozen=True)
class Scheduled:
    """One sequence's work in a step: ``num_tokens`` tokens from ``seq.num_computed`` on, at those
    positions, attending to every earlier position. ``segment`` (Mix: prefillChunkSize): the rows' attention
    is computed in pieces ending at its multiples, as if each were a step of its own (0: in one)."""

    seq: Sequence
    num_tokens: int
    segment: int = 0

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last token, so it samples the next one. Read it before
        ``Scheduler.computed`` advances ``num_computed``."""
        return self.seq.num_computed + self.num_tokens == len(self.seq)


@dataclass
class Finish:
    seq: Sequence
    reason: FinishReason  # length | eos_token


class Scheduler:
    def __init__(self, limits: Limits, blocks: BlockManager, eos_token_ids: set[int],
                 on_finish: Callable[[Sequence], None] = lambda seq: None,
                 on_admit: Callable[[Sequence], None] = lambda seq: None):
        self.limits = limits
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.on_finish = on_finish  # called once per sequence, however it ends
        self.on_admit = on_admit  # called when a sequence gets its blocks (it may fill them: KV received)
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every sequence not yet ended, by request id: the engine's one registry
        self.num_preemptions = 0

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.id] = seq
        if seq.sampling.min_tokens:  # (the sampler keeps these out until it has min_tokens tokens)
            ending = set(seq.sampling.stop_token_ids) | (set() if seq.sampling.ignore_eos else self.eos_token_ids)
            seq.held_ids = tuple(sorted(ending))
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def hold_until(self, now: float) -> float | None:
        """When nothing runs and the waiting prompts fill less than a prefill batch, the time (unix
        seconds) the batch launches anyway: maxQueueDelayMicroseconds after the oldest arrived."""
        lim = self.limits
        if self.running or not self.waiting or len(self.waiting) >= lim.max_prefill_batch_size:
            return None
        if sum(len(s) for s in self.waiting) >= lim.max_prefill_tokens:
            return None
        launch = min(s.last_event_at for s in self.waiting) + lim.max_queue_delay_s
        return launch if launch > now else None

    def schedule(self) -> list[Scheduled]:
        """The work of the next step: decoding sequences first (one token each), then prefill."""
        if self.limits.mix:
            return self._schedule_mix()
        prefill = self._admit_whole_prompts()
        return prefill or self._schedule_decode()

    def _admit_whole_prompts(self) -> list[Scheduled]:
        """Standard: new prompts, each computed whole (less its cached prefix) in this one step."""
        scheduled: list[Scheduled] = []
        num_tokens = 0
        lim = self.limits
        while self.waiting and len(scheduled) < lim.max_prefill_batch_size:
            seq = self.waiting[0]
            new_tokens = len(seq) - self.blocks.cached_tokens(seq)
            if scheduled and num_tokens + new_tokens > lim.max_prefill_tokens:
                break
            if not self._admit(seq):
                break
            scheduled.append(Scheduled(seq, seq.num_uncomputed))
            num_tokens += seq.num_uncomputed
        return scheduled

    def _schedule_mix(self) -> list[Scheduled]:
        """Mix (SplitFuse): every decoding sequence, plus up to prefillChunkSize prompt tokens,
        continuing half-computed prompts before admitting new ones. A prompt's pieces end at fixed
        multiples of prefillChunkSize (``_piece``): one that does not fit what is left of the budget
        waits for the next step rather than being cut elsewhere. A step that had to preempt admits
        nothing: the blocks it freed are for the sequences already running."""
        preemptions = self.num_preemptions
        decode = self._schedule_decode()
        if self.limits.prefill_order == "shortest":
            return decode + self._prefill_shortest(self.num_preemptions == preemptions)
        budget = self.limits.prefill_chunk_size
        prefill: list[Scheduled] = []

        def room() -> bool:
            return budget > 0 and len(prefill) < self.limits.max_prefill_batch_size

        for seq in [s for s in self.running if s.is_prefilling]:
            if not room():
                break
            piece = self._piece(seq, budget)
            if not piece:
                continue  # a later, shorter piece may fit
            prefill.append(Scheduled(seq, piece, self.limits.prefill_chunk_size))
            budget -= piece
        while room() and self.waiting and self.num_preemptions == preemptions:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            piece = self._piece(seq, budget)
            if not piece:
                break  # admitted; its first piece goes in the next step
            prefill.append(Scheduled(seq, piece, self.limits.prefill_chunk_size))
            budget -= piece
        return decode + prefill

    def _prefill_shortest(self, may_admit: bool) -> list[Scheduled]:
        """Mix's prompt pieces, the prompts with the fewest tokens left to compute first (after what the prefix
        cache holds; the first ``LOOKAHEAD`` waiting ones are looked at), within a priority level; one passed
        over ``STARVING_STEPS`` steps in a row goes first, so a long prompt still advances under a stream of
        short ones. New prompts are admitted in this order until one cannot be (slots or blocks)."""
        budget = self.limits.prefill_chunk_size
        prefill: list[Scheduled] = []
        waiting = self.waiting[:LOOKAHEAD] if may_admit else []
        left = {id(s): s.num_uncomputed for s in self.running if s.is_prefilling}
        left.update({id(s): len(s) - self.blocks.cached_tokens(s) for s in waiting})
        candidates = [s for s in self.running if s.is_prefilling] + waiting
        candidates.sort(key=lambda s: (s.priority, s.passed_over < STARVING_STEPS, left[id(s)], s.order))
        admitting = True
        for seq in candidates:
            if budget <= 0 or len(prefill) >= self.limits.max_prefill_batch_size:
                break
            if seq.status is Status.WAITING:
                if not admitting or not self._admit(seq):
                    admitting = False
                    continue
            piece = self._piece(seq, budget)
            if piece:
                prefill.append(Scheduled(seq, piece, self.limits.prefill_chunk_size))
                budget -= piece
        chosen = {id(item.seq) for item in prefill}
        for seq in candidates:
            seq.passed_over = 0 if id(seq) in chosen else seq.passed_over + 1
        return prefill

    def _piece(self, seq: Sequence, budget: int) -> int:
        """The sequence's next prompt piece within ``budget`` tokens (0: none fits): whole segments between
        multiples of prefillChunkSize from position 0 (the first from where its computed or cached part
        ends), the last one possibly the prompt's end. Fixed boundaries make a prompt's K/V, and in bfloat16
        its tokens, the same whatever shares its steps or came from the prefix cache: the attention of each
        segment is computed as if it were a step of its own (``Scheduled.segment``), so a prefix-cache hit
        whose new tokens cross a boundary still takes one step."""
        size = self.limits.prefill_chunk_size
        piece = min(seq.num_uncomputed, size - seq.num_computed % size)
        if piece > budget:
            return 0
        while piece < seq.num_uncomputed:
            more = min(size, seq.num_uncomputed - piece)
            if piece + more > budget:
                break
            piece += more
        return piece

    def _admit(self, seq: Sequence) -> bool:
        """Move a waiting sequence to running with its blocks, if a slot and blocks allow."""
        if len(self.running) >= self.limits.max_batch_size:
            return False
        reserve = self._tokens_to_reserve(seq)
        if not self.blocks.can_allocate(seq, reserve):
            return False
        self.waiting.remove(seq)
        self.blocks.allocate(seq, reserve)
        self.on_admit(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _tokens_to_reserve(self, seq: Sequence) -> int:
        """With preemption on, blocks for the prompt; off, for the longest the sequence may grow."""
        if self.limits.max_preempt_count > 0:
            return len(seq)
        longest = seq.num_prompt_tokens + seq.sampling.max_new_tokens
        return max(len(seq), min(longest, self.limits.max_seq_len))

    def _schedule_decode(self) -> list[Scheduled]:
        """One token for each decoding sequence, preempting (up to maxPreemptCount) for blocks."""
        scheduled: list[Scheduled] = []
        budget = self.limits.max_preempt_count
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier one
            while not self.blocks.can_append(seq):
                if budget == 0:
                    break  # waits for blocks freed by finishing sequences
                budget -= 1
                victim = self._pick_victim()
                self.preempt(victim)
                scheduled = [item for item in scheduled if item.seq is not victim]
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
                scheduled.append(Scheduled(seq, 1))
        return scheduled

    def computed(self, items: list[Scheduled]) -> None:
        """The model ran ``items``: their tokens' K/V are in the cache now, and full blocks are
        cached for later prompts. Call before ``postprocess`` (which appends sampled tokens).
        A sequence ended meanwhile (its step failed for it) holds no blocks and is skipped."""
        for item in items:
            if item.seq.status is Status.RUNNING:
                start = item.seq.num_computed
                item.seq.num_computed += item.num_tokens
                self.blocks.cache_computed(item.seq, start)

    def _pick_victim(self) -> Sequence:
        """The lowest-priority, newest running sequence."""
        return max(self.running, key=lambda s: s.sort_key)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks (num_computed back to 0); it waits and is recomputed from its
        tokens later, less whatever prefix the cache still holds then."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Finish]:
        """Append each sampled token; the sequences that are done now and why (the engine ends them)."""
        finished: list[Finish] = []
        for seq, token_id in zip(seqs, token_ids):
            seq.append(token_id)
            reason = self.finish_reason(seq, token_id)
            if reason:
                finished.append(Finish(seq, reason))
        return finished

    def finish_reason(self, seq: Sequence, token_id: int, length: int | None = None) -> FinishReason | None:
        """Why ``seq`` ends at ``token_id``, the token that makes it ``length`` tokens long (default: its last)."""
        length = len(seq) if length is None else length
        if token_id in seq.sampling.stop_token_ids or (not seq.sampling.ignore_eos and token_id in self.eos_token_ids):
            return FinishReason.EOS_TOKEN  # (ignore_eos skips the model's EOS only: the client's stop ids still end it)
        if length - seq.num_prompt_tokens >= seq.sampling.max_new_tokens or length >= self.limits.max_seq_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and give its blocks back: the one place a sequence leaves
        the registry (``Engine._release`` is its only caller)."""
        self.seqs.pop(seq.id, None)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        if seq.status is not Status.FINISHED:
            seq.status = Status.FINISHED
            self.on_finish(seq)
