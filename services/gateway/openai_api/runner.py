"""The sessions of one OpenAI request (prompts × n choices), run concurrently, closed together."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Iterable

import msgspec

from services.gateway.openai_api.params import SEED_MAX
from services.gateway.session import Session
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import Output, Sampling, Started, TokenOut


class Batch:
    """Choice ``p * n + j`` is the ``j``-th sample of prompt ``p`` (vLLM's order)."""

    def __init__(self, sessions: list[Session], n: int):
        self.sessions = sessions
        self.n = n
        self.started: list[Started] = []
        self.closed = False

    @classmethod
    def build(cls, gateway, prompts: list[dict[str, Any]], sampling: Sampling, n: int) -> "Batch":
        """``prompts``: Session keyword arguments per prompt (``prompt``, ``prompt_ids``, ``messages`` …)."""
        sessions = [Session(gateway, p.get("prompt", ""), _choice_sampling(sampling, j),
                            **{k: v for k, v in p.items() if k != "prompt"})
                    for p in prompts for j in range(n)]
        return cls(sessions, n)

    def __len__(self) -> int:
        return len(self.sessions)

    async def start(self) -> list[Started]:
        self.started = await all_or_cancel(s.start() for s in self.sessions)
        return self.started

    def prompt_of(self, index: int) -> int:
        return index // self.n

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counted once, however many choices it has."""
        return sum(started.prompt_tokens for started in self.started[:: self.n])

    @property
    def completion_tokens(self) -> int:
        return sum(s.generated for s in self.sessions)

    def usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def collect(self) -> list[list[TokenOut]]:
        """Every choice's tokens, once all have finished (their end reasons are on the sessions)."""
        return await all_or_cancel(_tokens(s) for s in self.sessions)

    async def events(self) -> AsyncIterator[tuple[int, Output]]:
        """``(choice index, output)`` as they come, until every choice has finished."""
        if len(self.sessions) == 1:
            async for out in self.sessions[0].outputs():
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(self.sessions)]
        try:
            left = len(pumps)
            while left:
                index, item = await queue.get()
                if isinstance(item, SwitchboardError):
                    raise item
                left -= item.finish_reason is not None
                yield index, item
        finally:
            for pump in pumps:
                pump.cancel()

    async def close(self) -> None:
        """Idempotent: a stream closes its batch when it ends and again once the response is over."""
        if not self.closed:
            self.closed = True
            await asyncio.gather(*(s.close() for s in self.sessions))


def _choice_sampling(sampling: Sampling, j: int) -> Sampling:
    """A given seed stays reproducible yet gives n different choices: choice j uses seed + j."""
    if j == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + j) % (SEED_MAX + 1))


async def _tokens(session: Session) -> list[TokenOut]:
    tokens: list[TokenOut] = []
    async for out in session.outputs():
        tokens.extend(out.tokens)
    return tokens


async def _pump(index: int, session: Session, queue: asyncio.Queue) -> None:
    try:
        async for out in session.outputs():
            queue.put_nowait((index, out))
    except SwitchboardError as exc:
        queue.put_nowait((index, exc))
    except Exception as exc:  # never leave the merged stream waiting forever
        queue.put_nowait((index, SwitchboardError(ErrorKind.INTERNAL, f"choice {index} failed: {exc}")))


async def all_or_cancel(works: Iterable[Awaitable]) -> list:
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
