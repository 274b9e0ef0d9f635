"""The engine: a pure ``step()`` — schedule, run the model, sample, postprocess.

Requests and cancels arrive from any thread through a thread-safe inbox and take effect at the
start of the next step, so the NATS loop never waits on the model.

One request never harms another: the model pass and sampling change no sequence, so when they
raise, ``isolation.run_isolated`` runs the batch again in halves until only the requests that make
it raise remain; those end with an internal error and the rest go on with the tokens they would
have produced alone.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from llguidance import LLMatcher

from services.engine import ahead
from services.engine.block_manager import BlockManager, blocks_for
from services.engine.grammar import Constraints, apply_masks, left_grammar
from services.engine.host_tier import HostTier
from services.engine.isolation import Outcome, run_isolated
from services.engine.kv_transfer import KvImport
from services.engine.model_runner import ModelRunner
from services.engine.multimodal import salts
from services.engine.pd import Handoff, KvHandoff
from services.engine.prompt_logprobs import prompt_logprobs, prompt_rows
from services.engine.sampler import raw_logprobs, sample, token_logprob
from services.engine.scheduler import Finish, Limits, Scheduled, Scheduler
from services.engine.sequence import Sequence, Status
from shared.errors import ErrorInfo, ErrorKind
from shared.messages import CancelKind, EngineRequest, FinishReason, TokenEvent, TokenLogprob

log = logging.getLogger("switchboard.engine")


@dataclass
class Stats:
    """Counters since start, and queue times not yet reported."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    queue_times: list[float] = field(default_factory=list)

    def take_queue_times(self) -> list[float]:
        taken, self.queue_times = self.queue_times, []
        return taken


@dataclass(frozen=True)
class Drawn:
    """One sequence's sampled token of a step, not yet applied to it."""

    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Computed:
    """One item's result of a step, not yet applied to its sequence: the token drawn (None for a prompt
    chunk that does not end the known tokens) and the prompt logprobs the chunk computed, by position."""

    drawn: Drawn | None = None
    prompt: dict[int, TokenLogprob] | None = None


@dataclass(frozen=True)
class _Abort:
    id: str
    reason: CancelKind


@dataclass(frozen=True)
class _Received:
    """A handed-off request arriving at this (decode) engine with its prompt's K/V."""

    request: EngineRequest
    kv: KvImport | None


@dataclass(frozen=True)
class _Constrained:
    """A request with the matcher of its grammar, built off the step (``Constraints.matcher``), or the error
    building it raised."""

    request: EngineRequest
    matcher: LLMatcher | Exception


