"""Triton response shapes: token-id tensors (seed 004) and text objects / ``data:`` events (seed 002).

Timings are the gateway's view, in milliseconds: ``perf_stat`` pairs each token id with the time
since the previous token (since arrival for the first), ``prefill_time`` / ``decode_time`` carry
the same for a streamed event, ``queue_wait_time`` is arrival until the tokenizer accepted the
request (first event; 0 afterwards), ``batch_size`` the engine's running requests at that moment.
``first_token_cost`` / ``decode_cost`` are null, as in the seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from litestar import Response

from services.gateway.common import finish
from services.gateway.request.call import Call
from services.gateway.request.session import End, Session
from services.gateway.triton.binary import HEADER, pack_bytes, pack_uint32
from services.gateway.triton.llm_infer import TextInferRequest
from services.gateway.triton.schemas import Options
from services.gateway.web.errors import mindie_body
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import TokenOut


def finish_reason(end: End) -> str:
    return finish.tgi(end.finish_reason)


# ---- /infer ----------------------------------------------------------------------------------


async def infer_response(call: Call, binary: bool) -> Response:
    """Run to the end; the generated ids as the ``output0`` tensor, JSON or binary."""
    ids = [token.id for token in (await call.results())[0].tokens]
    return tensor_response(call.sessions[0], [Tensor("output0", "UINT32", [1, len(ids)], ids, binary)])


async def text_infer_response(call: Call, req: TextInferRequest) -> Response:
    """Run to the end; ``text_output`` (and the counts and finish reason the request asked for)."""
    end = (await call.results())[0]
    text = f"{req.text}{end.text}" if req.include_prompt else end.text
    values = {"text_output": ("BYTES", text), "finish_reason": ("BYTES", finish.openai(end.finish_reason)),
              "num_input_tokens": ("UINT32", end.prompt_tokens),
              "num_output_tokens": ("UINT32", end.generated_tokens)}
    return tensor_response(call.sessions[0], [Tensor(name, values[name][0], [1], [values[name][1]], binary)
                                              for name, binary in req.outputs])


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: list[int]
    data: list
    binary: bool


def tensor_response(session: Session, tensors: list[Tensor]) -> Response:
    """KServe's infer response: ``id``, ``model_name`` and the outputs, JSON or with binary tensors after a header."""
    outputs, blobs = [], []
    for tensor in tensors:
        output: dict[str, Any] = {"name": tensor.name, "shape": tensor.shape, "datatype": tensor.datatype}
        if tensor.binary:
            raw = _packed(tensor)
            output["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            output["data"] = tensor.data
        outputs.append(output)
    head = {"id": session.user_id, "model_name": session.ctx.model, "outputs": outputs}
    if not blobs:
        return Response(head, media_type="application/json")
    header = msgspec.json.encode(head)
    return Response(header + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER: str(len(header))})


def _packed(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return pack_bytes([value.encode() for value in tensor.data])
    return pack_uint32(tensor.data)


# ---- /generate, /generate_stream --------------------------------------------------------------


class Clock:
    """Per-token costs in ms for perf_stat, prefill_time and decode_time."""

    def __init__(self, session: Session):
        self.queue_wait_ms = round((time.time() - session.arrival) * 1000)
        self.last = session.arrival
        self.perf: list[list[int]] = []

    def tick(self, tokens: list[TokenOut]) -> list[int]:
        now = time.time()
        share = (now - self.last) * 1000 / max(1, len(tokens))
        self.last = now
        costs = [round(share)] * len(tokens)
        self.perf.extend([token.id, cost] for token, cost in zip(tokens, costs))
        return costs


def _head(session: Session, text: str) -> dict[str, Any]:
    return {"id": session.user_id, "model_name": session.ctx.model, "model_version": None, "text_output": text}


def _details(clock: Clock, options: Options, upto: int, end: End | None) -> dict[str, Any]:
    """Details after the first ``upto`` tokens (``end`` set on the last)."""
    details: dict[str, Any] = {"finish_reason": finish_reason(end)} if end is not None else {}
    details.update(generated_tokens=upto, first_token_cost=None, decode_cost=None)
    if options.perf_stat:
        details["perf_stat"] = [list(pair) for pair in clock.perf[:upto]]
    return details


async def collect_text(call: Call, options: Options) -> dict[str, Any]:
    session = call.sessions[0]
    clock = Clock(session)
    async for step in call.steps():
        clock.tick(step.tokens)
        if step.end is not None:
            body = _head(session, step.end.text)
            if options.details or options.perf_stat:
                body["details"] = _details(clock, options, len(clock.perf), step.end)
            return body
    raise SwitchboardError(ErrorKind.INTERNAL, "the request ended without an end event")


def sse(payload: dict[str, Any]) -> bytes:
    """Triton framing: ``data:`` with no space (reference §2.5)."""
    return b"data:" + msgspec.json.encode(payload) + b"\n\n"


def error_event(exc: SwitchboardError) -> bytes:
    return sse(mindie_body(exc.kind, exc.message))


async def stream_events(call: Call, options: Options) -> AsyncIterator[bytes]:
    """One event per token; the last carries details.finish_reason (an empty one if no token came with the end)."""
    session = call.sessions[0]
    clock = Clock(session)
    async for step in call.steps():
        costs = clock.tick(step.tokens)
        done = len(clock.perf) - len(costs)
        for index, (token, cost) in enumerate(zip(step.tokens, costs)):
            end = step.end if index == len(costs) - 1 else None
            yield sse(_event(session, clock, options, token.text, cost, done + index + 1, end))
        if step.end is not None and not step.tokens:
            yield sse(_event(session, clock, options, "", 0, len(clock.perf), step.end))


def _event(session: Session, clock: Clock, options: Options, text: str, cost: int, upto: int,
           end: End | None) -> dict[str, Any]:
    """The event for token number ``upto`` (1-based)."""
    event = _head(session, text)
    first = upto <= 1
    if options.details or options.perf_stat:
        details = _details(clock, options, upto, end)
        engine = session.ctx.engine_info()
        details["batch_size"] = max(1, engine.running) if engine else 1
        details["queue_wait_time"] = clock.queue_wait_ms if first else 0
        event["details"] = details
    event["prefill_time"] = cost if first else None
    event["decode_time"] = None if first else cost
    return event
