"""How a request ends, and why one is cancelled: the enums every service and the wire use (msgspec sends
their values). ``shared.messages`` carries them in its messages and exports them."""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    """How a request ended, in every service and on the wire (msgspec sends the value). Each API family
    names these in its own words (services/gateway/common/finish.py)."""

    LENGTH = "length"  # max new tokens, or maxSeqLen
    EOS_TOKEN = "eos_token"  # an end-of-sequence or stop token id
    STOP_SEQUENCE = "stop_sequence"  # a stop string (the tokenizer finds them)
    CANCELLED = "cancelled"  # the client left, stopInfer, a cancel
    ERROR = "error"  # validation, timeout, engine failure: the event's ``error`` says which

    def __str__(self) -> str:
        return self.value

    @property
    def served(self) -> bool:
        """The request ran to an end of its own (what latency and size histograms describe)."""
        return self in (FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE)


class CancelKind(str, enum.Enum):
    """Why a request is cancelled (``Cancel.reason``)."""

    CANCELLED = "cancelled"  # an engine-internal abort with no more specific cause
    CLIENT_DISCONNECTED = "client_disconnected"  # the client's connection closed
    SUPERSEDED = "superseded"  # the gateway resumed it under a new id: the old one goes
    STOP_INFER = "stopInfer"  # Triton's stopInfer named it
    STOP_SEQUENCE = "stop_sequence"  # the tokenizer found a stop string: the engine's work is done
    GATEWAY_GONE = "gateway gone"  # its gateway's lease ran out
    ENGINE_GONE = "engine gone"  # its engine's lease ran out (the gateway resumes it)
    TOKENIZER_GONE = "tokenizer gone"  # its tokenizer's lease ran out
    EVENTS_LOST = "token events lost"  # the tokenizer saw a gap in its token events

    def __str__(self) -> str:
        return self.value

    @property
    def by_client(self) -> bool:
        """The request's own end (its client's or its gateway's doing), not a failure to recover from."""
        return self in (CancelKind.CLIENT_DISCONNECTED, CancelKind.SUPERSEDED)