class Engine:
    def __init__(self, runner: ModelRunner, limits: Limits, eos_token_ids: set[int], prefix_cache: bool = False,
                 host_blocks: int = 0, steps_ahead: bool = False):
        """``steps_ahead``: launch decode steps whose tokens are drawn on the device before the last one's tokens
        are read back (``ahead.py``; needs the runner's decode graphs)."""
        self.runner = runner
        tier = HostTier(runner.kv, runner.block_size, host_blocks) if prefix_cache and host_blocks > 0 else None
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_cache=prefix_cache, tier=tier)
        self.kv = KvHandoff(runner, self.blocks)  # PD disaggregation, at its three points (pd.py)
        self.scheduler = Scheduler(limits, self.blocks, eos_token_ids, on_finish=self._release_adapter,
                                   on_admit=self.kv.on_allocated)
        self.inbox: queue.SimpleQueue[EngineRequest | _Abort | _Received | _Constrained] = queue.SimpleQueue()
        self.stats = Stats()
        self.held_until: float | None = None  # set by a step that held a small first batch back
        self.constraints = Constraints(runner.path, runner.model.lm_head.out_features)
        vocab_fits = runner.model.lm_head.out_features <= runner.model.model.embed_tokens.num_embeddings
        self.ahead = ahead.StepsAhead(runner.graphs) if steps_ahead and runner.graphs and vocab_fits else None

    # ---- called from any thread -------------------------------------------------------------

    def add_request(self, req: EngineRequest, matcher: LLMatcher | Exception | None = None) -> None:
        """``matcher``: its grammar's, built already (or why it could not be); else the step builds it."""
        self.inbox.put(req if matcher is None else _Constrained(req, matcher))

    def add_handoff(self, req: EngineRequest, kv: KvImport | None) -> None:
        """A request a prefill engine handed over: ``req.generated_ids`` holds its first token, ``kv`` its
        prompt's K/V (None, or K/V that do not fit this engine: its prompt is recomputed instead)."""
        self.inbox.put(_Received(req, kv))

    def cached_blocks(self, req: EngineRequest) -> int:
        """How many leading blocks of a handed-over request this engine holds now (``KvHandoff.cached_blocks``)."""
        return self.kv.cached_blocks(req)

    def take_handoffs(self) -> list[Handoff]:
        """Prefill role: the requests ready for a decode engine since the last call (taken by the service)."""
        return self.kv.take()

    def abort(self, request_id: str, reason: CancelKind = CancelKind.CANCELLED) -> None:
        self.inbox.put(_Abort(request_id, reason))

    @property
    def seqs(self) -> dict[str, Sequence]:
        """Every sequence not yet ended, by request id (the scheduler's registry; read it, never change it)."""
        return self.scheduler.seqs

    @property
    def has_work(self) -> bool:
        return not self.inbox.empty() or not self.scheduler.is_idle or self._in_flight

    @property
    def _in_flight(self) -> bool:
        return self.ahead is not None and self.ahead.flight is not None

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        events = self._drain_inbox()
        now = time.time()
        events += self._expire(now)
        self.held_until = self.scheduler.hold_until(now)
        items = self.scheduler.schedule() if self.held_until is None else []
        if self.ahead is not None:
            if self.ahead.takes(items):
                return events + self._land(self.ahead.launch(items))
            if self.ahead.flight is not None:  # this step needs the tokens on the host first
                events += self._land(self.ahead.take())
                items = [item for item in items if item.seq.status is Status.RUNNING]
        if not items:
            return events
        started = time.time()
        outcome = run_isolated(self.forward, items)
        events += self._end_failed(outcome)
        ran = [item for item, _ in outcome.results]
        self._count(ran, started)
        self.scheduler.computed(ran)
        for item, result in outcome.results:
            if result.prompt:
                item.seq.prompt_logprobs.update(result.prompt)
        drawn = [(item.seq, result.drawn) for item, result in outcome.results if result.drawn is not None]
        if drawn:
            events += self._advance(drawn)
        return events

    def forward(self, items: list[Scheduled]) -> list[Computed]:
        """The model pass and sampling for ``items``: a token for each item that completes its
        sequence's known tokens (none for a prompt chunk), and the logprobs of the prompt tokens a chunk
        computes when its request asked for them. No side effect on the sequences, so it is safe to run
        again."""
        sampling = [item.seq for item in items if item.samples]
        wanted = prompt_rows(items)
        constrained = [i for i, seq in enumerate(sampling) if seq.matcher is not None]
        masks = self.constraints.masks([sampling[i].matcher for i in constrained]) if constrained else None
        logits, hidden = self.runner.run(items, [row for _, row, _ in wanted] or None)  # the masks meanwhile
        drawn = iter(self._draw(logits, sampling, constrained, masks)) if sampling else iter(())
        prompt = prompt_logprobs(self.runner.model.lm_head, items, wanted, hidden) if wanted else {}
        return [Computed(next(drawn) if item.samples else None, prompt.get(i)) for i, item in enumerate(items)]

    def _draw(self, logits, seqs: list[Sequence], constrained: list[int], masks) -> list[Drawn]:
        """Sample each row; logprobs are the model's raw ones, taken before a grammar masks its row."""
        logprob_rows = raw_logprobs(logits, seqs)
        if constrained:
            logits = apply_masks(logits, constrained, masks.result())
        token_ids = sample(logits, seqs)
        return [Drawn(token_id, token_logprob(logprob_rows[i], token_id, seq.sampling.logprobs)
                      if i in logprob_rows else None)
                for i, (seq, token_id) in enumerate(zip(seqs, token_ids))]

    def _advance(self, results: list[tuple[Sequence, Drawn]]) -> list[TokenEvent]:
        """Append each drawn token, finish the sequences that are done, and say so."""
        ran = [seq for seq, _ in results]
        finished = {f.seq.id: f.reason for f in self.scheduler.postprocess(ran, [d.token_id for _, d in results])}
        self._hand_off([seq for seq in ran if seq.handoff and seq.id not in finished and seq.num_generated == 1])
        now = time.time()
        events = []
        for seq, drawn in results:
            seq.last_event_at = now
            reason = finished.get(seq.id)
            if seq.matcher is not None and not reason and not seq.matcher.consume_token(drawn.token_id):
                error = left_grammar(seq.matcher, drawn.token_id, seq.sampling.grammar)
                events.append(self._end(seq, FinishReason.ERROR, error))
                continue
            event = TokenEvent(seq.id, [drawn.token_id], None, position=seq.num_generated - 1)
            if drawn.logprob is not None:
                event.logprobs = [drawn.logprob]
            if event.position == 0:
                event.cached_tokens = seq.cached_tokens or 0
            if seq.wants_prompt_logprobs and event.position == 0:
                event.prompt_logprobs = [seq.prompt_logprobs.get(p) for p in range(len(seq.prompt_ids))]
                seq.wants_prompt_logprobs, seq.prompt_logprobs = False, {}  # sent: a recompute need not redo them
            events.append(self._end(seq, reason, event=event) if reason else event)
        return events

    def _land(self, flight: ahead.Flight | None) -> list[TokenEvent]:
        """A step launched ahead: its tokens read back and applied as ``_advance`` applies drawn ones (``ahead.py``)."""
        if flight is None:
            return []
        now, events = time.time(), []
        for seq, index, token, logprob in ahead.land(flight, self.seqs):
            self.stats.generation_tokens += 1
            seq.last_event_at = now
            reason = self.scheduler.finish_reason(seq, token, length=index + 1)
            if reason:  # a newer flight's row of it, if any, is dropped when that lands
                del seq.token_ids[index + 1:]
                seq.num_computed = min(seq.num_computed, index)
            self.blocks.cache_computed(seq, index - 1)  # the blocks its known tokens filled
            event = TokenEvent(seq.id, [token], None, position=index - seq.num_prompt_tokens)
            if logprob is not None:
                event.logprobs = [logprob]
            events.append(self._end(seq, reason, event=event) if reason else event)
        return events

    def _end(self, seq: Sequence, reason: FinishReason, error: ErrorInfo | None = None,
             event: TokenEvent | None = None) -> TokenEvent:
        """The one way a request ends here, whatever the cause: its sequence is released and its final
        event (``event``, its last token, or one with no token) says why."""
        self._release(seq)
        if event is None:
            return TokenEvent(seq.id, [], reason, error)
        event.finish_reason, event.error = reason, error
        return event

    def _release(self, seq: Sequence) -> None:
        """Free everything a sequence holds: it leaves the scheduler (blocks and adapter slot back), and its
        grammar matcher and handoff state go. Ending it, or handing it off (it goes on elsewhere)."""
        self.scheduler.finish(seq)
        seq.matcher = seq.request = seq.kv_import = None

    def _hand_off(self, seqs: list[Sequence]) -> None:
        """Prefill role: each of ``seqs`` has its prompt's K/V and its first token; they go to a decode engine
        (``KvHandoff.on_prompt_done``) and the sequence ends here (its first token is still reported)."""
        for seq in seqs:
            self.kv.on_prompt_done(seq)
            self._release(seq)

    def _end_failed(self, outcome: Outcome[Computed]) -> list[TokenEvent]:
        """End each request the step fails for, alone, with an internal error; free its blocks."""
        events = []
        for item, exc in outcome.failures:
            seq = item.seq
            log.warning("request ended: the engine step fails for it", exc_info=exc, extra={
                "request_id": seq.id, "phase": "decode" if seq.num_computed == len(seq) - 1 else "prefill",
                "error": repr(exc)})
            error = ErrorInfo(ErrorKind.INTERNAL, f"engine failure for this request: {type(exc).__name__}: {exc}")
            events.append(self._end(seq, FinishReason.ERROR, error))
        return events

    def _count(self, items: list[Scheduled], started: float) -> None:
        """Tokens computed and sampled, and for a first run the queue time up to ``started``."""
        for item in items:
            seq = item.seq
            if item.samples:
                self.stats.generation_tokens += 1
            if seq.num_computed < len(seq) - 1:  # prompt work (a resumed request's tokens included)
                self.stats.prompt_tokens += item.num_tokens
            if seq.scheduled_at is None:
                seq.scheduled_at = started
                if seq.arrival:
                    self.stats.queue_times.append(max(0.0, started - seq.arrival))

    def _drain_inbox(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            if isinstance(item, _Abort):
                events += self._abort_now(item)
            elif isinstance(item, _Received):
                events += self._admit(item.request, item.kv)
            elif isinstance(item, _Constrained):
                events += self._admit(item.request, matcher=item.matcher)
            else:
                events += self._admit(item)
        return events

    def _admit(self, req: EngineRequest, kv: KvImport | None = None,
               matcher: LLMatcher | Exception | None = None) -> list[TokenEvent]:
        longest = min(len(req.prompt_ids) + req.sampling.max_new_tokens, self.scheduler.limits.max_seq_len)
        needed = blocks_for(max(len(req.prompt_ids) + 1, longest), self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            error = ErrorInfo(ErrorKind.GENERATION, f"the request needs up to {needed} KV-cache blocks but the pool holds "
                                                    f"{self.blocks.num_blocks}; raise Switchboard.kvCacheMemoryMb")
            return [TokenEvent(req.id, [], FinishReason.ERROR, error)]
        if req.media is not None and not self.runner.modalities:
            error = ErrorInfo(ErrorKind.VALIDATION, "the served model is text-only: it takes no media")
            return [TokenEvent(req.id, [], FinishReason.ERROR, error)]
        slot = self.runner.lora.acquire(req.adapter) if req.adapter else None
        if req.adapter and slot is None:
            error = ErrorInfo(ErrorKind.NOT_FOUND, f"LoRA adapter '{req.adapter}' is not loaded")
            return [TokenEvent(req.id, [], FinishReason.ERROR, error)]
        seq = Sequence(req.id, req.prompt_ids, req.sampling, priority=req.priority, deadline=req.deadline,
                       deadline_reason=req.deadline_reason, last_event_at=time.time(),
                       arrival=0.0 if req.probe else req.arrival, lora=slot)  # (a probe's queue time is not counted)
        seq.media = req.media
        found = salts(req, self.runner.media_token_ids, self.blocks.block_size)
        seq.more_salt, seq.media_from, seq.media_salt = found.more, found.media_from, found.media
        if req.sampling.grammar is not None:
            try:
                seq.matcher = self._matcher(req, matcher)
            except (ValueError, RuntimeError) as exc:
                if slot is not None:
                    self.runner.lora.release(slot)
                error = ErrorInfo(ErrorKind.VALIDATION, str(exc), req.sampling.grammar.field or None) \
                    if isinstance(exc, ValueError) else ErrorInfo(ErrorKind.INTERNAL, str(exc))
                return [TokenEvent(req.id, [], FinishReason.ERROR, error)]
        # a prompt with media stays: its decode needs what the encoder computed (Qwen2-VL's rope delta)
        seq.kv_import = kv
        seq.wants_prompt_logprobs = req.sampling.prompt_logprobs is not None and not req.generated_ids
        seq.handoff = req.handoff and not req.generated_ids and req.media is None
        seq.request = req if seq.handoff else None  # only a handoff needs it; others would pin their media
        seq.token_ids.extend(req.generated_ids)  # resumed: its first prefill recomputes their cache too
        self.scheduler.add(seq)
        return []

    def _matcher(self, req: EngineRequest, built: LLMatcher | Exception | None) -> LLMatcher:
        if isinstance(built, Exception):
            raise built
        return built if built is not None else self.constraints.matcher(req.sampling.grammar, req.generated_ids)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.runner.lora.release(seq.lora)

    def fail_all(self, message: str) -> list[TokenEvent]:
        """Last resort: end every request with an internal error (a step raised outside the per-request
        part, which ``run_isolated`` guards); the engine keeps serving."""
        error = ErrorInfo(ErrorKind.INTERNAL, message)
        if self.ahead is not None:
            self.ahead.take()  # its tokens are lost with the requests
        return [self._end(seq, FinishReason.ERROR, error) for seq in list(self.seqs.values())]

    def _abort_now(self, item: _Abort) -> list[TokenEvent]:
        seq = self.seqs.get(item.id)
        return [] if seq is None else [self._end(seq, FinishReason.CANCELLED)]

    def _expire(self, now: float) -> list[TokenEvent]:
        """End requests past their deadline or silent for tokenTimeout."""
        events = []
        for seq in list(self.seqs.values()):
            reason = self._timeout_reason(seq, now)
            if reason:
                error = ErrorInfo(ErrorKind.TIMEOUT, f"Engine callback timeout: {reason}")
                events.append(self._end(seq, FinishReason.ERROR, error))
        return events

    def _timeout_reason(self, seq: Sequence, now: float) -> str | None:
        if seq.deadline is not None and seq.deadline <= now:
            return seq.deadline_reason
        if now - seq.last_event_at > self.scheduler.limits.token_timeout_s:
            return "server tokenTimeout"
        return None

    # ---- state for health and heartbeats ----------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self.inbox.qsize()


__all__ = ["Engine", "Finish", "Limits"]

