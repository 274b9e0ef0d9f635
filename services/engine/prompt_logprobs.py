"""Prompt logprobs (``prompt_logprobs`` of vLLM's sampling parameters): which rows of a step predict a prompt
token whose logprob its request asked for, and those logprobs from the rows' final hidden states."""

from __future__ import annotations

import torch

from services.engine.scheduler import Scheduled
from shared.messages import TokenLogprob

PROMPT_LOGITS_ROWS = 256  # rows whose full-vocabulary logits exist at once


def prompt_rows(items: list[Scheduled]) -> list[tuple[int, int, int]]:
    """(item index, row in the flat batch, prompt position it predicts) for each prompt token after the
    first whose logprob a chunk computes: row r holds position p's hidden state, which predicts p + 1."""
    wanted, offset = [], 0
    for index, item in enumerate(items):
        seq = item.seq
        if seq.wants_prompt_logprobs:
            start = seq.num_computed
            end = min(start + item.num_tokens, len(seq.prompt_ids) - 1)
            wanted.extend((index, offset + p - start, p + 1) for p in range(start, end))
        offset += item.num_tokens
    return wanted


@torch.inference_mode()
def prompt_logprobs(lm_head, items: list[Scheduled], wanted: list[tuple[int, int, int]],
                    hidden: torch.Tensor) -> dict[int, dict[int, TokenLogprob]]:
    """Per item, the logprob, vocabulary rank (vLLM's ``rank``, 1 the likeliest) and top alternatives of each
    prompt token its chunk predicts (``wanted``, from ``prompt_rows``; ``hidden``: their rows' final hidden
    states); the vocabulary-wide logits are made ``PROMPT_LOGITS_ROWS`` rows at a time, read back once each."""
    out: dict[int, dict[int, TokenLogprob]] = {}
    for start in range(0, len(wanted), PROMPT_LOGITS_ROWS):
        part = wanted[start:start + PROMPT_LOGITS_ROWS]
        rows = lm_head(hidden[start:start + len(part)]).float().log_softmax(dim=-1)
        seqs = [items[index].seq for index, _, _ in part]
        ids = torch.tensor([seq.token_ids[position] for seq, (_, _, position) in zip(seqs, part)], device=rows.device)
        chosen = rows.gather(1, ids[:, None])
        ranks = (rows > chosen).sum(dim=-1) + 1
        k = min(max(seq.sampling.prompt_logprobs or 0 for seq in seqs), rows.shape[-1])
        top = rows.topk(k) if k > 0 else None
        top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
        for j, (seq, (index, _, position), logprob, rank) in enumerate(
                zip(seqs, part, chosen[:, 0].tolist(), ranks.tolist())):
            asked = seq.sampling.prompt_logprobs or 0
            picks = (top_ids[j][:asked], top_values[j][:asked]) if asked > 0 else ([], [])
            out.setdefault(index, {})[position] = TokenLogprob(logprob, *picks, rank=rank)
    return out
