"""Ids cancelled before their request arrived.

A cancel and the request it cancels travel different paths (gateway -> engine directly, gateway ->
tokenizer -> engine), so the cancel can arrive first. A service that hears a cancel for an id it does
not know keeps it here for a while, and drops that request if it arrives later, instead of running a
request whose client is gone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

TTL_S = 60.0
MAX_IDS = 100_000


class Tombstones:
    def __init__(self, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._prune()
        self._ids[request_id] = self.clock()
        self._ids.move_to_end(request_id)
        while len(self._ids) > MAX_IDS:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        at = self._ids.get(request_id)
        return at is not None and self.clock() - at <= self.ttl_s

    def _prune(self) -> None:
        now = self.clock()
        while self._ids and now - next(iter(self._ids.values())) > self.ttl_s:
            self._ids.popitem(last=False)
