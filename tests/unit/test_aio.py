"""``shared.aio.within``: a timeout that never swallows a cancel."""

from __future__ import annotations

import asyncio

import pytest

from shared.aio import within


async def reader(queue: asyncio.Queue, read: list) -> None:
    """A request's reader: events until cancelled, each awaited with a long timeout."""
    while True:
        read.append(await within(queue.get(), 600))


def test_a_cancel_as_an_event_arrives_ends_the_reader():
    """The event and the cancel in one turn of the loop (a token as the client leaves): the reader ends.
    ``asyncio.wait_for`` returned the event and the reader waited on for the next one (Python 3.11)."""
    async def main() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        read: list = []
        task = asyncio.ensure_future(reader(queue, read))
        for event in range(20):
            await asyncio.sleep(0.01)  # the reader waits on the queue
            queue.put_nowait(event)
            if event == 10:
                task.cancel()
        await asyncio.sleep(0.05)
        assert task.cancelled(), read

    asyncio.run(main())


def test_a_timeout_is_a_timeout_error_and_none_waits():
    async def main() -> None:
        with pytest.raises(TimeoutError):
            await within(asyncio.Event().wait(), 0.05)
        assert await within(asyncio.sleep(0.01, "done"), None) == "done"
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(1)
        assert await within(queue.get(), 0) == 1  # ready at once: no wait, no timeout

    asyncio.run(main())
