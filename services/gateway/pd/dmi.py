"""The prefill server's side of MindIE's PD split (reference §3.33): a coordinator sends a request in any
family with the ``req-id``, ``d-target``, ``req-type`` and ``is-recompute`` headers; this gateway answers
on the request itself with the first-token JSON and sends the rest, frame by frame, to the decode server
``d-target`` names, which pushes them down its ``GET /dresult`` (``dresult.py``).

The request runs exactly as any other: the same session owns it from start to end (resuming it if an
engine or tokenizer dies), and in the deployment the prompt's K/V goes from a prefill engine to a
decode engine after its first token (``services/engine/pd.py``). Only where its results go differs.

* First-token JSON: ``{"reqId", "isStream": true, "output": <the chunks up to the first token>,
  "isLastResp": false}`` for a stream; ``{"reqId", "isStream": false}`` for a whole body, which goes
  over ``/dresult`` as ``lastData:``. A request that ends with its first token answers here with
  ``isLastResp: true`` and all of its output, and sends nothing to the decode server.
* After that, each further chunk is a ``data:`` frame, the last one (with the family's trailer, e.g.
  ``data: [DONE]``) ``lastData:``, a failure ``error:``. Should the decode server die, the request is
  cancelled: nobody could read its results.
* Refused as MindIE refuses them: a request while the role is unknown or switching (503), to a server
  not in the prefill role, or with a missing or malformed header (400); in PD split ``stop`` and
  ``stop_token_ids`` (except on the OpenAI routes, which take them), and ``n`` or ``best_of`` over 1 (422 in
  the family's shape). LoRA adapters are refused by the parsers (``Served.pd_split``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from litestar import Request, Response

from services.gateway.request.call import Call
from services.gateway.request.disconnect import ClientDisconnected, unless_disconnected
from shared import bus, subjects
from shared.errors import SwitchboardError, validation
from shared.pd_messages import DResultFrame

log = logging.getLogger("switchboard.gateway")
HEX = re.compile(r"^[0-9a-fA-F]+\Z")
MAX_REQ_ID = 1024


class Refused(Exception):
    """A coordinator request this server does not take: MindIE's status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> Response:
        kind = "Bad Request" if self.status == 400 else "Service Unavailable"
        return Response({"error": self.message, "error_type": kind}, status_code=self.status,
                        media_type="application/json")


@dataclass(frozen=True)
class Ticket:
    """An admitted coordinator request: its id, the decode gateway its results go to."""

    req_id: str
    target: str  # the decode gateway's instance
    recompute: bool


def admit(request: Request, call: Call, stop_ok: bool) -> Ticket:
    """Check role, headers and the parameters PD split refuses; raises Refused or a validation error."""
    roles = call.ctx.roles
    status, _ = roles.status()
    if status != "RoleReady":
        raise Refused(503, f"The PD role of this server is not ready ({status}): the coordinator assigns it "
                           "with POST /v1/role/{role}")
    if roles.role not in ("prefill", "flex"):
        raise Refused(400, f"DMI inference requests can be sent only to the prefill node, but this node is "
                           f"{roles.role}")
    ticket = _headers(request, roles)
    _refuse_parameters(call, stop_ok)
    if ticket.req_id in roles.in_flight:  # "a globally unique request id": a second one would take the first's frames
        raise Refused(400, f"req-id {ticket.req_id} is already in flight on this server")
    roles.in_flight.add(ticket.req_id)
    call.on_close.append(lambda: roles.in_flight.discard(ticket.req_id))
    return ticket


def _headers(request: Request, roles) -> Ticket:
    h = request.headers
    req_id, target, req_type = h.get("req-id"), h.get("d-target"), h.get("req-type")
    if req_id is None or target is None or req_type is None:
        raise Refused(400, "DMI request must have req-type, req-id, d-target headers")
    if len(req_id) > MAX_REQ_ID:
        raise Refused(400, f"The length of req-id cannot exceed {MAX_REQ_ID}")
    if not HEX.match(req_id):
        raise Refused(400, "Invalid req-id, the character of req-id should be hex char (0-9, a-f, A-F)")
    if req_type != "prefill":
        raise Refused(400, f"Parameter req-type must be prefill but got {req_type}")
    if not _ipv4_target(target):
        raise Refused(400, "Parameter d-target must be an IPv4 address")
    recompute = h.get("is-recompute")
    if recompute not in (None, "true", "false"):
        raise Refused(400, "Parameter is-recompute is an optional parameter. When it is set, it must be true or false.")
    instance = roles.decode_server(target)
    if instance is None:
        raise Refused(503, f"No decode server is linked at d-target {target}")
    return Ticket(req_id, instance, recompute == "true")


def _ipv4_target(target: str) -> bool:
    ip, sep, port = target.partition(";")
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        return False
    return not sep or (port.isdigit() and 0 < int(port) < 65536)


def _refuse_parameters(call: Call, stop_ok: bool) -> None:
    if call.n > 1:
        raise validation(f"n must be 1 in dmi mode, got {call.n}.", "n")
    for session in call.sessions:
        sampling = session.request.sampling
        if sampling.stop and not stop_ok:
            raise validation("stop is not supported in dmi mode.", "stop")
        if sampling.stop_token_ids and not stop_ok:
            raise validation("stop_token_ids is not supported in dmi mode.", "stop_token_ids")


