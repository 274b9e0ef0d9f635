"""A large body's reading, off the gateway's event loop.

Reading a body checks its grammars (``shared/grammar.py``): llguidance builds each one, which takes seconds
for a large one (a Lark grammar of 50,000 alternatives: about 3 s). On the loop that would hold every other
request, and the heartbeats by which this gateway knows its engines live (a lease is 2 s): a body this
long is read on a worker thread instead (llguidance drops the GIL; so does the decoding of a long text).
A short body is read where it is (a thread's round trip would cost more than its reading).
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from litestar import Request

T = TypeVar("T")
OFF_LOOP_BYTES = 8 * 1024  # a grammar this long builds in a few milliseconds


async def read(request: Request, parse: Callable[..., T], *args, **kwargs) -> T:
    """``parse(*args, **kwargs)``: on a worker thread when the request's body is OFF_LOOP_BYTES or longer."""
    if len(await request.body()) < OFF_LOOP_BYTES:
        return parse(*args, **kwargs)
    return await asyncio.to_thread(parse, *args, **kwargs)
