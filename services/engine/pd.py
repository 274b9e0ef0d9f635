"""Prefill/decode disaggregation over the bus: a prefill engine hands each request on to a decode engine.

Inside the engine, ``KvHandoff`` is called at three named points (the shape of vLLM's KV connector):

* ``cached_blocks(req)`` (decode side, as a transfer begins): how many leading blocks of the request
  this engine's prefix cache holds; their K/V do not travel;
* ``on_allocated(seq)`` (decode side, from the scheduler): a handed-over sequence got its blocks; the
  received K/V are written into them (or, when they do not fit, the prompt is recomputed);
* ``on_prompt_done(seq)`` (prefill side, after the step that sampled its first token): its prompt's
  K/V are exported and the request queued as a ``Handoff`` for the engine service (``take``).

After a prefill engine has computed a request's prompt and first token (``Engine.take_handoffs``), it
picks the least loaded live decode engine from the engines' heartbeats and sends it the request and
the prompt's K/V (``kv_transfer``) as ``KvPart`` messages within ``PART_BYTES`` and the bus's max_payload, one at a time,
each answered by a ``KvAck``: the receiver is never sent more than one part ahead, so several
transfers at once cannot swamp a slow one. The decode engine takes the request when the last part
arrives, and the prefill engine then tells the request's tokenizer where it went (``TokenBatch.moved``),
so that the tokenizer watches the decode engine from then on.

``KvLink`` calls nothing back: a handoff returns its outcome (``Moved`` or ``Kept``) and a received part
its ack and, with the last part, the ``Accepted`` request, for the engine service to act on.

One owner at each step: until the last part is acknowledged the prefill engine owns the request; if no
decode engine is live, or the transfer fails or takes longer than ``kvTransTimeoutSeconds``, it keeps
the request and recomputes its prompt itself (the request's tokens are all that needs). A decode engine
that dies after taking it is the tokenizer's to notice (its lease runs out): the gateway then resumes
the request from what its client has. A decode engine drops a transfer whose sender went silent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import msgspec
from nats.aio.msg import Msg as NatsMsg

from services.engine.kv_transfer import KvImport, KvLayout, chunks_per_part, export_blocks, import_blocks
from services.engine.multimodal import salts
from services.engine.sequence import Sequence
from shared import bus, subjects, telemetry
from shared.leases import Leases
from shared.messages import EngineInfo, EngineRequest, decoder, encode
from shared.metrics_messages import KvTransferred
from shared.pd_messages import KvAck, KvPart
from shared.aio import within

if TYPE_CHECKING:
    from services.engine.block_manager import BlockManager
    from services.engine.model_runner import ModelRunner

log = logging.getLogger("switchboard.engine")



@dataclass(frozen=True)
class Handoff:
    """A request whose prompt this (prefill) engine computed and whose first token it sampled, to go on
    on a decode engine: the request as received, its tokens so far and its prompt's K/V."""

    request: EngineRequest
    generated_ids: list[int]
    kv: KvImport


class KvHandoff:
    """The engine's side of a handoff, at its three points (see the module's docstring). Called from the
    engine's thread, except ``cached_blocks`` (the bus's thread; a block evicted meanwhile is noticed on
    admission, and the prompt recomputed)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager):
        self.runner, self.blocks = runner, blocks
        self.ready: list[Handoff] = []  # prefill role: handoffs not yet taken by the engine service

    def cached_blocks(self, req: EngineRequest) -> int:
        found = salts(req, self.runner.media_token_ids, self.blocks.block_size)
        seq = Sequence(req.id, req.prompt_ids, req.sampling, more_salt=found.more, media_from=found.media_from,
                       media_salt=found.media)
        seq.token_ids.extend(req.generated_ids)
        return self.blocks.cached_tokens(seq) // self.blocks.block_size

    def on_allocated(self, seq: Sequence) -> None:
        """Write the received K/V of its prompt (less the prefix its blocks already hold); if they do not
        fit, or blocks that were cached when the transfer began (so not sent) were evicted since, the
        prompt is recomputed, as for any resumed request."""
        kv, seq.kv_import = seq.kv_import, None
        if kv is None or seq.num_computed >= kv.num_tokens:
            return
        try:
            done = import_blocks(self.runner, seq.block_table, kv, seq.num_computed // self.blocks.block_size)
        except ValueError as exc:
            log.warning("received K/V refused: recomputing the prompt", extra={"request_id": seq.id, "error": str(exc)})
            return
        start, seq.num_computed = seq.num_computed, done
        self.blocks.cache_computed(seq, start)

    def on_prompt_done(self, seq: Sequence) -> None:
        """Export its prompt's K/V and queue it, with its first token, for a decode engine."""
        kv = KvImport(KvLayout.of(self.runner), seq.num_prompt_tokens,
                      export_blocks(self.runner, seq.block_table, seq.num_prompt_tokens))
        self.ready.append(Handoff(seq.request, list(seq.token_ids[seq.num_prompt_tokens:]), kv))

    def take(self) -> list[Handoff]:
        taken, self.ready = self.ready, []
        return taken


@dataclass(frozen=True)
class Moved:
    """A decode engine took the request (the prefill engine forgets it and tells its tokenizer)."""

    request: EngineRequest
    target: str


@dataclass(frozen=True)
class Kept:
    """The handoff did not happen: the request goes on on the prefill engine, its prompt recomputed."""

    request: EngineRequest


@dataclass(frozen=True)
class Accepted:
    """A decode engine received a request and its prompt's K/V."""

    request: EngineRequest
    kv: KvImport


HandoffOutcome = Union[Moved, Kept]