# ---- answering and relaying --------------------------------------------------------------------


class Relay:
    """Frames of one request to its decode gateway, numbered from 0 (``open``). Once the first-token JSON
    is answered, the relay owns the call (``Call.detach``) and closes it when its frames are sent."""

    def __init__(self, call: Call, ticket: Ticket):
        self.call, self.ticket = call, ticket
        self.seq = 0

    async def send(self, kind: str, body: bytes) -> None:
        ctx = self.call.ctx
        await bus.publish(ctx.nc, subjects.gateway_dresult(self.ticket.target),
                          DResultFrame(self.ticket.req_id, kind, self.seq, ctx.instance, body))
        self.seq += 1

    def target_live(self) -> bool:
        return self.call.ctx.roles.is_live(self.ticket.target)

    def take_over(self, work: Callable[[], Awaitable[None]]) -> None:
        """Own the call from now on: send the rest of its frames in the background (``finish``)."""
        self.call.detach()
        self.call.ctx.spawn(self.finish(work))

    async def finish(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` (which sends the frames), then ``error:`` on a failure; close the call however it ends."""
        try:
            await work()
        except SwitchboardError as exc:
            await self.send("error", exc.message.encode())
        except _TargetGone:
            log.warning("decode server gone: request cancelled", extra={"req_id": self.ticket.req_id})
        except Exception as exc:  # noqa: BLE001 - the coordinator must hear of the end
            log.exception("dmi relay failed", exc_info=exc)
            await self.send("error", b"Server internal error")
        finally:
            self.call.close()


class _TargetGone(Exception):
    pass


def _reply(ticket: Ticket, streaming: bool, output: bytes | None = None, last: bool = False) -> Response:
    """The first-token JSON; ``output`` and ``isLastResp`` only when there is output (as MindIE's source)."""
    body: dict[str, Any] = {"reqId": ticket.req_id, "isStream": streaming}
    if output is not None:
        body.update(output=output.decode("utf-8", "replace"), isLastResp=last)
    return Response(body, media_type="application/json")


async def respond(request: Request, call: Call, ticket: Ticket, streaming: bool, body: Callable[[], Awaitable[Any]],
                  chunks: Callable[[], AsyncIterator[bytes]], trailer: bytes) -> Response:
    """The started call's first-token JSON; the rest goes on in the background to the decode server (the
    relay takes the call over then; until then its caller's ``async with`` owns it)."""
    relay = Relay(call, ticket)
    try:
        if streaming:
            return await _respond_stream(request, relay, chunks(), trailer)
        return await _respond_body(request, relay, body)
    except ClientDisconnected:
        return Response(b"", status_code=499)


async def _respond_stream(request: Request, relay: Relay, it: AsyncIterator[bytes], trailer: bytes) -> Response:
    head, ended = await unless_disconnected(request, _until_first_tokens(relay.call, it))
    if ended:
        return _reply(relay.ticket, True, head + trailer, last=True)
    await relay.send("open", await request.body())
    relay.take_over(lambda: _relay_stream(relay, it, trailer))
    return _reply(relay.ticket, True, head)


async def _until_first_tokens(call: Call, it: AsyncIterator[bytes]) -> tuple[bytes, bool]:
    """The chunks up to the one carrying every choice's first token; True when the stream ended there."""
    head = b""
    async for chunk in it:
        head += chunk
        if call.has_first_tokens() and not call.ended():
            return head, False
    return head, True


async def _relay_stream(relay: Relay, it: AsyncIterator[bytes], trailer: bytes) -> None:
    held: bytes | None = None
    async for chunk in it:
        if not relay.target_live():
            raise _TargetGone()
        if held is not None:
            await relay.send("data", held)
        held = chunk
    await relay.send("lastData", (held or b"") + trailer)


async def _respond_body(request: Request, relay: Relay, body: Callable[[], Awaitable[Any]]) -> Response:
    call = relay.call
    task = asyncio.ensure_future(body())
    first = asyncio.ensure_future(call.first_tokens())
    try:
        await unless_disconnected(request, asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED))
    except BaseException:
        task.cancel()
        raise
    finally:
        first.cancel()
    if task.done():
        return _reply(relay.ticket, False, _render(task.result()), last=True)
    await relay.send("open", await request.body())
    relay.take_over(lambda: _relay_body(relay, task))
    return _reply(relay.ticket, False)


async def _relay_body(relay: Relay, task: asyncio.Future) -> None:
    while not task.done():
        await asyncio.wait({task}, timeout=relay.call.ctx.heartbeat_s)
        if not task.done() and not relay.target_live():
            task.cancel()
            raise _TargetGone()
    await relay.send("lastData", _render(task.result()))


def _render(result: Any) -> bytes:
    if isinstance(result, Response):
        return result.render(result.content, result.media_type)
    return result if isinstance(result, bytes) else msgspec.json.encode(result)
