"""Per-request sampling in one batched pass over the step's logits.

Order as transformers applies it, vLLM's masks first (allowed token ids, bad words): repetition penalty (then
vLLM's presence and frequency penalties on generated tokens, and OpenAI's logit bias), temperature, min-p (vLLM's), top-k, top-p,
typical-p, then greedy argmax or a seeded draw. A temperature below ``SAMPLING_EPS`` (vLLM's) is greedy. Each draw uses a generator
seeded from (request seed, tokens so far), so a seeded request gives the same tokens whatever else
shares its batch, re-running a step draws the same token again, and a request resumed elsewhere
continues the same sequence. A row whose distribution cannot be formed (every logit -inf, NaN,
+inf from an extreme penalty) falls back to greedy on the raw logits, within ``allowed_token_ids`` (bad words and
min_tokens' holds that leave no allowed token give way), instead of raising; parameters no family
accepts (NaN, a negative temperature or penalty) raise ``ValueError`` for the engine to isolate.
Log-probabilities, when asked for, are those of the model's raw distribution.
"""

from __future__ import annotations

import math

import torch

from services.engine.sequence import Sequence
from shared.messages import Sampling, TokenLogprob

SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature means greedy
_MASK64 = (1 << 64) - 1


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row; ``logits`` is modified in place (penalties)."""
    for seq in seqs:
        check_sampling(seq.sampling)
    if all(plain_greedy(seq.sampling) for seq in seqs):
        return greedy_only(logits)
    return sample_on_device(logits, seqs).tolist()


@torch.inference_mode()
def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], last: torch.Tensor | None = None) -> torch.Tensor:
    """``sample``'s tokens (parameters checked), left on the device: no host sync. ``logits`` is modified in place
    (penalties). ``last``: each row's last token, on the device (a step launched ahead: ``seq.token_ids`` holds a
    placeholder there); None: ``seq.token_ids`` is whole."""
    apply_allowed_token_ids(logits, seqs)  # vLLM's order: allowed ids, bad words, logit bias, penalties
    fallback = best_finite(logits)  # a row the masks after the allow-list leave empty keeps to the list
    apply_bad_words(logits, seqs)
    apply_logit_bias(logits, seqs)
    apply_repetition_penalty(logits, seqs, last)
    apply_output_penalties(logits, seqs, last)
    hold_ending_ids(logits, seqs)
    tokens = greedy_ids(logits, fallback)
    rows = [i for i, s in enumerate(seqs) if draws(s.sampling)]
    if rows:
        index = on_device(rows, logits.device, torch.long)
        drawn, valid = draw_on_device(logits.index_select(0, index), [seqs[i] for i in rows])
        tokens.index_copy_(0, index, torch.where(valid, drawn, tokens.index_select(0, index)))  # else the greedy one
    return tokens


def on_device(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a tensor on ``device``, with no host sync on cuda (a pinned copy, not a pageable one)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@torch.inference_mode()
def draw_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's seeded draw (rows that ``draws``), and whether its distribution could be formed (else the row
    keeps its greedy token), both left on the device: no host sync. The draw is ``torch.multinomial``'s for one
    sample (the argmax of p / q, q ~ Exp(1) from the row's generator) without its two checks that read values
    back."""
    probs = warp(logits, seqs).softmax(dim=-1)
    valid = torch.isfinite(probs).all(dim=-1)
    q = torch.empty_like(probs)
    for j, seq in enumerate(seqs):
        q[j].exponential_(1, generator=generator_for(seq, probs.device))
    return (probs / q).argmax(dim=-1), valid


