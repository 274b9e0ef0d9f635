"""Instances by id, each alive while it has been heard from within its lease.

Every instance of every service (engine, tokenizer, gateway) publishes a heartbeat carrying its id
several times per lease; an instance silent for longer than the lease (``Switchboard.leaseSeconds``)
is dead for everyone at once: whoever watches it sees the same expiry, whatever it last said.
"""

from __future__ import annotations

import time
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Leases(Generic[T]):
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self.clock = clock
        self._seen: dict[str, tuple[T, float]] = {}

    def beat(self, instance: str, info: T) -> bool:
        """Record a heartbeat; True when the instance was not live before (new, or back)."""
        fresh = not self.is_live(instance)
        self._seen[instance] = (info, self.clock())
        return fresh

    def is_live(self, instance: str) -> bool:
        entry = self._seen.get(instance)
        return entry is not None and self.clock() - entry[1] <= self.lease_s

    def is_gone(self, instance: str, since: float) -> bool:
        """Dead to a watcher relying on it since ``since`` (this table's clock): silent past its lease, or not
        heard at all within a lease of ``since``. An instance never heard yet is not dead at once: it may be
        new, its first heartbeat on its way (whoever named it heard it first)."""
        entry = self._seen.get(instance)
        last = entry[1] if entry is not None else since
        return self.clock() - last > self.lease_s

    def heard_since(self, since: float) -> bool:
        """Some instance has been heard after ``since`` (this table's clock)."""
        return any(at > since for _, at in self._seen.values())

    def get(self, instance: str) -> T | None:
        """The last word of a live instance."""
        return self._seen[instance][0] if self.is_live(instance) else None

    def live(self) -> dict[str, T]:
        """Every live instance's last heartbeat, by id."""
        now = self.clock()
        return {i: info for i, (info, at) in self._seen.items() if now - at <= self.lease_s}

    def expire(self) -> list[str]:
        """Forget the instances whose lease ran out and return their ids (each is returned once)."""
        now = self.clock()
        dead = [i for i, (_, at) in self._seen.items() if now - at > self.lease_s]
        for instance in dead:
            del self._seen[instance]
        return dead
