"""vLLM ``/generate`` answers (reference §3.23b, §2.5): ``{"text": [...]}``, or NUL-terminated JSON chunks.

n (and best_of) sequences run as independent requests with seeds ``seed, seed+1, ...``; with
best_of > n the n of highest cumulative log-probability are returned.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, AsyncIterator

import msgspec

from services.gateway.errors import mindie_body
from services.gateway.session import Session
from services.gateway.vllm.schemas import VllmRequest
from shared.errors import SwitchboardError
from shared.messages import Output


def sessions_for(gateway, req: VllmRequest, count: int) -> list[Session]:
    sampling = req.sampling
    if count > 1 and sampling.seed is None:
        sampling = msgspec.structs.replace(sampling, seed=random.randint(1, 2**31 - 1))
    if count > req.n:  # ranking needs each token's log-probability
        sampling = msgspec.structs.replace(sampling, logprobs=0)
    return [Session(gateway, req.prompt, _seeded(sampling, i)) for i in range(count)]


def _seeded(sampling, i: int):
    return sampling if sampling.seed is None else msgspec.structs.replace(sampling, seed=sampling.seed + i)


async def start_all(sessions: list[Session]) -> None:
    try:
        await asyncio.gather(*(s.start() for s in sessions))
    except BaseException:
        await close_all(sessions)
        raise


async def close_all(sessions: list[Session]) -> None:
    await asyncio.gather(*(s.close() for s in sessions))


async def _run(session: Session) -> tuple[str, float]:
    text, logprob = "", 0.0
    async for out in session.outputs():
        text += "".join(t.text for t in out.tokens)
        logprob += sum(t.logprob or 0.0 for t in out.tokens)
    return text, logprob


async def collect(sessions: list[Session], req: VllmRequest) -> dict[str, Any]:
    results = await asyncio.gather(*(_run(s) for s in sessions))
    best = sorted(results, key=lambda r: r[1], reverse=True)[: req.n] if len(results) > req.n else results
    return {"text": [f"{req.prompt} {text}" for text, _ in best]}


def chunk(payload: dict[str, Any]) -> bytes:
    return msgspec.json.encode(payload) + b"\0"


async def merged(sessions: list[Session]) -> AsyncIterator[tuple[int, Output]]:
    """Outputs of all sessions as they come, tagged with the session's index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, session: Session) -> None:
        try:
            async for out in session.outputs():
                await queue.put((index, out))
        except SwitchboardError as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sessions)]
    try:
        remaining = len(sessions)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, SwitchboardError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def stream_chunks(sessions: list[Session], full_text_mode: bool) -> AsyncIterator[bytes]:
    texts = [""] * len(sessions)
    done = [False] * len(sessions)
    try:
        async for index, out in merged(sessions):
            delta = "".join(t.text for t in out.tokens)
            texts[index] += delta
            done[index] = out.finish_reason is not None
            shown = ["" if i != index else delta for i in range(len(sessions))]
            if done[index] and full_text_mode:
                shown[index] = texts[index]
            yield chunk({"text": shown})
    except SwitchboardError as exc:
        yield chunk(mindie_body(exc.kind, exc.message))
    finally:
        await close_all(sessions)
