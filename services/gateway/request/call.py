"""One client request of any family: its sessions (prompts x choices), one admission, one close.

Every family runs its requests through a Call (``lifecycle.py`` drives it): admission of one slot
per choice, start of every choice, then collect or stream, then close. A call is a context:
``async with call:`` closes it on the way out, whatever ended the request (its last token, an error,
the client going away at any moment, a cancelled task). An owner that outlives the ``async with`` —
a streaming response, MindIE's PD relay — takes the call over with ``detach()`` and closes it itself.
``close()`` is idempotent and never suspends, so it frees the slots and cancels unfinished choices
exactly once, even inside a cancelled scope.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator

from services.gateway.request.session import End, Session, Step
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Started

if TYPE_CHECKING:
    from services.gateway.request.context import SessionContext


class Call:
    """Choice ``p * n + j`` is the ``j``-th sample of prompt ``p`` (vLLM's order)."""

    def __init__(self, ctx: SessionContext, sessions: list[Session], n: int = 1):
        self.ctx = ctx
        self.sessions = sessions
        for index, session in enumerate(sessions):
            session.index = index
        self.n = n
        self.started: list[Started] = []
        self.held = 0  # slots this call holds
        self.closed = False
        self.detached = False  # taken over by an owner that closes it itself
        self.on_close: list = []  # what to undo when it closes (a dmi req-id's registration)

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *exc) -> bool:
        if not self.detached:
            self.close()
        return False

    def detach(self) -> Call:
        """Take the call over from its ``async with``, which then leaves it open: the caller closes it."""
        self.detached = True
        return self

    def __len__(self) -> int:
        return len(self.sessions)

    # ---- start ----------------------------------------------------------------------------------

    async def start(self) -> list[Started]:
        """Admit (one slot per choice) and start every choice; raises on any failure or cancel (the owner
        closes the call)."""
        self.ctx.admit()
        if adapters := {s.request.adapter for s in self.sessions if s.request.adapter}:
            await self.ctx.restored(adapters)  # (an engine that came back is being given them)
        await self.ctx.slots.acquire(len(self.sessions))
        self.held = len(self.sessions)
        if self.closed:  # closed while waiting for the slots
            raise asyncio.CancelledError()
        self.started = await all_or_cancel([s.start() for s in self.sessions])
        return self.started

    # ---- results --------------------------------------------------------------------------------

    async def results(self) -> list[End]:
        """Every choice's end, once all have finished; the first failure cancels the rest and is raised."""
        return await all_or_cancel([s.result() for s in self.sessions])

    async def steps(self) -> AsyncIterator[Step]:
        """Steps of every choice as they come, until every choice has ended."""
        if len(self.sessions) == 1:
            async for step in self.sessions[0].steps():
                yield step
            return
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(s, queue)) for s in self.sessions]
        try:
            left = len(pumps)
            while left:
                item = await queue.get()
                if isinstance(item, SwitchboardError):
                    raise item
                left -= item.end is not None
                yield item
        finally:
            for pump in pumps:
                pump.cancel()

    def has_first_tokens(self) -> bool:
        """Every choice has its first token (or has ended)."""
        return all(s.first_token.is_set() for s in self.sessions)

    def ended(self) -> bool:
        """Every choice has ended."""
        return all(s.finish_reason is not None for s in self.sessions)

    async def first_tokens(self) -> None:
        """Until every choice has its first token (or has ended)."""
        await asyncio.gather(*(s.first_token.wait() for s in self.sessions))

    def prompt_of(self, index: int) -> int:
        return index // self.n

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counted once, however many choices it has."""
        return sum(started.prompt_tokens for started in self.started[:: self.n])

    @property
    def completion_tokens(self) -> int:
        return sum(s.generated for s in self.sessions)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engines found in their prefix caches, each prompt counted once."""
        return sum(s.cached_tokens for s in self.sessions[:: self.n])

    def usage(self) -> dict:
        """OpenAI's usage, with ``prompt_tokens_details.cached_tokens`` (the prompt's tokens a prefix cache held)."""
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # ---- close ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent, never suspends: give back the slots, close every session (cancelling unfinished ones)."""
        self.closed = True
        while self.on_close:
            self.on_close.pop()()
        if self.held:
            held, self.held = self.held, 0
            self.ctx.slots.release(held)
        for session in self.sessions:
            session.close()

    async def aclose(self) -> None:
        """The same, as a coroutine (for a response's background task); it never awaits anything."""
        self.close()


async def _pump(session: Session, queue: asyncio.Queue) -> None:
    try:
        async for step in session.steps():
            queue.put_nowait(step)
    except SwitchboardError as exc:
        queue.put_nowait(exc)
    except Exception as exc:  # never leave the merged stream waiting forever
        queue.put_nowait(SwitchboardError(ErrorKind.INTERNAL, f"choice {session.index} failed: {exc}"))


async def all_or_cancel(works: list) -> list:
    """Results in order; the first failure cancels the rest and is raised (so is our own cancellation)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