def greedy_ids(logits: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax, left on the device (no host sync); a row whose maximum is NaN or -inf (NaN logits, or
    none finite) takes ``fallback`` (default: its NaN-ignoring argmax, as ``greedy_only``)."""
    best, index = logits.max(dim=-1)
    broken = best.isnan() | (best == float("-inf"))
    return torch.where(broken, best_finite(logits) if fallback is None else fallback, index)


def plain_greedy(sampling: Sampling) -> bool:
    """Greedy with no penalty or bias: the token is the raw argmax."""
    return (not draws(sampling) and sampling.repetition_penalty == 1.0
            and sampling.presence_penalty == 0.0 and sampling.frequency_penalty == 0.0 and not sampling.logit_bias
            and not sampling.min_tokens and not sampling.allowed_token_ids and not sampling.bad_words_ids)


def greedy_only(logits: torch.Tensor) -> list[int]:
    """The all-greedy batch (the common case): one pass over the logits; only a row whose maximum is
    NaN or -inf (NaN logits, or none finite) takes the NaN-ignoring argmax."""
    best, index = logits.max(dim=-1)
    broken = best.isnan() | (best == float("-inf"))
    if bool(broken.any()):
        index = torch.where(broken, best_finite(logits), index)
    return index.tolist()


def draws(sampling: Sampling) -> bool:
    """Whether the request samples: asked to, and with a temperature of at least ``SAMPLING_EPS``."""
    return sampling.sampling and sampling.temperature >= SAMPLING_EPS


def check_sampling(sampling: Sampling) -> None:
    """Raise ``ValueError`` for a value no API family accepts (the gateway validates the rest)."""
    for name in ("temperature", "top_p", "typical_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if math.isnan(getattr(sampling, name)):
            raise ValueError(f"sampling parameter {name} is NaN")
    if sampling.temperature < 0:
        raise ValueError(f"temperature must not be negative, got {sampling.temperature}")
    if sampling.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be positive, got {sampling.repetition_penalty}")


def best_finite(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row, NaN ignored (the fallback of rows whose distribution cannot be formed); no host sync."""
    return logits.nan_to_num(nan=float("-inf")).argmax(dim=-1)


def position_seed(seed: int, position: int) -> int:
    """A well-spread 63-bit seed for the draw at ``position`` (splitmix64 of seed and position)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def generator_for(seq: Sequence, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for this sequence's next draw: a function of its seed and its length only."""
    return torch.Generator(device=device).manual_seed(position_seed(seq.sampling.seed or 0, len(seq)))


def apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence], last: torch.Tensor | None = None) -> None:
    """transformers' repetition penalty on each token the sequence holds (prompt and output), in place; no host
    sync. ``last``: as ``sample_on_device``'s."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.repetition_penalty != 1.0]
    if not rows:
        return
    index = on_device(rows, logits.device, torch.long)
    counts = token_counts(logits, [seqs[i] for i in rows], [0] * len(rows), last, index)
    penalty = on_device([seqs[i].sampling.repetition_penalty for i in rows], logits.device, logits.dtype)[:, None]
    scores = logits.index_select(0, index)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    logits.index_copy_(0, index, torch.where(counts > 0, penalised, scores))


def apply_output_penalties(logits: torch.Tensor, seqs: list[Sequence], last: torch.Tensor | None = None) -> None:
    """OpenAI presence/frequency penalties: subtract per generated occurrence (frequency) and once (presence), in
    place; no host sync. ``last``: as ``sample_on_device``'s."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.presence_penalty != 0.0 or seq.sampling.frequency_penalty != 0.0]
    if not rows:
        return
    chosen = [seqs[i] for i in rows]
    index = on_device(rows, logits.device, torch.long)
    counts = token_counts(logits, chosen, [seq.num_prompt_tokens for seq in chosen], last, index)
    frequency = on_device([seq.sampling.frequency_penalty for seq in chosen], logits.device, logits.dtype)[:, None]
    presence = on_device([seq.sampling.presence_penalty for seq in chosen], logits.device, logits.dtype)[:, None]
    logits.index_copy_(0, index, logits.index_select(0, index) - (frequency * counts + presence * (counts > 0).to(logits.dtype)))


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's ``logit_bias``: each listed token's bias added to its logit, in place; no host sync. A token id
    past the model's vocabulary raises ``ValueError`` (the tokenizer refuses it first; the engine isolates it)."""
    cells = [(i, token, bias) for i, seq in enumerate(seqs) for token, bias in seq.sampling.logit_bias.items()]
    if not cells:
        return
    if max(token for _, token, _ in cells) >= logits.shape[-1]:
        raise ValueError(f"a logit_bias token id is past the vocabulary ({logits.shape[-1]} tokens)")
    rows = on_device([i for i, _, _ in cells], logits.device, torch.long)
    columns = on_device([token for _, token, _ in cells], logits.device, torch.long)
    logits.index_put_((rows, columns), on_device([b for _, _, b in cells], logits.device, logits.dtype), accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's ``allowed_token_ids``: every other token's logit -inf, in place; no host sync."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.allowed_token_ids]
    if not rows:
        return
    vocab = logits.shape[-1]
    cells = [(j, token) for j, i in enumerate(rows) for token in seqs[i].sampling.allowed_token_ids]
    if max(token for _, token in cells) >= vocab:
        raise ValueError(f"an allowed_token_ids token id is past the vocabulary ({vocab} tokens)")
    banned = torch.ones(len(rows), vocab, dtype=torch.bool, device=logits.device)
    banned.index_put_((on_device([j for j, _ in cells], logits.device, torch.long),
                       on_device([token for _, token in cells], logits.device, torch.long)),
                      torch.tensor(False, device=logits.device))
    index = on_device(rows, logits.device, torch.long)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(banned, float("-inf")))


