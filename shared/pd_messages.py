"""Messages of prefill/decode disaggregation: a handed-off request's K/V between engines (``KvPart``/``KvAck``),
a dmi role assignment for the engines (``EngineRole``) and the results a prefill gateway relays to a decode
gateway's ``GET /dresult`` (``DResultFrame``). Encoded as every wire message (``shared.messages.encode``)."""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages import EngineRequest


class KvPart(msgspec.Struct, omit_defaults=True):
    """Prefill engine -> decode engine (``subjects.engine_kv``, request/reply, one part at a time): a
    handed-off request's K/V, one or more per-block chunks per part. The first part (index 0) carries the
    request and the layout and no chunk: its KvAck says how many leading blocks the decode engine's prefix
    cache holds already, and the chunks sent start after them. The decode engine takes the request on
    the last part."""

    id: str
    index: int
    count: int
    chunks: list[bytes]
    request: EngineRequest | None = None  # first part: the request, its first token in generated_ids
    layout: list[Any] = []  # first part: kv_transfer.KvLayout's fields
    num_tokens: int = 0  # first part: positions whose K/V the request's blocks hold
    first_block: int = 0  # later parts: the block the first chunk sent is (those before were cached there)


class KvAck(msgspec.Struct, omit_defaults=True):
    ok: bool
    error: str = ""
    cached_blocks: int = 0  # answer to the first part: leading blocks of the request already cached here


class EngineRole(msgspec.Struct, omit_defaults=True):
    """Gateway to every engine (``subjects.engine_role``): in dmi mode, the role a coordinator assigned to
    the server whose devices these are; the engines on them take it (flex: both)."""

    role: str  # prefill | decode | flex
    devices: list[int]


class DResultFrame(msgspec.Struct, omit_defaults=True):
    """Prefill gateway to the decode gateway a coordinator named (``subjects.gateway_dresult``): one frame
    of a PD-split request's results, which that gateway pushes down its ``GET /dresult`` connection.

    ``kind``: ``open`` (first, not pushed: ``body`` is the request to send back as ``retry:`` should the
    prefill gateway die), then ``data`` frames, then one ``lastData`` or ``error``. ``seq`` counts from 0 per
    request, so a frame lost on the bus is noticed."""

    req_id: str
    kind: str
    seq: int
    origin: str  # the prefill gateway's instance
    body: bytes = b""
