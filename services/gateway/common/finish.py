"""Each API family's words for how a request ended (``shared.messages.FinishReason``), as errors.py holds
their error statuses. The families take these from here, never from each other."""

from __future__ import annotations

from shared.messages import FinishReason

# TGI's three, which MindIE's native API and Triton's generate answers use too: an abort (stopInfer, a
# failure) reads stop_sequence, as MindIE maps it.
TGI = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS_TOKEN: "eos_token",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.CANCELLED: "stop_sequence",
    FinishReason.ERROR: "stop_sequence",
}

# OpenAI's: a token or string that stops, and a stopInfer abort, are "stop"; the limit is "length". (A chat
# whose answer is tool calls says "tool_calls": openai_api/chat_responses.py.)
OPENAI = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS_TOKEN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.CANCELLED: "stop",
    FinishReason.ERROR: "stop",
}


def tgi(reason: FinishReason) -> str:
    return TGI[reason]


def openai(reason: FinishReason | None) -> str | None:
    return None if reason is None else OPENAI[reason]
