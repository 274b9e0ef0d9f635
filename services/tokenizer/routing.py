"""Routing: each request goes to one live engine of its model, on that engine's own subject, chosen by load
and, with the prefix cache on, by what each engine's cache holds (``Switchboard.routing``).

The engines' heartbeats (``EngineInfo``: running, waiting, free KV blocks, stopping) are kept under
leases; an engine's load is its requests (running, waiting, and those sent to it since its last heartbeat,
so a burst is spread instead of piling onto one engine). A new engine takes load from its first heartbeat;
a dead one (lease run out) or a stopping one gets none. A request with a LoRA adapter goes only to an
engine whose heartbeat lists that adapter (its blocks salted by the adapter's weights, the same on every
engine); decode-role engines take new requests only when no other does.

By cache: the request's prompt is hashed into the engines' block keys (``shared.prefix_hash``), and each
engine within ``maxLoadGap`` requests of the least loaded one is scored by the share of those blocks its
cache holds (``cache_views.py``) against its extra load. When the chosen engine lacks a long prefix another
engine holds (``pullMinTokens``), it is told to pull those blocks from there (``EngineRequest.pull_from``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.tokenizer.cache_views import CacheViews
from shared.engines import adapter_names
from shared.leases import Leases
from shared.messages import EngineInfo
from shared.metrics_messages import Routed
from shared.prefix_hash import chain, client_salt, matchable_blocks, media_salt
from shared.switchboard_config import RoutingConfig


@dataclass(frozen=True)
class Choice:
    """A routing decision: the engine, the prompt blocks it holds, the most any engine holds (and which),
    and its load over the least loaded engine's (requests)."""

    engine: str
    hit_blocks: int = 0
    best_blocks: int = 0
    holder: str = ""
    load_gap: int = 0
    pull_from: str = ""


