"""The tokenizer service: encode requests for the engine, turn token events into text events.

Scales out as a queue group on the generate subject; each instance owns the requests it encoded
and receives their token events on its own inbox. It routes each request to the least loaded live
engine (``routing.py``), says it is alive in heartbeats, and drops (and cancels) the requests of a
gateway whose lease ran out. A request may arrive resumed (``resume_ids``: the tokens its client
already has, after an engine, a tokenizer or a message was lost): the detokenizer state is rebuilt
from them, and the engine recomputes their cache.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg as NatsMsg

from services.tokenizer.detokenizer import IncrementalDecoder, StopMatcher, next_text, token_texts
from services.tokenizer import counting
from services.tokenizer import messages_out as outgoing
from services.tokenizer.encoder import (
    check_media_prompt, check_request_ids, encode_prompt, load_tokenizer, too_large, with_sampling_ids,
)
from services.tokenizer.media.multimodal import MediaProcessor
from services.tokenizer.cache_sync import CacheFollower
from services.tokenizer.routing import Choice, EngineRouter
from services.tokenizer.token_bytes import TokenBytes
from shared import bus, subjects, telemetry
from shared.config import Config
from shared.errors import ErrorInfo, ErrorKind, SwitchboardError
from shared.leases import Leases
from shared.media import MediaPolicy
from shared.messages import (
    Cancel, CancelKind, Detokenize, EngineInfo, Failed, FinishReason, GenerateRequest, Heartbeat,
    MediaInputs, Output, TokenBatch, TokenEvent, Tokenize, TokenizerInfo, TokenOut,
    decoder,
)
from shared.tombstones import Tombstones
from shared.aio import within

log = logging.getLogger("switchboard.tokenizer")


@dataclass
class Pending:
    """What this instance tracks for one request between engine and gateway."""

    request: GenerateRequest
    decoder: IncrementalDecoder
    stops: StopMatcher
    span: Any = None  # this service's span of the request's trace
    generated: int = 0
    engine: str = ""  # the engine serving it now (a decode engine after a handoff)
    moved: bool = False  # a prefill engine handed it to ``engine``: this instance watches that engine
    moved_at: float = 0.0  # monotonic time it heard so
    prompt_ids: list[int] = field(default_factory=list)  # kept when its prompt logprobs were asked


class TokenizerService:
    def __init__(self, cfg: Config, nc, tokenizer, media: MediaProcessor | None = None):
        self.cfg = cfg
        self.nc = nc
        self.tok = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.media = media or MediaProcessor(None)
        self.media_policy = MediaPolicy.from_config(cfg)
        self.model = cfg.model.model_name
        self.instance = uuid.uuid4().hex[:12]
        self.inbox = subjects.tokens_inbox(self.instance)
        sc = cfg.schedule
        self.router = EngineRouter(cfg.switchboard.lease_seconds, cfg.switchboard.routing,
                                   sc.cache_block_size if sc.enable_prefix_cache else 0)
        self.caches = CacheFollower(nc, self.model, self.instance, self.router.caches, cfg.switchboard.lease_seconds)
        self.gateways: Leases[Heartbeat] = Leases(cfg.switchboard.lease_seconds)
        self.pending: dict[str, Pending] = {}
        self.cancelled = Tombstones()  # cancels that came before their request
        self.vocab_size = len(tokenizer)
        self.requests = decoder(GenerateRequest)
        self.batches = decoder(TokenBatch)
        self.cancels = decoder(Cancel)
        self.tokenizes = decoder(Tokenize)
        self.detokenizes = decoder(Detokenize)
        self.engine_beats = decoder(EngineInfo)
        self.beats = decoder(Heartbeat)
        self.view_since = time.monotonic()  # since when the engines' leases here are heard first-hand
        self.reconnects = 0
        self.tasks: set[asyncio.Task] = set()  # requests being encoded and routed, tokenize requests with media

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.TOKENIZER_GENERATE, self.on_request, queue=subjects.TOKENIZER_QUEUE)
        await bus.subscribe(self.nc, subjects.TOKENIZER_HEALTH, self.on_health, queue=subjects.TOKENIZER_QUEUE)
        await bus.subscribe(self.nc, subjects.TOKENIZER_TOKENIZE, self.on_tokenize, queue=subjects.TOKENIZER_QUEUE)
        await bus.subscribe(self.nc, subjects.TOKENIZER_DETOKENIZE, self.on_detokenize, queue=subjects.TOKENIZER_QUEUE)
        await bus.subscribe(self.nc, subjects.tokenizer_instance(self.instance), self.on_request)
        await bus.subscribe(self.nc, self.inbox, self.on_tokens)
        await bus.subscribe(self.nc, subjects.CANCEL, self.on_cancel)
        await bus.subscribe(self.nc, subjects.engine_heartbeat(self.model), self.on_engine_heartbeat)
        if self.router.by_cache:
            await self.caches.start()
        await bus.subscribe(self.nc, subjects.heartbeat("gateway"), self.on_gateway_heartbeat)

    # ---- liveness ---------------------------------------------------------------------------

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Say this instance is alive four times per lease; drop the requests of dead gateways."""
        beat = Heartbeat(service="tokenizer", instance=self.instance, model=self.model)
        while not stop.is_set():
            self.note_reconnects()
            await bus.publish(self.nc, subjects.heartbeat("tokenizer"), beat)
            await self.drop_orphans()
            await self.resume_lost_handoffs()
            try:
                await within(stop.wait(), self.cfg.switchboard.heartbeat_s)
            except asyncio.TimeoutError:
                pass

    def note_reconnects(self) -> None:
        """A bus that came back may have missed heartbeats: the view of the engines starts over then."""
        reconnects = self.nc.stats.get("reconnects", 0)
        if reconnects != self.reconnects:
            self.reconnects, self.view_since = reconnects, time.monotonic()

    def engine_patience(self) -> float:
        """How long a request waits for an engine when none is live. Just after this instance started or its
        bus came back, every lease may have run out while the engines were fine: up to a lease, for their
        heartbeats. Otherwise this view is current, and the gateway's is the same within a heartbeat: one
        heartbeat interval (a heartbeat in flight), so that a request admitted as the last engine died is
        refused at once instead of a lease later."""
        self.note_reconnects()
        sb = self.cfg.switchboard
        return sb.lease_seconds if time.monotonic() - self.view_since < 2 * sb.lease_seconds else sb.heartbeat_s

    async def on_engine_heartbeat(self, msg: NatsMsg) -> None:
        info = self.engine_beats.decode(msg.data)
        if self.router.heartbeat(info):
            self.caches.sync(info.instance)

    async def on_gateway_heartbeat(self, msg: NatsMsg) -> None:
        beat = self.beats.decode(msg.data)
        self.gateways.beat(beat.instance, beat)

    async def drop_orphans(self) -> None:
        """A gateway whose lease ran out has no client to answer: end its requests here and in the engine."""
        dead = set(self.gateways.expire())
        for request_id in [i for i, state in self.pending.items() if state.request.gateway in dead]:
            await self._end(request_id, cancel=CancelKind.GATEWAY_GONE, **{"switchboard.finish_reason": "gateway gone"})

    async def resume_lost_handoffs(self) -> None:
        """A decode engine that took a request over died (its lease ran out): the gateway, which watches
        the engine it was told of (the prefill engine), would not notice; end the attempt here as
        retryable, so the gateway resumes the request from what its client has."""
        engines = self.router.engines
        for state in [s for s in self.pending.values() if s.moved and engines.is_gone(s.engine, s.moved_at)]:
            req = state.request
            await self._end(req.id, f"decode engine {state.engine} died", CancelKind.ENGINE_GONE)
            error = ErrorInfo(ErrorKind.UNAVAILABLE, f"decode engine {state.engine} died")
            await bus.publish(self.nc, req.reply_to, Failed(id=req.id, error=error, retryable=True))

    # ---- requests ---------------------------------------------------------------------------

    async def on_request(self, msg: NatsMsg) -> None:
        """Each request is a task of its own: one whose media are fetched (a server that never answers holds it
        up to mediaRequestTimeoutSeconds) or whose long prompt is encoded holds no other, as it would in this
        callback (a subscription's callbacks run one at a time)."""
        req = self.requests.decode(msg.data)
        if req.id not in self.cancelled:  # else its client is gone already
            self._spawn(self.take(req))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def take(self, req: GenerateRequest) -> None:
        """Encode the request, choose its engine, tell its gateway so, and send it there."""
        span = telemetry.start_span("tokenizer.request", req.trace, **{"switchboard.request_id": req.id,
                                                                        "switchboard.adapter": req.adapter})
        try:
            started = time.perf_counter()
            ids, media = await self.encode(req)
            req = with_sampling_ids(self.tok, req, self.vocab_size)
            span.set_attribute("switchboard.prompt_tokens", len(ids))
            if media is not None:  # fetching, decoding and the processor, for the trace
                span.set_attribute("switchboard.media_items", sum(p.media is not None for p in req.parts))
                span.set_attribute("switchboard.media_prepare_ms", round((time.perf_counter() - started) * 1000, 1))
            keys = None if req.sampling.prompt_logprobs is not None else self.router.prefix_keys(  # (its logprobs:
                req.adapter, ids, media.digest if media is not None else "", req.cache_salt,  # whole)
                self.media.first_media_token(ids) if media is not None else 0)
            choice = await self.choose_engine(req.adapter, keys)
            engine = choice.engine
        except SwitchboardError as exc:
            telemetry.end_span(span, exc.message)
            await bus.publish(self.nc, req.reply_to, Failed(id=req.id, error=exc.info))
            return
        except Exception as exc:  # noqa: BLE001 - a bug here ends this request, not the service (nor a hang)
            log.exception("encoding a request failed", extra={"request_id": req.id})
            telemetry.end_span(span, repr(exc))
            error = ErrorInfo(ErrorKind.INTERNAL, f"the tokenizer could not encode the request: {exc!r}")
            await bus.publish(self.nc, req.reply_to, Failed(id=req.id, error=error))
            return
        if req.id in self.cancelled:  # while it was encoded: its gateway asks no more
            telemetry.end_span(span, **{"switchboard.finish_reason": "cancelled"})
            return
        seed = req.sampling.seed if req.sampling.seed is not None else random.randint(1, 2**31 - 1)
        self.pending[req.id] = self.pending_state(req, ids, span)
        await bus.publish(self.nc, req.reply_to, outgoing.started(self.tok, self.instance, req, ids, seed, engine))
        engine_request = outgoing.engine_request(self.cfg, self.instance, self.inbox, req, ids, seed, media)
        engine_request.trace = telemetry.inject(span)
        engine_request.handoff = media is None and not req.adapter and self.router.hands_off(engine)
        engine_request.pull_from = choice.pull_from
        await self.routed(span, len(ids), choice)
        self.pending[req.id].engine = engine
        if media is not None and (error := too_large(engine_request, self.nc.max_payload)):
            await self._end(req.id, error.message)
            await bus.publish(self.nc, req.reply_to, Failed(id=req.id, error=error))
            return
        await bus.publish(self.nc, subjects.engine_instance(req.model, engine), engine_request)

    async def routed(self, span, prompt_tokens: int, choice: Choice) -> None:
        """The decision on the request's span and in the metrics."""
        event = self.router.routed(self.model, prompt_tokens, choice)
        span.set_attribute("switchboard.engine", choice.engine)
        span.set_attribute("switchboard.expected_hit_tokens", event.hit_tokens)
        if choice.pull_from:
            span.set_attribute("switchboard.pull_from", choice.pull_from)
        await bus.publish(self.nc, subjects.METRICS_EVENTS, event)

    async def choose_engine(self, adapter: str = "", keys: list[bytes] | None = None) -> Choice:
        """The least loaded live engine (one with the LoRA ``adapter``, when one is named). When none is live,
        wait ``engine_patience()`` for one to be heard, then raise UNAVAILABLE. When engines serve but none
        lists the adapter, raise NOT_FOUND after one heartbeat interval: the gateway admitted it on a heartbeat
        listing it, which may reach this process a moment later."""
        start = time.monotonic()
        deadline = start + self.engine_patience()
        while (choice := self.router.choose(adapter, keys)) is None:
            if adapter and self.router.serving() and time.monotonic() - start >= self.cfg.switchboard.heartbeat_s:
                raise SwitchboardError(ErrorKind.NOT_FOUND, f"LoRA adapter '{adapter}' is not loaded")
            if time.monotonic() >= deadline:
                raise SwitchboardError(ErrorKind.UNAVAILABLE, f"no engine is serving model {self.model}")
            await asyncio.sleep(0.05)
        return choice

    def pending_state(self, req: GenerateRequest, ids: list[int], span) -> Pending:
        """A new request's detokenizer state; a resumed one's rebuilt from the tokens its client has."""
        stops = StopMatcher(req.sampling.stop, req.sampling.include_stop_str_in_output)
        state = Pending(req, IncrementalDecoder(self.tok, ids, req.sampling.skip_special_tokens), stops, span)
        if req.sampling.prompt_logprobs is not None:
            state.prompt_ids = ids
        for token_id in req.resume_ids:
            state.stops.feed(state.decoder.add(token_id), False)
        state.generated = len(req.resume_ids)
        return state

    async def encode(self, req: GenerateRequest) -> tuple[list[int], MediaInputs | None]:
        """The prompt's token ids, and for a request with media the processor's tensors."""
        if any(part.media is not None for part in req.parts):
            left = req.arrival + req.timeout_s - time.time() if req.timeout_s and req.arrival else req.timeout_s
            prepared = await self.media.prepare(req, self.tok, self.media_policy, left)
            return check_media_prompt(prepared.ids, req, self.cfg.deploy), prepared.media
        return await self.encode_text(req), None

    async def encode_text(self, req: GenerateRequest) -> list[int]:
        check_request_ids(req, self.vocab_size)
        if len(req.prompt) > 2048 or req.messages is not None:  # long texts, chat templates: keep the loop free
            return await asyncio.to_thread(encode_prompt, self.tok, req, self.cfg.deploy)
        return encode_prompt(self.tok, req, self.cfg.deploy)

    # ---- token events -----------------------------------------------------------------------

    async def on_tokens(self, msg: NatsMsg) -> None:
        batch = self.batches.decode(msg.data)
        for request_id, engine in batch.moved.items():
            state = self.pending.get(request_id)
            if state is not None:
                state.engine, state.moved, state.moved_at = engine, True, self.router.engines.clock()
        for event in batch.events:
            state = self.pending.get(event.id)
            if state is not None:
                await self.forward(state, event)

    async def forward(self, state: Pending, event: TokenEvent) -> None:
        req = state.request
        if event.token_ids and event.position != state.generated:
            await self.lost(state, event)
            return
        if event.error is not None:
            await self._end(req.id, event.error.message)
            await bus.publish(self.nc, req.reply_to, Failed(id=req.id, error=event.error))
            return
        position = state.generated
        if req.sampling.max_new_tokens == 0:  # the prompt alone (its logprobs): nothing generated is given out
            tokens, stopped, finish = [], False, FinishReason.LENGTH
        else:
            tokens, stopped = self.detokenize(state, event)
            finish = FinishReason.STOP_SEQUENCE if stopped else event.finish_reason
        if finish:  # a stop string the engine does not know of: it is told to stop
            await self._end(req.id, cancel=CancelKind.STOP_SEQUENCE if stopped and not event.finish_reason else None,
                            **{"switchboard.finish_reason": str(finish), "switchboard.generated_tokens": state.generated})
        out = Output(id=req.id, position=position, tokens=tokens, finish_reason=finish,
                     generated_tokens=state.generated, stop=state.stops.matched if stopped else "",
                     cached_tokens=event.cached_tokens)
        if event.prompt_logprobs and len(event.prompt_logprobs) == len(state.prompt_ids):
            out.prompt = [self.token_bytes.out(i, text, lp) for i, text, lp in
                          zip(state.prompt_ids, token_texts(self.tok, state.prompt_ids), event.prompt_logprobs)]
        await bus.publish(self.nc, req.reply_to, out)

    async def lost(self, state: Pending, event: TokenEvent) -> None:
        """Token events went missing between engine and here (or came twice): this attempt cannot go on
        exactly. End it here and in the engine; the gateway resumes from what its client has."""
        if event.position < state.generated:
            return  # a duplicate: already forwarded
        req = state.request
        await self._end(req.id, "token events lost", CancelKind.EVENTS_LOST)
        error = ErrorInfo(ErrorKind.INTERNAL, f"token events {state.generated}..{event.position - 1} were lost")
        await bus.publish(self.nc, req.reply_to, Failed(id=req.id, error=error, retryable=True))

    async def _end(self, request_id: str, error: str | None = None, cancel: CancelKind | None = None,
                   **attributes) -> None:
        """The request is no longer this tokenizer's: it leaves ``pending`` (the one place it does), its
        span ends (``error``: failed, with this message), and with ``cancel`` its engine is told to stop it.
        What the gateway hears is the caller's to send."""
        state = self.pending.pop(request_id, None)
        if state is not None:
            telemetry.end_span(state.span, error, **attributes)
        if cancel is not None:
            await bus.publish(self.nc, subjects.CANCEL, Cancel(id=request_id, reason=cancel))

    def detokenize(self, state: Pending, event: TokenEvent) -> tuple[list[TokenOut], bool]:
        tokens: list[TokenOut] = []
        for i, token_id in enumerate(event.token_ids):
            state.generated += 1
            final = event.finish_reason is not None and i == len(event.token_ids) - 1
            text, own, stopped = next_text(state.decoder, state.stops, token_id, final,
                                           event.finish_reason is FinishReason.EOS_TOKEN,
                                           state.generated >= state.request.sampling.min_tokens)
            tokens.append(self.token_bytes.out(token_id, text, event.logprobs[i] if event.logprobs else None, own))
            if stopped:
                return tokens, True
        return tokens, False

    async def on_cancel(self, msg: NatsMsg) -> None:
        cancel = self.cancels.decode(msg.data)
        if cancel.id not in self.pending:
            self.cancelled.add(cancel.id)
        if cancel.reason.by_client:
            await self._end(cancel.id, **{"switchboard.finish_reason": "cancelled"})

    async def on_tokenize(self, msg: NatsMsg) -> None:
        req = self.tokenizes.decode(msg.data)
        if any(part.media is not None for part in req.parts):  # a task: its fetches hold no other request
            self._spawn(self.tokenize_with_media(msg, req))
            return
        long = len(req.text) > 2048 or req.messages is not None  # off the loop: it may take a while
        reply = await asyncio.to_thread(counting.tokenize, self.tok, req) if long else counting.tokenize(self.tok, req)
        await bus.respond(msg, reply)

    async def tokenize_with_media(self, msg: NatsMsg, req: Tokenize) -> None:
        await bus.respond(msg, await counting.tokenize_with_media(self.tok, req, self.media, self.media_policy))

    async def on_detokenize(self, msg: NatsMsg) -> None:
        await bus.respond(msg, counting.detokenize(self.tok, self.detokenizes.decode(msg.data), self.vocab_size))

    async def on_health(self, msg: NatsMsg) -> None:
        eos = self.tok.eos_token_id
        info = TokenizerInfo(model=self.model, vocab_size=self.vocab_size, eos_token_ids=[eos] if eos is not None else [])
        await bus.respond(msg, info)


async def serve(cfg: Config, nats_url: str, stop: asyncio.Event, ready=lambda: None) -> None:
    tokenizer = await asyncio.to_thread(load_tokenizer, str(cfg.model_path))
    media = await asyncio.to_thread(MediaProcessor.load, str(cfg.model_path))
    nc = await bus.connect(nats_url, "switchboard-tokenizer", stop)
    service = TokenizerService(cfg, nc, tokenizer, media)
    await service.start()
    heartbeat = asyncio.create_task(service.heartbeat(stop))
    ready()
    log.info("tokenizer ready", extra={"model": service.model, "instance": service.instance})
    try:
        await stop.wait()
    finally:
        heartbeat.cancel()
        for task in list(service.tasks):
            task.cancel()
        await bus.close(nc)


__all__ = ["TokenizerService", "serve"]
