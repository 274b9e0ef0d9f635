"""vLLM ``/generate`` answers (reference §3.23b, §2.5): ``{"text": [...]}``, or NUL-terminated JSON chunks.

n (or best_of) sequences run as the choices of one call (seeds ``seed, seed+1, ...`` when a seed is
given); with best_of > n the n of highest cumulative log-probability are returned.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import msgspec

from services.gateway.common.content import prompt_parts
from services.gateway.common.sampling import choice_sampling
from services.gateway.request.call import Call
from services.gateway.request.context import SessionContext
from services.gateway.request.session import Session
from services.gateway.vllm.schemas import VllmRequest
from services.gateway.web.errors import mindie_body
from shared.errors import SwitchboardError


def build_call(ctx: SessionContext, req: VllmRequest) -> Call:
    """A stream returns its n sequences as they come; a body ranks best_of of them."""
    count = req.n if req.stream else req.best_of
    sampling = req.sampling
    if count > req.n:  # ranking needs each token's log-probability
        sampling = msgspec.structs.replace(sampling, logprobs=0)
    return Call(ctx, [Session(ctx, req.prompt, choice_sampling(sampling, j), adapter=req.adapter, api="vllm",
                              parts=prompt_parts(req.listed)) for j in range(count)])


async def collect(call: Call, req: VllmRequest) -> dict[str, Any]:
    ends = await call.results()
    if len(ends) > req.n:
        ends = sorted(ends, key=lambda end: sum(t.logprob or 0.0 for t in end.tokens), reverse=True)[: req.n]
    return {"text": [f"{req.prompt} {end.text}" for end in ends]}


def chunk(payload: dict[str, Any]) -> bytes:
    return msgspec.json.encode(payload) + b"\0"


def error_chunk(exc: SwitchboardError) -> bytes:
    return chunk(mindie_body(exc.kind, exc.message))


async def stream_chunks(call: Call, full_text_mode: bool) -> AsyncIterator[bytes]:
    """One chunk per step of any sequence: its delta at its index, "" for the others."""
    for_all = [""] * len(call)
    async for step in call.steps():
        shown = list(for_all)
        shown[step.index] = step.end.text if step.end is not None and full_text_mode else step.text
        yield chunk({"text": shown})