class EngineRouter:
    def __init__(self, lease_s: float, policy: RoutingConfig | None = None, block_size: int = 0,
                 clock=time.monotonic):
        self.engines: Leases[EngineInfo] = Leases(lease_s, clock)
        self.policy = policy or RoutingConfig(policy="load")
        self.block_size = block_size  # 0: the prefix cache is off, routing is by load
        self.caches = CacheViews()
        # A request sent this recently may not be counted yet in the heartbeat that just came (a busy
        # engine's loop answers late): two heartbeat intervals. Counting one twice only spreads a burst more.
        self.in_transit_s = lease_s / 2
        self.sent: dict[str, list[float]] = {}  # engine -> when requests were sent that its heartbeat may lack

    @property
    def by_cache(self) -> bool:
        return self.block_size > 0 and self.policy.policy != "load"

    def heartbeat(self, info: EngineInfo) -> bool:
        """Keep an engine's heartbeat; True when this router's view of its cache needs a digest."""
        if not info.instance:
            return False
        self.engines.beat(info.instance, info)
        recent = time.monotonic() - self.in_transit_s
        self.sent[info.instance] = [t for t in self.sent.get(info.instance, []) if t > recent]
        self.caches.forget(set(self.engines.live()))
        return self.by_cache and self.caches.check(info)

    def serving(self) -> dict[str, EngineInfo]:
        """The live engines that take new requests: loaded and not stopping."""
        return {i: e for i, e in self.engines.live().items() if e.loaded and not e.stopping}

    def choose(self, adapter: str = "", keys: list[bytes] | None = None) -> Choice | None:
        """The engine for a request with the LoRA ``adapter`` ("" = the base model: any engine) whose prompt's
        matchable blocks are keyed ``keys`` (None or []: by load only); None when no engine serves."""
        candidates = {i: e for i, e in self.serving().items() if not adapter or adapter in adapter_names(e)}
        if any(e.role != "decode" for e in candidates.values()):
            candidates = {i: e for i, e in candidates.items() if e.role != "decode"}
        if not candidates:
            return None
        queued = {i: self._queued(i, e) for i, e in candidates.items()}
        least = min(queued.values())
        if keys and self.by_cache:
            choice = self._by_cache(candidates, queued, least, keys)
        else:
            best = min(candidates, key=lambda i: self._load(i, candidates[i]))
            choice = Choice(best, load_gap=queued[best] - least)
        self.sent.setdefault(choice.engine, []).append(time.monotonic())
        return choice

    def _by_cache(self, candidates: dict[str, EngineInfo], queued: dict[str, int], least: int,
                  keys: list[bytes]) -> Choice:
        policy = self.policy
        hits = {i: self.caches.hit_blocks(i, keys) for i in candidates}
        gap_unit = max(1, policy.max_load_gap)
        cache_w = policy.cache_weight
        load_w = 0.0 if policy.policy == "cache" else policy.load_weight

        def score(i: str) -> tuple[float, float]:
            value = cache_w * hits[i] / len(keys) - load_w * (queued[i] - least) / gap_unit
            return value, -self._load(i, candidates[i])[0]

        allowed = [i for i in candidates if queued[i] - least <= policy.max_load_gap]
        best = max(allowed, key=score)
        holder = max(candidates, key=lambda i: (hits[i], i == best))
        pull = (policy.pull_min_tokens > 0 and holder != best
                and (hits[holder] - hits[best]) * self.block_size >= policy.pull_min_tokens)
        return Choice(best, hits[best], hits[holder], holder if hits[holder] else "", queued[best] - least,
                      holder if pull else "")

    def prefix_keys(self, adapter: str, ids: list[int], media_digest: str = "", cache_salt: str = "",
                    media_at: int = 0) -> list[bytes] | None:
        """A prompt's matchable block keys, as the engines key their caches (None: route by load); ``media_at``:
        the position of its first media token, whose block's parent its media's digest joins."""
        salt = self.adapter_salt(adapter) if adapter else b""
        if not self.by_cache or salt is None:
            return None
        media = (media_at // self.block_size, media_salt(media_digest)) if media_digest else (-1, b"")
        return chain(ids, self.block_size, salt + client_salt(cache_salt), matchable_blocks(len(ids), self.block_size),
                     media)

    def routed(self, model: str, prompt_tokens: int, choice: Choice) -> Routed:
        """A decision as the metrics count it."""
        size = self.block_size
        return Routed(model=model, engine=choice.engine, prompt_tokens=prompt_tokens,
                      hit_tokens=choice.hit_blocks * size, best_hit_tokens=choice.best_blocks * size,
                      load_gap=choice.load_gap, pulled=bool(choice.pull_from))

    def adapter_salt(self, adapter: str) -> bytes | None:
        """The prefix-cache salt of a LoRA adapter (its weights' digest), when the engines serving it agree on
        one (None: route by load)."""
        salts = {a.salt for e in self.serving().values() for a in e.adapters if a.name == adapter}
        return salts.pop() if len(salts) == 1 and b"" not in salts else None

    def hands_off(self, instance: str) -> bool:
        """Whether a request sent to ``instance`` should go on on a decode engine: it is a prefill engine
        and a decode engine is live (else it serves the request whole)."""
        engines = self.serving()
        chosen = engines.get(instance)
        return chosen is not None and chosen.role == "prefill" and any(e.role == "decode" for e in engines.values())

    def _queued(self, instance: str, info: EngineInfo) -> int:
        recent = time.monotonic() - self.in_transit_s
        return info.running + info.waiting + sum(1 for t in self.sent.get(instance, []) if t > recent)

    def _load(self, instance: str, info: EngineInfo) -> tuple[float, float]:
        """Requests per batch slot (running, waiting and just sent), then the share of KV blocks in use."""
        used = 1.0 - info.free_blocks / info.total_blocks if info.total_blocks else 1.0
        return self._queued(instance, info) / max(1, info.max_batch_size), used
