"""Routing by load: each request goes to one live engine of its model, on that engine's own subject.

The engines' heartbeats (``EngineInfo``: running, waiting, free KV blocks, stopping) are kept under
leases; a request goes to the least loaded live engine that is not stopping, counting the requests
sent to it since its last heartbeat so a burst is spread instead of piling onto one engine. A new
engine takes load from its first heartbeat; a dead one (lease run out) or a stopping one gets none.
A request with a LoRA adapter goes only to an engine whose heartbeat lists that adapter.
"""

from __future__ import annotations

import time

from shared.engines import adapter_names
from shared.leases import Leases
from shared.messages import EngineInfo



class EngineRouter:
    def __init__(self, lease_s: float, clock=time.monotonic):
        self.engines: Leases[EngineInfo] = Leases(lease_s, clock)
        # A request sent this recently may not be counted yet in the heartbeat that just came (a busy
        # engine's loop answers late): two heartbeat intervals. Counting one twice only spreads a burst more.
        self.in_transit_s = lease_s / 2
        self.sent: dict[str, list[float]] = {}  # engine -> when requests were sent that its heartbeat may lack

    def heartbeat(self, info: EngineInfo) -> None:
        if info.instance:
            self.engines.beat(info.instance, info)
            recent = time.monotonic() - self.in_transit_s
            self.sent[info.instance] = [t for t in self.sent.get(info.instance, []) if t > recent]

    def serving(self) -> dict[str, EngineInfo]:
        """The live engines that take new requests: loaded and not stopping."""
        return {i: e for i, e in self.engines.live().items() if e.loaded and not e.stopping}

    def choose(self, adapter: str = "") -> str | None:
        """The least loaded live engine that has the LoRA ``adapter`` ("" = the base model: any engine),
        None when there is none. Decode-role engines take new requests only when no other engine does."""
        candidates = {i: e for i, e in self.serving().items() if not adapter or adapter in adapter_names(e)}
        if any(e.role != "decode" for e in candidates.values()):
            candidates = {i: e for i, e in candidates.items() if e.role != "decode"}
        if not candidates:
            return None
        best = min(candidates, key=lambda i: self._load(i, candidates[i]))
        self.sent.setdefault(best, []).append(time.monotonic())
        return best

    def hands_off(self, instance: str) -> bool:
        """Whether a request sent to ``instance`` should go on on a decode engine: it is a prefill engine
        and a decode engine is live (else it serves the request whole)."""
        engines = self.serving()
        chosen = engines.get(instance)
        return chosen is not None and chosen.role == "prefill" and any(e.role == "decode" for e in engines.values())

    def _load(self, instance: str, info: EngineInfo) -> tuple[float, float]:
        """Requests per batch slot (running, waiting and just sent), then the share of KV blocks in use."""
        queued = info.running + info.waiting + len(self.sent.get(instance, []))
        used = 1.0 - info.free_blocks / info.total_blocks if info.total_blocks else 1.0
        return queued / max(1, info.max_batch_size), used
