"""maxLinkNum: that many requests in progress, 2 x maxLinkNum waiting in order, beyond that 429.

A request with ``n`` choices takes ``n`` slots in one admission, so its choices never wait on each
other; one that can never fit (``n`` > maxLinkNum) is refused at once. A waiter that is cancelled
(its client went away) leaves the queue, and slots granted to it in that instant are given back.
"""

from __future__ import annotations

import asyncio
from collections import deque

from shared.errors import ErrorKind, SwitchboardError


class Slots:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    async def acquire(self, n: int = 1) -> None:
        if n > self.limit:
            raise SwitchboardError(ErrorKind.VALIDATION, f"this request asks for {n} sequences (prompts x n) at "
                                                         f"once, more than maxLinkNum ({self.limit}) allows.", "n")
        if not self.waiters and self.used + n <= self.limit:
            self.used += n
            return
        if len(self.waiters) >= 2 * self.limit:
            raise SwitchboardError(ErrorKind.OVERLOADED, f"Model is overloaded: {self.limit} requests in progress "
                                                         f"and {2 * self.limit} waiting (maxLinkNum {self.limit}); "
                                                         "retry later")
        waiter = (n, asyncio.get_running_loop().create_future())
        self.waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: tuple[int, asyncio.Future]) -> None:
        n, future = waiter
        if future.done() and not future.cancelled():
            self.release(n)  # granted in the same instant: give it back
            return
        if waiter in self.waiters:
            self.waiters.remove(waiter)
        self._grant()  # a large request leaving the head may let smaller ones in

    def release(self, n: int = 1) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self.waiters and self.used + self.waiters[0][0] <= self.limit:
            n, future = self.waiters.popleft()
            if future.done():  # cancelled: it is no longer waiting
                continue
            self.used += n
            future.set_result(None)
