"""This engine's part in the fleet-wide prefix cache: it announces what enters and leaves its prefix cache,
answers a router's digest request and another engine's fetch of cached blocks, and pulls a request's
prefix from the engine the router says holds it.

* **Announcing.** After each job on the engine's thread that may change the cache (a step, an import),
  the block manager's journal is drained into one ``CacheEvents`` (numbered ``seq`` 1, 2, …), published
  on ``subjects.engine_cache``; the heartbeat carries the ``seq`` and the cache's key count and XOR as of
  it, so a router whose view differs (an event lost, a router that started late) asks for a digest
  (``CacheSync``), answered with every key as of a ``seq``.
* **Holding.** A ``KvFetch`` is answered with the K/V bytes of the leading asked blocks this cache holds
  (``kv_transfer``'s per-block layout), read on the engine's thread between steps, so no block is
  reused while it is read.
* **Pulling.** A request whose ``pull_from`` names another engine first fetches the blocks of its prompt's
  prefix this engine lacks from there, writes them into free blocks as cached (evictable) blocks, and is
  then admitted as any request: its allocation finds them. The wait is bounded by what recomputing those
  tokens would take (this engine's measured prefill rate) and ``kvTransTimeoutSeconds``; a pull whose
  measured rate is slower than prefill is not tried. A holder that died, is slow or evicted the blocks
  only means fewer blocks arrive, and the rest is computed.

One tier: a CPU engine's cache is host memory already; evicted blocks are gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.msg import Msg as NatsMsg

from services.engine.block_manager import blocks_for
from services.engine.kv_transfer import KvLayout, chunks_per_part
from services.engine.multimodal import salts
from shared import bus, subjects
from shared.fleet_messages import CacheEvents, KvBlocks, KvFetch
from shared.messages import EngineRequest, decoder, encode
from shared.metrics_messages import PrefixPulled
from shared.prefix_hash import chain, matchable_blocks
from shared.aio import within

log = logging.getLogger("switchboard.engine")

MIN_WAIT_S = 0.05  # a pull may always take this long
EMA = 0.3  # weight of a new measurement in the rates


@dataclass
class Rates:
    """The cost model's measurements: prompt tokens computed per second of step, tokens pulled per second."""

    prefill_tps: float | None = None
    pull_tps: float | None = None

    @staticmethod
    def mix(old: float | None, new: float) -> float:
        return new if old is None else (1 - EMA) * old + EMA * new


