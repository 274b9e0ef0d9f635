"""Prompt encoding with MindIE's length rules (reference §2.6, ModelDeployConfig.truncation)."""

from __future__ import annotations

from shared.config import ModelDeployConfig
from shared.errors import validation
from shared.messages import GenerateRequest

MAX_TOKENS_NUM = 1048576


def encode_prompt(tokenizer, req: GenerateRequest, deploy: ModelDeployConfig) -> list[int]:
    ids = list(req.prompt_ids) if req.prompt_ids is not None else tokenizer(req.prompt).input_ids
    if not ids:
        raise validation("the prompt is empty after tokenization")
    if req.truncate and req.truncate < len(ids):
        ids = ids[-req.truncate :]
    return apply_length_limit(ids, deploy)


def apply_length_limit(ids: list[int], deploy: ModelDeployConfig) -> list[int]:
    limit = min(deploy.effective_max_input_len, MAX_TOKENS_NUM)
    if len(ids) <= limit:
        return ids
    if not deploy.truncates:
        raise validation(
            f"the prompt has {len(ids)} tokens, more than the limit of {limit} "
            "(min(maxInputTokenLen, maxSeqLen - 1)); shorten it or pass truncate"
        )
    return ids[-limit:] if deploy.truncates_left else ids[:limit]


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise validation(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
