"""What each engine's prefix cache holds, as this router knows it: one set of block keys per engine, kept
from the engines' ``CacheEvents`` and rebuilt from a digest when it may be wrong.

A view is exact as long as no event is lost: events are numbered per engine, and each heartbeat carries
the engine's last number with its cache's key count and key XOR as of it. A view that skipped a number,
disagrees with the heartbeat at the same number, or stays behind the heartbeats' number for a whole
heartbeat (its events lost on the way) asks for a digest: every key the engine holds, as of a number.
Until then the view is used as it is (a wrong guess costs one recomputed prefix, never a wrong token:
the engine matches blocks by its own cache). An engine's view goes with its lease; a restarted engine
is a new instance, so it is never credited with the blocks its previous life held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.fleet_messages import CacheEvents
from shared.messages import EngineInfo


@dataclass
class View:
    seq: int = 0
    keys: set[bytes] = field(default_factory=set)
    xor: int = 0
    behind: bool = False  # the last heartbeat's number was past this view's

    def add(self, key: bytes) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self.xor ^= int.from_bytes(key, "big")

    def remove(self, key: bytes) -> None:
        if key in self.keys:
            self.keys.discard(key)
            self.xor ^= int.from_bytes(key, "big")

    def agrees(self, count: int, xor: bytes) -> bool:
        return len(self.keys) == count and self.xor.to_bytes(16, "big") == (xor or bytes(16))


class CacheViews:
    def __init__(self):
        self.views: dict[str, View] = {}

    def apply(self, events: CacheEvents) -> bool:
        """Take one engine's events or digest; True when the view needs a digest (a number was skipped)."""
        view = self.views.get(events.instance)
        if events.digest:
            if view is None or events.seq >= view.seq:
                fresh = View(events.seq)
                for key in events.stored:
                    fresh.add(key)
                self.views[events.instance] = fresh
            return False
        if view is None:
            view = self.views[events.instance] = View()
        if events.seq <= view.seq:
            return False  # already in the digest this view was rebuilt from
        skipped = events.seq != view.seq + 1
        for key in events.stored:
            view.add(key)
        for key in events.removed:
            view.remove(key)
        view.seq = events.seq
        return skipped

    def check(self, info: EngineInfo) -> bool:
        """Compare a view with its engine's heartbeat; True when it needs a digest."""
        view = self.views.get(info.instance)
        if view is None:
            if info.cache_seq == 0:  # a fresh engine: nothing to miss
                self.views[info.instance] = View()
                return False
            return True
        if info.cache_seq > view.seq:
            stale, view.behind = view.behind, True  # events in flight, or lost if still behind next time
            return stale
        view.behind = False
        return info.cache_seq == view.seq and not view.agrees(info.cache_count, info.cache_xor)

    def hit_blocks(self, instance: str, keys: list[bytes]) -> int:
        """How many leading blocks of ``keys`` the engine holds, as far as this router knows."""
        view = self.views.get(instance)
        if view is None:
            return 0
        count = 0
        for key in keys:
            if key not in view.keys:
                break
            count += 1
        return count

    def forget(self, live: set[str]) -> None:
        """Drop the views of engines whose lease ran out."""
        for instance in [i for i in self.views if i not in live]:
            del self.views[instance]