class FleetCache:
    def __init__(self, nc, model: str, instance: str, engine, stepper, timeout_s: float):
        self.nc, self.model, self.instance, self.engine = nc, model, instance, engine
        self.stepper, self.timeout_s = stepper, timeout_s
        self.blocks = engine.blocks
        self.state: tuple[int, int, bytes] = (0, 0, bytes(16))  # seq, key count, key XOR as of the last CacheEvents
        self.rates = Rates()
        self.fetches = decoder(KvFetch)
        self.answers = decoder(KvBlocks)

    @property
    def enabled(self) -> bool:
        return self.blocks.enable_prefix_cache

    async def start(self) -> None:
        if not self.enabled:
            return
        await bus.subscribe(self.nc, subjects.engine_cache_sync(self.model, self.instance), self.on_sync)
        await bus.subscribe(self.nc, subjects.engine_kv_fetch(self.model, self.instance), self.on_fetch)

    # ---- announcing (journal() runs on the engine's thread) --------------------------------------

    def journal(self) -> CacheEvents | None:
        """Drain the cache's changes since the last call into the next CacheEvents (None when nothing changed)."""
        if not self.enabled:
            return None
        stored, removed = self.blocks.take_journal()
        seq = self.state[0] + (1 if stored or removed else 0)
        self.state = (seq, *self.blocks.checksum())
        return CacheEvents(self.instance, seq, stored, removed) if stored or removed else None

    async def announce(self, events: CacheEvents | None) -> None:
        if events is not None:
            await bus.publish(self.nc, subjects.engine_cache(self.model), events)

    def measure_step(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed ``prompt_tokens`` prompt tokens in ``seconds`` (prefill-heavy steps only)."""
        if prompt_tokens >= self.blocks.block_size and seconds > 0:
            self.rates.prefill_tps = Rates.mix(self.rates.prefill_tps, prompt_tokens / seconds)

    async def on_sync(self, msg: NatsMsg) -> None:
        await bus.respond(msg, await self._on_stepper(self._digest))

    def _digest(self) -> CacheEvents:
        return CacheEvents(self.instance, self.state[0], stored=self.blocks.cached_keys(), digest=True)

    # ---- holding ----------------------------------------------------------------------------------

    async def on_fetch(self, msg: NatsMsg) -> None:
        try:
            answer = await self._on_stepper(self._export, self.fetches.decode(msg.data))
        except Exception as exc:  # noqa: BLE001 - the asker computes instead, at once rather than at its timeout
            log.exception("prefix fetch failed")
            answer = KvBlocks(error=f"the holder could not read the blocks: {exc!r}")
        await bus.respond(msg, answer)

    def _export(self, fetch: KvFetch) -> KvBlocks:
        runner = self.engine.runner
        layout = KvLayout.of(runner)
        if len(fetch.layout) != 5 or KvLayout(*fetch.layout) != layout:
            return KvBlocks(error=f"KV layout {fetch.layout} does not match this engine's {layout}")
        chunks = self.blocks.run_bytes(fetch.keys, lambda block: runner.kv.block_bytes(block, runner.block_size))
        return KvBlocks(chunks=chunks)

    # ---- pulling ----------------------------------------------------------------------------------

    def wants_pull(self, req: EngineRequest) -> bool:
        return (self.enabled and bool(req.pull_from) and req.pull_from != self.instance and not req.generated_ids
                and (not req.adapter or self.engine.runner.lora.salt(req.adapter) is not None))

    async def pull(self, req: EngineRequest) -> None:
        """Bring the prefix of ``req``'s prompt this cache lacks from ``req.pull_from``, within its budget.
        Never raises: whatever does not arrive is computed."""
        size = self.blocks.block_size
        adapter = self.engine.runner.lora.salt(req.adapter) or b""  # none for the base model ("")
        found = salts(req, self.engine.runner.media_token_ids, size)
        keys = chain(req.prompt_ids, size, adapter + found.more, matchable_blocks(len(req.prompt_ids), size),
                     (found.media_from, found.media))
        have = self.blocks.cached_run(keys)
        budget = self.budget((len(keys) - have) * size)
        if budget is None:
            return
        started = time.monotonic()
        try:
            chunks = await within(self._fetch(req.pull_from, keys[have:]), budget)
            events = await self._on_stepper(self._import, keys[:have + len(chunks)], [None] * have + chunks,
                                             blocks_for(len(req.prompt_ids) + 1, size))
        except Exception as exc:  # noqa: BLE001 - a dead, slow or refusing holder: compute instead
            log.info("prefix pull gave up: computing", extra={"request_id": req.id, "error": repr(exc)})
            await self._report(0, time.monotonic() - started, ok=False)
            return
        seconds = time.monotonic() - started
        if chunks:
            self.rates.pull_tps = Rates.mix(self.rates.pull_tps, len(chunks) * size / max(seconds, 1e-6))
        await self.announce(events)
        await self._report(len(chunks) * size, seconds)

    def budget(self, tokens: int) -> float | None:
        """How long a pull of ``tokens`` may take: about what computing them would (unmeasured: the transfer
        timeout); None when pulls measured slower than prefill or there is nothing to pull."""
        if tokens <= 0:
            return None
        rates = self.rates
        if rates.prefill_tps is None:
            return self.timeout_s
        recompute = tokens / rates.prefill_tps
        if rates.pull_tps is not None and tokens / rates.pull_tps >= recompute:
            return None
        return min(self.timeout_s, max(MIN_WAIT_S, recompute))

    async def _fetch(self, holder: str, keys: list[bytes]) -> list[bytes]:
        layout = KvLayout.of(self.engine.runner)
        per_part = chunks_per_part(layout.chunk_bytes, self.nc.max_payload)
        chunks: list[bytes] = []
        for start in range(0, len(keys), per_part):
            group = keys[start:start + per_part]
            reply = await self.nc.request(subjects.engine_kv_fetch(self.model, holder),
                                          encode(KvFetch(keys=group, layout=layout.fields)), timeout=self.timeout_s)
            answer = self.answers.decode(reply.data)
            if answer.error:
                raise RuntimeError(f"engine {holder}: {answer.error}")
            if len(answer.chunks) > len(group) or any(len(c) != layout.chunk_bytes for c in answer.chunks):
                raise RuntimeError(f"engine {holder} sent blocks that do not fit this engine's cache")
            chunks.extend(answer.chunks)
            if len(answer.chunks) < len(group):
                break
        return chunks

    def _import(self, keys: list[bytes], chunks: list[bytes | None], reserve: int) -> CacheEvents | None:
        runner = self.engine.runner
        self.blocks.import_prefix(keys, chunks, lambda block, chunk: runner.kv.write_block(block, runner.block_size,
                                                                                          chunk), reserve)
        return self.journal()

    async def _report(self, tokens: int, seconds: float, ok: bool = True) -> None:
        await bus.publish(self.nc, subjects.METRICS_EVENTS, PrefixPulled(model=self.model, tokens=tokens,
                                                                         seconds=seconds, ok=ok))

    async def _on_stepper(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.stepper, fn, *args)