class KvLink:
    def __init__(self, nc, model: str, instance: str, lease_s: float, timeout_s: float):
        self.nc, self.model, self.instance, self.timeout_s = nc, model, instance, timeout_s
        self.peers: Leases[EngineInfo] = Leases(lease_s)
        self.incoming: dict[str, tuple[KvPart, list[bytes], float]] = {}  # id -> (first part, chunks, deadline)
        self.parts = decoder(KvPart)
        self.acks = decoder(KvAck)
        self.infos = decoder(EngineInfo)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.engine_heartbeat(self.model), self.on_peer)

    async def on_peer(self, msg: NatsMsg) -> None:
        info = self.infos.decode(msg.data)
        if info.instance and info.instance != self.instance:
            self.peers.beat(info.instance, info)

    def decode_target(self) -> str | None:
        """The least loaded live decode engine that takes requests, None when there is none."""
        live = {i: e for i, e in self.peers.live().items() if e.role == "decode" and e.loaded and not e.stopping}
        if not live:
            return None
        return min(live, key=lambda i: (live[i].running + live[i].waiting) / max(1, live[i].max_batch_size))

    # ---- prefill side -----------------------------------------------------------------------

    async def hand_off(self, handoff: Handoff) -> HandoffOutcome:
        """Send one request on: ``Moved``, or ``Kept`` (recomputed here) when that is not possible in time."""
        req = msgspec.structs.replace(handoff.request, generated_ids=handoff.generated_ids, handoff=False)
        target = self.decode_target()
        started = time.monotonic()
        span = telemetry.start_span("engine.kv_transfer", req.trace, **{
            "switchboard.request_id": req.id, "switchboard.kv_tokens": handoff.kv.num_tokens,
            "switchboard.decode_engine": target or ""})
        try:
            if target is None:
                raise RuntimeError("no decode engine is live")
            sent = await within(self._send(target, req, handoff.kv), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: the request stays here
            log.warning("handoff failed: recomputing here", extra={"request_id": req.id, "error": repr(exc)})
            telemetry.end_span(span, f"handoff failed, recomputed here: {exc!r}", **{"switchboard.outcome": "recompute"})
            return Kept(req)
        seconds = time.monotonic() - started
        telemetry.end_span(span, **{"switchboard.outcome": "moved", "switchboard.kv_seconds": seconds,
                                    "switchboard.kv_bytes": sent})
        log.info("handed off", extra={"request_id": req.id, "engine": target, "kv_bytes": sent,
                                      "seconds": round(seconds, 4)})
        await bus.publish(self.nc, subjects.METRICS_EVENTS, KvTransferred(model=self.model, bytes=sent, seconds=seconds))
        return Moved(req, target)

    async def _send(self, target: str, req: EngineRequest, kv: KvImport) -> int:
        """The header part, then the chunks past the blocks the decode engine holds already (at least one
        part, empty when it holds them all); the bytes sent."""
        subject = subjects.engine_kv(self.model, target)
        layout = kv.layout
        header = KvPart(id=req.id, index=0, count=2, chunks=[], request=req, num_tokens=kv.num_tokens,
                        layout=layout.fields)
        cached = min(len(kv.chunks), (await self._part(subject, target, header)).cached_blocks)
        rest = kv.chunks[cached:]
        per_part = chunks_per_part(layout.chunk_bytes, self.nc.max_payload)
        groups = [rest[i:i + per_part] for i in range(0, len(rest), per_part)] or [[]]
        for index, group in enumerate(groups, start=1):
            await self._part(subject, target, KvPart(id=req.id, index=index, count=len(groups) + 1, chunks=group,
                                                     first_block=cached))
        return sum(map(len, rest))

    async def _part(self, subject: str, target: str, part: KvPart) -> KvAck:
        reply = await self.nc.request(subject, encode(part), timeout=self.timeout_s)
        ack = self.acks.decode(reply.data)
        if not ack.ok:
            raise RuntimeError(f"decode engine {target} refused part {part.index}: {ack.error}")
        return ack

    # ---- decode side ------------------------------------------------------------------------

    def receive(self, data: bytes, cached_blocks: Callable[[EngineRequest], int]) -> tuple[KvAck, Accepted | None]:
        """One part of a transfer to this engine: its ack and, with the last part, the request and its K/V.
        ``cached_blocks`` says how many of a request's leading blocks the prefix cache holds (those need not
        travel). A bad part is refused; the sender keeps the request."""
        part = self.parts.decode(data)
        self._expire()
        try:
            return self._take(part, cached_blocks)
        except Exception as exc:  # noqa: BLE001
            self.incoming.pop(part.id, None)
            return KvAck(ok=False, error=str(exc)), None

    def _take(self, part: KvPart, cached_blocks: Callable[[EngineRequest], int]) -> tuple[KvAck, Accepted | None]:
        """The header registers the transfer and answers how many leading blocks are cached here; the last
        part completes it."""
        if part.index == 0:
            if part.request is None or len(part.layout) != 5:
                raise ValueError("the first part lacks the request or its layout")
            self.incoming[part.id] = (part, [], time.monotonic() + self.timeout_s)
            return KvAck(ok=True, cached_blocks=cached_blocks(part.request)), None
        first, chunks, deadline = self.incoming[part.id]
        chunks.extend(part.chunks)
        if part.index < part.count - 1:
            return KvAck(ok=True), None
        del self.incoming[part.id]
        kv = KvImport(KvLayout(*first.layout), first.num_tokens, chunks, first=part.first_block)
        return KvAck(ok=True), Accepted(first.request, kv)

    def _expire(self) -> None:
        """Drop transfers whose sender went silent (it keeps and recomputes those requests itself)."""
        now = time.monotonic()
        for request_id in [i for i, (_, _, deadline) in self.incoming.items() if deadline < now]:
            del self.incoming[request_id]