def banned_ids(seq: Sequence) -> list[int]:
    """vLLM's ``bad_words``: the last token of each bad word whose other tokens end the answer so far (a one-token
    word always). Needs the answer's tokens on the host: ``ahead.runs_ahead`` keeps multi-token words off steps
    launched ahead."""
    generated, end = len(seq) - seq.num_prompt_tokens, len(seq)
    return [word[-1] for word in seq.sampling.bad_words_ids
            if len(word) - 1 <= generated and seq.token_ids[end - len(word) + 1:end] == word[:-1]]


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Each sequence's ``banned_ids`` -inf, in place; no host sync."""
    cells = [(i, token) for i, seq in enumerate(seqs) if seq.sampling.bad_words_ids for token in banned_ids(seq)]
    if not cells:
        return
    if max(token for _, token in cells) >= logits.shape[-1]:
        raise ValueError(f"a bad_words token id is past the vocabulary ({logits.shape[-1]} tokens)")
    rows = on_device([i for i, _ in cells], logits.device, torch.long)
    columns = on_device([token for _, token in cells], logits.device, torch.long)
    logits.index_put_((rows, columns), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def hold_ending_ids(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's min_tokens: a sequence with fewer generated tokens (a placeholder launched ahead counts: it is one)
    samples none of its ``held_ids`` (EOS, stop ids); in place, no host sync."""
    cells = [(i, token) for i, seq in enumerate(seqs) if seq.held_ids and len(seq) - seq.num_prompt_tokens
             < seq.sampling.min_tokens for token in seq.held_ids if token < logits.shape[-1]]
    if cells:
        rows = on_device([i for i, _ in cells], logits.device, torch.long)
        columns = on_device([token for _, token in cells], logits.device, torch.long)
        logits.index_put_((rows, columns), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def token_counts(logits: torch.Tensor, seqs: list[Sequence], starts: list[int], last: torch.Tensor | None,
                 rows: torch.Tensor) -> torch.Tensor:
    """[len(seqs), vocab] in ``logits``' dtype: how often each token occurs in each sequence's tokens from
    ``starts`` on; the last one taken from ``last[rows]`` when ``last`` is given (it is a placeholder there)."""
    vocab = logits.shape[-1]
    ahead = last is not None
    known = [seq.token_ids[start:len(seq) - ahead] for seq, start in zip(seqs, starts)]
    width = max(len(k) for k in known)
    table = on_device([k + [vocab] * (width - len(k)) for k in known], logits.device, torch.long)  # pads: column vocab
    if ahead:
        table = torch.cat([table, last.index_select(0, rows)[:, None]], dim=1)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, table, torch.ones(table.shape, dtype=logits.dtype, device=logits.device))
    return counts[:, :vocab]


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
    temps = on_device([s.sampling.temperature for s in seqs], logits.device, torch.float32)
    logits = logits / temps[:, None]
    if any(s.sampling.min_p > 0.0 for s in seqs):
        logits = min_p(logits, [s.sampling.min_p for s in seqs])
    if any(s.sampling.top_k > 0 for s in seqs):
        logits = top_k(logits, [s.sampling.top_k for s in seqs])
    if any(s.sampling.top_p < 1.0 for s in seqs):
        logits = top_p(logits, [s.sampling.top_p for s in seqs])
    for i, seq in enumerate(seqs):
        if seq.sampling.typical_p < 1.0:
            logits[i] = typical_p(logits[i], seq.sampling.typical_p)
    return logits


def top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (ties at the k-th value kept; k <= 0: all). The k-th value comes from
    ``topk`` of the largest k asked for when that is a small part of the vocabulary (a full sort of 49,152 logits
    per row costs ~30x more), else from a sort: the same value either way."""
    vocab = logits.shape[-1]
    k = [min(k, vocab) if k > 0 else vocab for k in ks]
    largest = max((k_i for k_i in k if k_i < vocab), default=1)  # rows keeping everything take no part
    ranked = logits.topk(largest).values if largest * 8 <= vocab else logits.sort(dim=-1, descending=True).values
    kth = ranked.gather(-1, on_device([min(k_i, largest) - 1 for k_i in k], logits.device, torch.long)[:, None])
    everything = on_device([k_i == vocab for k_i in k], logits.device, torch.bool)[:, None]
    kth = kth.masked_fill(everything, float("-inf"))  # a row without top-k loses nothing
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """vLLM's min-p: drop each token less likely than ``p`` times the row's most likely one (after temperature)."""
    probs = logits.softmax(dim=-1)
    floor = on_device(ps, logits.device, probs.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    p = on_device(ps, logits.device, torch.float32)[:, None]
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
    last = (cumulative < mass).sum().clamp(max=len(cumulative) - 1)  # a tensor: no host sync
    remove = sorted_shifted > sorted_shifted.index_select(0, last.reshape(1))  # (indexing by a tensor syncs)
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
