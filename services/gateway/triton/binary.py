"""KServe v2 binary-tensor extension: a JSON header, then raw little-endian tensor bytes.

The request names the header's length in ``Inference-Header-Content-Length``; each binary input
gives its byte count in ``parameters.binary_data_size``. Responses use the same layout.
Plain ``struct``: the gateway needs no numpy.
"""

from __future__ import annotations

import struct
import zlib

from shared.errors import validation

HEADER = "Inference-Header-Content-Length"
UINT32_BYTES = 4
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: gzip|deflate`` (tritonclient's request compression), at most ``limit`` bytes."""
    if not encoding or encoding.lower() == "identity":
        return body
    wbits = _WBITS.get(encoding.lower())
    if wbits is None:
        raise validation(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none.")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit)
    except zlib.error:
        raise validation(f"the request body is not valid {encoding} data.") from None
    if inflater.unconsumed_tail:
        raise validation(f"the decompressed request body is larger than {limit} bytes.")
    return data


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tail that follows it."""
    if header_length is None:
        return body, b""
    try:
        size = int(header_length)
    except ValueError:
        raise validation(f"{HEADER} must be an integer, got {header_length!r}.") from None
    if not 0 < size <= len(body):
        raise validation(f"{HEADER} must be in (0, {len(body)}] (the body length), got {size}.")
    return body[:size], body[size:]


class Tail:
    """Hands out the binary tail's bytes to the inputs, in order."""

    def __init__(self, blob: bytes):
        self.blob = blob
        self.offset = 0

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.blob):
            raise validation(f"binary_data_size {size} runs past the end of the request body "
                             f"({len(self.blob) - self.offset} bytes left).")
        chunk = self.blob[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def check_consumed(self) -> None:
        if self.offset != len(self.blob):
            raise validation(f"the request body has {len(self.blob) - self.offset} bytes after the last "
                             "binary input; check binary_data_size and Inference-Header-Content-Length.")


def unpack_uint32(raw: bytes) -> list[int]:
    if len(raw) % UINT32_BYTES:
        raise validation(f"binary UINT32 data must be a multiple of 4 bytes, got {len(raw)}.")
    return list(struct.unpack(f"<{len(raw) // UINT32_BYTES}I", raw))


def pack_uint32(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


_SCALARS = {"BOOL": "?", "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "UINT8": "B", "UINT16": "H",
            "UINT32": "I", "UINT64": "Q", "FP32": "f", "FP64": "d"}


def unpack_tensor(datatype: str, raw: bytes) -> list:
    """A binary tensor's elements: BYTES as length-prefixed strings (4-byte little-endian length), others raw."""
    if datatype == "BYTES":
        return _unpack_bytes(raw)
    code = _SCALARS.get(datatype)
    if code is None:
        raise validation(f"Unsupported datatype, got {datatype}.")
    size = struct.calcsize(code)
    if len(raw) % size:
        raise validation(f"binary {datatype} data must be a multiple of {size} bytes, got {len(raw)}.")
    return list(struct.unpack(f"<{len(raw) // size}{code}", raw))


def _unpack_bytes(raw: bytes) -> list[bytes]:
    items, offset = [], 0
    while offset < len(raw):
        if offset + UINT32_BYTES > len(raw):
            raise validation("binary BYTES data ends inside an element's 4-byte length.")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += UINT32_BYTES
        if offset + length > len(raw):
            raise validation(f"binary BYTES element of {length} bytes runs past the end of its data.")
        items.append(raw[offset:offset + length])
        offset += length
    return items


def pack_bytes(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)
