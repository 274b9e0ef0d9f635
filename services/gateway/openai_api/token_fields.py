"""vLLM's token-level extras on chat and completions: ``prompt_logprobs`` (each prompt token's logprob, its rank in
the vocabulary and the most likely alternatives, the first token's null) and ``return_token_ids`` (the prompt's and
the answer's token ids beside the text), as vLLM's OpenAI server reads and writes them."""

from __future__ import annotations

from typing import Any

from services.gateway.openai_api.errors import bad_param
from services.gateway.web.validation import Fields
from shared.messages import TokenOut

PROMPT_LOGPROBS_MAX = 20  # vLLM's default max_logprobs
LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf (JSON has none)


def prompt_logprobs_field(f: Fields, stream: bool) -> int | None:
    """``prompt_logprobs``: how many alternatives each prompt token lists beside itself (0..20), or None."""
    value = f.data.get("prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param("prompt_logprobs", "`prompt_logprobs` must be an integer.")
    if value < -1:
        raise bad_param("prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")
    if value == -1 or value > PROMPT_LOGPROBS_MAX:
        asked = "the whole vocabulary (-1)" if value == -1 else str(value)
        raise bad_param("prompt_logprobs", f"Requested prompt logprobs of {asked}, which is greater than max "
                                           f"allowed: {PROMPT_LOGPROBS_MAX}.")
    if stream:
        raise bad_param("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
    return value


def prompt_logprobs_json(tokens: list[TokenOut], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token ``{"<id>": {"logprob", "rank",
    "decoded_token"}}``, the token itself first, then its ``k`` likeliest alternatives (ranks 1..k)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token in tokens:
        if token.logprob is None:
            out.append(None)
            continue
        entry = {str(token.id): _logprob(token.logprob, token.rank, token.own_text)}
        for rank, alt in enumerate(token.top[:k], 1):
            entry.setdefault(str(alt.id), _logprob(alt.logprob, rank, alt.text))
        out.append(entry)
    return out


def _logprob(value: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": max(value, LOGPROB_FLOOR), "rank": rank, "decoded_token": text}


def token_ids(tokens: list[TokenOut]) -> list[int]:
    return [token.id for token in tokens]
