"""Each API family's words for how a request ended (``shared.messages.FinishReason``), as errors.py holds
their error statuses. The families take these from here, never from each other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.messages import FinishReason

if TYPE_CHECKING:
    from services.gateway.request.session import End

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


def vllm_stop_reason(end: End | None, stop_token_ids: list[int]) -> str | int | None:
    """vLLM's ``stop_reason`` beside OpenAI's finish_reason: the stop string that ended the answer, or the
    ``stop_token_ids`` id it ended on; None for the model's own end token, the limit, or while it runs."""
    if end is None:
        return None
    if end.finish_reason is FinishReason.STOP_SEQUENCE and end.stop:
        return end.stop
    if end.finish_reason is FinishReason.EOS_TOKEN and end.tokens and end.tokens[-1].id in stop_token_ids:
        return end.tokens[-1].id
    return None
