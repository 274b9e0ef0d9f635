"""Per-request sampling in one batched pass over the step's logits.

Order as transformers applies it: repetition penalty (then vLLM's presence and frequency
penalties on generated tokens), temperature, top-k, top-p, typical-p, then greedy argmax or a draw
from each request's own seeded generator (so a seeded request gives the same tokens whatever else
shares its batch). Log-probabilities, when asked for, are those of the model's raw distribution.
"""

from __future__ import annotations

import torch

from services.engine.sequence import Sequence
from shared.messages import TokenLogprob


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    apply_repetition_penalty(logits, seqs)
    apply_output_penalties(logits, seqs)
    greedy = logits.argmax(dim=-1).tolist()
    rows = [i for i, s in enumerate(seqs) if s.sampling.sampling]
    if not rows:
        return greedy
    sub = [seqs[i] for i in rows]
    probs = warp(logits[rows], sub).softmax(dim=-1)
    for j, (i, seq) in enumerate(zip(rows, sub)):
        greedy[i] = int(torch.multinomial(probs[j], 1, generator=generator_for(seq)))
    return greedy


def generator_for(seq: Sequence) -> torch.Generator:
    if seq.generator is None:
        seq.generator = torch.Generator(device="cpu")
        seq.generator.manual_seed(seq.sampling.seed or 0)
    return seq.generator


def apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for i, seq in enumerate(seqs):
        penalty = seq.sampling.repetition_penalty
        if penalty == 1.0:
            continue
        ids = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        scores = logits[i, ids]
        logits[i, ids] = torch.where(scores < 0, scores * penalty, scores / penalty)


def apply_output_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI presence/frequency penalties: subtract per generated occurrence (frequency) and once (presence)."""
    for i, seq in enumerate(seqs):
        presence, frequency = seq.sampling.presence_penalty, seq.sampling.frequency_penalty
        if (presence == 0.0 and frequency == 0.0) or seq.num_generated == 0:
            continue
        generated = torch.tensor(seq.token_ids[seq.num_prompt_tokens:], device=logits.device)
        counts = torch.bincount(generated, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits[i] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


@torch.inference_mode()
def raw_logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
    """Log-softmax rows of the requests that asked for logprobs, taken before any penalty or warper."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if not rows:
        return {}
    return dict(zip(rows, logits[rows].float().log_softmax(dim=-1)))


def token_logprob(row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    if k <= 0:
        return TokenLogprob(float(row[token_id]))
    top = row.topk(min(k, row.shape[-1]))
    return TokenLogprob(float(row[token_id]), top.indices.tolist(), top.values.tolist())


def warp(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.sampling.temperature for s in seqs], device=logits.device)
    logits = logits / temps[:, None]
    if any(s.sampling.top_k > 0 for s in seqs):
        logits = top_k(logits, [s.sampling.top_k for s in seqs])
    if any(s.sampling.top_p < 1.0 for s in seqs):
        logits = top_p(logits, [s.sampling.top_p for s in seqs])
    for i, seq in enumerate(seqs):
        if seq.sampling.typical_p < 1.0:
            logits[i] = typical_p(logits[i], seq.sampling.typical_p)
    return logits


def top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in ks], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    p = torch.tensor(ps, device=logits.device)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[:, -1] = False  # keep at least the most likely token
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def typical_p(logits: torch.Tensor, mass: float) -> torch.Tensor:
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(torch.nan_to_num(log_probs * probs)).sum()
    shifted = (-log_probs - entropy).abs()
    sorted_shifted, order = shifted.sort()
    cumulative = probs.gather(-1, order).cumsum(dim=-1)
    last = int((cumulative < mass).sum().clamp(max=len(cumulative) - 1))
    remove = sorted_shifted > sorted_shifted[last]
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
