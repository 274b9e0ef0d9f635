"""Iteration-level scheduling: who runs in the next step, and what finishing means."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_prefill_batch_size: int
    max_prefill_tokens: int
    max_seq_len: int
    token_timeout_s: float = float("inf")
    max_preempt_count: int = 0  # preemptions allowed per step; 0 = off: admission reserves whole sequences
    max_queue_delay_s: float = 0.0  # an idle engine waits this long for a fuller first prefill batch


@dataclass
class Finish:
    seq: Sequence
    reason: str  # length | eos_token | cancelled | timeout


class Scheduler:
    def __init__(self, limits: Limits, blocks: BlockManager, eos_token_ids: set[int]):
        self.limits = limits
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
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

    def schedule(self) -> tuple[list[Sequence], bool]:
        """New prompts first (prefill); otherwise one decode step for every running sequence."""
        prefill = self._schedule_prefill()
        if prefill:
            return prefill, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        lim = self.limits
        while self.waiting and len(scheduled) < lim.max_prefill_batch_size:
            if len(self.running) >= lim.max_batch_size:
                break
            seq = self.waiting[0]
            if scheduled and num_tokens + len(seq) > lim.max_prefill_tokens:
                break
            reserve = self._tokens_to_reserve(seq)
            if not self.blocks.can_allocate(reserve):
                break
            self.waiting.pop(0)
            self.blocks.allocate(seq, reserve)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            num_tokens += len(seq)
        return scheduled

    def _tokens_to_reserve(self, seq: Sequence) -> int:
        """With preemption on, blocks for the prompt; off, for the longest the sequence may grow."""
        if self.limits.max_preempt_count > 0:
            return len(seq)
        longest = seq.num_prompt_tokens + seq.sampling.max_new_tokens
        return max(len(seq), min(longest, self.limits.max_seq_len))

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.limits.max_preempt_count
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier one
            while not self.blocks.can_append(seq):
                if budget == 0:
                    break  # waits for blocks freed by finishing sequences
                budget -= 1
                victim = self._pick_victim()
                self.preempt(victim)
                if victim in scheduled:
                    scheduled.remove(victim)
                if victim is seq:
                    break
            else:
                self.blocks.may_append(seq)
                scheduled.append(seq)
        return scheduled

    def _pick_victim(self) -> Sequence:
        """The lowest-priority, newest running sequence."""
        return max(self.running, key=lambda s: s.sort_key)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it waits and is recomputed from its tokens later."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Finish]:
        finished: list[Finish] = []
        for seq, token_id in zip(seqs, token_ids):
            seq.append(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason:
                finished.append(self.finish(seq, reason))
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        if not seq.sampling.ignore_eos and (token_id in self.eos_token_ids or token_id in seq.sampling.stop_token_ids):
            return "eos_token"
        if seq.num_generated >= seq.sampling.max_new_tokens or len(seq) >= self.limits.max_seq_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> Finish:
        """Remove a sequence wherever it is and give its blocks back."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        return Finish(seq, reason)
