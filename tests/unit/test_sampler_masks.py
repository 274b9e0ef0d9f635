"""vLLM's token masks in the sampler: ``allowed_token_ids`` and ``bad_words`` (as token ids)."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampler import banned_ids, sample
from tests.unit.test_sampler import VOCAB, random_logits, seq


def test_allowed_token_ids_keep_greedy_and_drawn_tokens_inside_the_set():
    logits = random_logits(2, seed=14)
    allowed = [int(i) for i in logits[0].argsort()[:3]]  # the three least likely
    best = int(logits[1].argmax())
    greedy = sample(logits.clone(), [seq(allowed_token_ids=allowed), seq()])
    assert greedy == [max(allowed, key=lambda i: float(logits[0, i])), best]  # the other row is untouched
    drawn = {sample(logits[:1].clone(), [seq(do_sample=True, seed=s, allowed_token_ids=allowed)])[0] for s in range(1, 30)}
    assert drawn <= set(allowed) and len(drawn) > 1
    with pytest.raises(ValueError, match="vocabulary"):
        sample(logits[:1].clone(), [seq(allowed_token_ids=[VOCAB])])


def test_a_row_the_other_masks_leave_empty_keeps_to_the_allow_list():
    """Before: greedy on the raw logits, outside allowed_token_ids (and the bad word with it)."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 3] = 5.0, 1.0
    for extra in ({}, {"do_sample": True, "seed": 3}):
        assert sample(logits.clone(), [seq(allowed_token_ids=[3], bad_words_ids=[[3]], **extra)]) == [3]


def test_bad_words_ban_one_token_words_always_and_longer_ones_after_their_prefix():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8], logits[0, 9] = 3.0, 2.0, 1.0
    assert sample(logits.clone(), [seq(bad_words_ids=[[7]])]) == [8]
    s = seq([1, 2, 7], bad_words_ids=[[5, 7], [8]])  # 7 follows the prompt's 2 ... (prompt tokens do not count)
    assert sample(logits.clone(), [s]) == [7]
    s.append(5)  # ... but now the answer ends in 5: [5, 7] bans 7, [8] bans 8
    assert sample(logits.clone(), [s]) == [9]
    assert banned_ids(s) == [7, 8]
    s.append(9)
    assert banned_ids(s) == [8]
    with pytest.raises(ValueError, match="vocabulary"):
        sample(logits.clone(), [seq(bad_words_ids=[[VOCAB]])])
