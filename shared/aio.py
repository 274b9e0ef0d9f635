"""asyncio helpers the services share."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw`` for at most ``timeout`` seconds (``TimeoutError`` then; None: no limit), as
    ``asyncio.wait_for`` does, except that a cancel always cancels. Python 3.11's ``wait_for`` returns the
    result when what it awaits completes as the cancel arrives (gh-86296): a request's reader cancelled as its
    client left, just as a token came, read on and waited a whole tokenTimeout for tokens that never came."""
    async with asyncio.timeout(timeout):
        return await aw
