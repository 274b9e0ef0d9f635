"""services/engine/sampler.py against transformers' own logits processors."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from services.engine.sampler import (
    SAMPLING_EPS, apply_output_penalties, apply_repetition_penalty, min_p, position_seed, raw_logprobs, sample,
    token_logprob, top_k, top_p, typical_p, warp,
)
from services.engine.sequence import Sequence
from shared.messages import Sampling

VOCAB = 200


def seq(token_ids: list[int] | None = None, **sampling) -> Sequence:
    return Sequence("s", token_ids if token_ids is not None else [1, 2, 3], Sampling(**sampling))


def random_logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


# ---- top-k ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 50, VOCAB - 1, VOCAB])
def test_top_k_keeps_exactly_k_candidates(k):
    logits = random_logits(4, seed=k)
    out = top_k(logits, [k] * 4)
    for row_in, row_out in zip(logits, out):
        expected = set(row_in.topk(k).indices.tolist())
        assert kept(row_out) == expected
        assert len(kept(row_out)) == k
        # kept logits are unchanged
        assert torch.equal(row_out[list(expected)], row_in[list(expected)])


def test_top_k_per_row_values_and_disabled_rows():
    logits = random_logits(4, seed=1)
    out = top_k(logits, [3, 0, 10, 10_000])
    assert [len(kept(r)) for r in out] == [3, VOCAB, 10, VOCAB]


@pytest.mark.parametrize("k", [1, 7, 40])
def test_top_k_matches_transformers(k):
    logits = random_logits(3, seed=11 + k)
    expected = TopKLogitsWarper(k)(None, logits.clone())
    assert torch.equal(top_k(logits, [k] * 3), expected)


# ---- top-p ------------------------------------------------------------------------------------


def smallest_set_with_mass(row: torch.Tensor, p: float) -> set[int]:
    probs = row.softmax(-1)
    order = probs.argsort(descending=True)
    chosen, mass = [], 0.0
    for index in order.tolist():
        chosen.append(index)
        mass += float(probs[index])
        if mass >= p:
            break
    return set(chosen)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_with_mass_at_least_p(p):
    logits = random_logits(5, seed=int(p * 100))
    out = top_p(logits, [p] * 5)
    for row_in, row_out in zip(logits, out):
        keep = kept(row_out)
        probs = row_in.softmax(-1)
        mass = float(probs[list(keep)].sum())
        assert mass >= p - 1e-6
        # dropping the least likely kept token falls below p: the set is the smallest
        least = min(keep, key=lambda i: float(probs[i]))
        assert mass - float(probs[least]) < p + 1e-6
        # and every dropped token is less likely than every kept one
        dropped = set(range(VOCAB)) - keep
        if dropped:
            assert max(float(probs[i]) for i in dropped) <= min(float(probs[i]) for i in keep)
        assert keep == smallest_set_with_mass(row_in, p)


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    out = top_p(logits, [1e-6])
    assert kept(out[0]) == {0}


def test_top_p_one_keeps_everything():
    logits = random_logits(2, seed=3)
    assert torch.equal(top_p(logits, [1.0, 1.0]), logits)


@pytest.mark.parametrize("p", [0.2, 0.7, 0.95])
def test_top_p_matches_transformers(p):
    logits = random_logits(3, seed=5)
    expected = TopPLogitsWarper(p)(None, logits.clone())
    assert torch.equal(top_p(logits, [p] * 3), expected)


def test_top_p_per_row_values():
    logits = random_logits(2, seed=9)
    out = top_p(logits, [0.5, 0.9])
    assert kept(out[0]) == smallest_set_with_mass(logits[0], 0.5)
    assert kept(out[1]) == smallest_set_with_mass(logits[1], 0.9)


# ---- typical-p and temperature ----------------------------------------------------------------


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9])
def test_typical_p_matches_transformers(mass):
    logits = random_logits(1, seed=21)
    expected = TypicalLogitsWarper(mass)(None, logits.clone())
    assert torch.equal(typical_p(logits[0].clone(), mass), expected[0])


def test_warp_applies_temperature_then_top_k_then_top_p_like_transformers():
    logits = random_logits(2, seed=4)
    s = seq(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    ours = warp(logits.clone(), [s, s])
    hf = logits.clone()
    for proc in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        hf = proc(None, hf)
    assert torch.allclose(ours, hf)
    assert kept(ours[0]) == kept(hf[0])


# ---- repetition penalty -----------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.1, 1.5, 2.0, 0.8])
def test_repetition_penalty_matches_transformers(penalty):
    logits = random_logits(3, seed=int(penalty * 10))
    histories = [[5, 6, 7, 5, 5], [0, 199, 100], [42]]
    seqs = [seq(h, repetition_penalty=penalty) for h in histories]
    ours = logits.clone()
    apply_repetition_penalty(ours, seqs)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i, history in enumerate(histories):
        expected = processor(torch.tensor([history]), logits[i : i + 1].clone())
        assert torch.allclose(ours[i], expected[0]), i


def test_repetition_penalty_lowers_only_repeated_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    apply_repetition_penalty(logits, [seq([0, 1, 1], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_repetition_penalty_one_changes_nothing_and_rows_are_independent():
    logits = random_logits(2, seed=8)
    out = logits.clone()
    apply_repetition_penalty(out, [seq([3, 4], repetition_penalty=1.0), seq([3, 4], repetition_penalty=1.3)])
    assert torch.equal(out[0], logits[0])
    assert not torch.equal(out[1], logits[1])
    untouched = [i for i in range(VOCAB) if i not in (3, 4)]
    assert torch.equal(out[1, untouched], logits[1, untouched])


# ---- sample -----------------------------------------------------------------------------------


def draw_run(logits: torch.Tensor, s: Sequence, n: int) -> list[int]:
    """``n`` draws for one sequence, each appended before the next (the position advances)."""
    out = []
    for _ in range(n):
        out.append(sample(logits.clone(), [s])[0])
        s.append(out[-1])
    return out


def test_greedy_rows_are_argmax_whatever_their_seed():
    logits = random_logits(3, seed=12)
    seqs = [seq(do_sample=False, seed=1), seq(do_sample=False, seed=999), seq()]
    assert sample(logits.clone(), seqs) == logits.argmax(-1).tolist()


def test_all_greedy_batch_falls_back_per_row_for_nan_and_all_inf():
    logits = random_logits(3, seed=5)
    logits[1, 7] = float("nan")  # NaN ignored: the argmax of the rest
    logits[2] = float("-inf")
    expected = [int(logits[0].argmax()), int(logits[1].nan_to_num(nan=float("-inf")).argmax()), 0]
    assert sample(logits.clone(), [seq(do_sample=False) for _ in range(3)]) == expected
    penalised = [seq(do_sample=False), seq(do_sample=False, repetition_penalty=1.2), seq(do_sample=False)]
    assert sample(logits.clone(), penalised) == expected  # the general path agrees


def test_warpers_without_do_sample_mean_sampling():
    assert seq(temperature=0.5).sampling.sampling
    assert not seq().sampling.sampling
    assert not seq(temperature=0.5, do_sample=False).sampling.sampling


def test_greedy_with_repetition_penalty_is_argmax_of_penalised_logits():
    logits = torch.tensor([[5.0, 4.9, 0.0, -3.0]])
    assert sample(logits.clone(), [seq([0], repetition_penalty=1.2)]) == [1]


def test_seeded_draw_is_reproducible_and_independent_of_the_batch():
    logits = random_logits(1, seed=13, scale=1.0)
    params = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1234)

    def draws(batch_neighbours: int) -> list[int]:
        target = seq(**params)
        others = [seq(do_sample=True, temperature=1.3, seed=s) for s in range(batch_neighbours)]
        others += [seq(do_sample=False) for _ in range(batch_neighbours)]
        out = []
        for _ in range(20):
            batch = others[: len(others) // 2] + [target] + others[len(others) // 2 :]
            rows = logits.expand(len(batch), -1).clone()
            out.append(sample(rows, batch)[len(others) // 2])
            target.append(out[-1])
        return out

    alone = draws(0)
    assert alone == draws(3) == draws(8)
    assert len(set(alone)) > 1  # it really samples


def test_seeded_draw_is_multinomial_with_a_generator_seeded_from_seed_and_position():
    logits = random_logits(1, seed=14, scale=1.0)
    s = seq(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    probs = warp(logits.clone(), [s]).softmax(-1)[0]
    expected = []
    for position in range(3, 13):
        g = torch.Generator().manual_seed(position_seed(1234, position))
        expected.append(int(torch.multinomial(probs, 1, generator=g)))
    assert draw_run(logits, s, 10) == expected


def test_drawing_again_at_the_same_position_gives_the_same_token():
    """No generator advances: re-running a step (isolation, a resumed request) draws the same token."""
    logits = random_logits(1, seed=17, scale=0.3)
    s = seq(list(range(40)), do_sample=True, seed=99)
    first = [sample(logits.clone(), [s])[0] for _ in range(5)]
    assert len(set(first)) == 1
    resumed = seq(list(range(40)), do_sample=True, seed=99)
    assert sample(logits.clone(), [resumed]) == first[:1]


def test_position_seed_is_deterministic_and_spread():
    assert position_seed(5, 10) == position_seed(5, 10)
    seeds = {position_seed(seed, position) for seed in range(20) for position in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= x < 2**63 for x in seeds)
    assert 0 <= position_seed(2**64 - 1, 2**31) < 2**63


def test_sampled_tokens_stay_inside_top_k():
    logits = random_logits(1, seed=15, scale=1.0)
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(draw_run(logits, seq(do_sample=True, top_k=3, seed=7), 50)) <= allowed


def test_different_seeds_differ():
    logits = random_logits(1, seed=16, scale=0.5)
    a, b = seq(do_sample=True, seed=1), seq(do_sample=True, seed=2)
    assert draw_run(logits, a, 10) != draw_run(logits, b, 10)


# ---- numerically safe at every value a family accepts -----------------------------------------

FLT_MAX = 3.4028234663852886e38


@pytest.mark.parametrize("temperature", [1e-300, 1e-6, 0.0, SAMPLING_EPS / 2])
def test_a_temperature_below_eps_is_greedy(temperature):
    logits = random_logits(2, seed=18)
    seqs = [seq(do_sample=True, temperature=temperature, seed=3), seq(temperature=temperature, top_k=5, seed=4)]
    assert sample(logits.clone(), seqs) == logits.argmax(-1).tolist()


EXTREMES = [
    dict(repetition_penalty=FLT_MAX), dict(repetition_penalty=1e-300), dict(temperature=FLT_MAX),
    dict(top_p=1e-300), dict(typical_p=1e-300), dict(top_k=2**31 - 1), dict(temperature=SAMPLING_EPS),
    dict(presence_penalty=2.0, frequency_penalty=2.0), dict(presence_penalty=-2.0, frequency_penalty=-2.0),
    dict(repetition_penalty=FLT_MAX, temperature=FLT_MAX, top_p=1e-300, typical_p=1e-300, top_k=1),
]


@pytest.mark.parametrize("params", EXTREMES, ids=lambda p: ",".join(f"{k}={v:g}" for k, v in p.items()))
@pytest.mark.parametrize("do_sample", [True, False])
def test_extreme_accepted_values_give_a_valid_token(params, do_sample):
    logits = random_logits(1, seed=19)
    s = seq(list(range(0, VOCAB, 2)) + [3, 3, 5], do_sample=do_sample, seed=8, **params)
    for token in draw_run(logits, s, 5):
        assert 0 <= token < VOCAB


def test_a_row_without_a_distribution_falls_back_to_the_raw_argmax():
    logits = random_logits(4, seed=20)
    logits[0] = float("-inf")  # every logit -inf
    logits[1, 7] = float("nan")
    logits[2] = -logits[2].abs() - 1  # all negative: the penalty below sends every logit to -inf
    logits[3, 9] = float("inf")  # a tiny penalty (0 in float32) sends repeated positive logits to +inf
    raw = logits.nan_to_num(nan=float("-inf")).argmax(-1).tolist()
    seqs = [seq(do_sample=True, seed=1), seq(do_sample=True, seed=2),
            seq(list(range(VOCAB)), do_sample=True, repetition_penalty=FLT_MAX, seed=3),
            seq(do_sample=True, seed=4)]
    tokens = sample(logits.clone(), seqs)
    assert tokens[1:] == raw[1:] and raw[1] != 7 and raw[3] == 9
    assert 0 <= tokens[0] < VOCAB


@pytest.mark.parametrize("params", [dict(temperature=float("nan")), dict(top_p=float("nan")),
                                    dict(temperature=-1.0), dict(repetition_penalty=0.0)])
def test_values_no_family_accepts_raise(params):
    with pytest.raises(ValueError):
        sample(random_logits(1, seed=21), [seq(do_sample=True, **params)])


# ---- presence / frequency penalties and logprobs ----------------------------------------------


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    s = seq([7, 7, 9], presence_penalty=0.5, frequency_penalty=0.25)
    s.append(9)
    s.append(9)
    s.append(4)
    logits = torch.zeros(1, VOCAB)
    apply_output_penalties(logits, [s])
    assert logits[0, 9].item() == pytest.approx(-(0.5 + 2 * 0.25))
    assert logits[0, 4].item() == pytest.approx(-(0.5 + 0.25))
    assert logits[0, 7].item() == 0.0  # prompt-only tokens are not penalized
    assert logits[0, 0].item() == 0.0


def test_logprobs_are_the_raw_distribution_with_the_top_k():
    logits = random_logits(3, seed=11)
    seqs = [seq(logprobs=2), seq(), seq(logprobs=0)]
    rows = raw_logprobs(logits, seqs)
    assert set(rows) == {0, 2}
    expected = logits[0].log_softmax(-1)
    got = token_logprob(rows[0], 5, 2)
    assert got.logprob == pytest.approx(expected[5].item(), abs=1e-5)
    assert got.top_ids == expected.topk(2).indices.tolist()
    assert got.top_logprobs == pytest.approx(expected.topk(2).values.tolist(), abs=1e-5)
    assert token_logprob(rows[2], 5, 0).top_ids == []


# ---- min-p and logit bias ------------------------------------------------------------------------


def test_min_p_keeps_the_tokens_at_least_p_times_as_likely_as_the_best_per_row():
    logits = random_logits(3, seed=11)
    out = min_p(logits, [0.0, 0.1, 0.9])
    probs = logits.softmax(dim=-1)
    for row, p in enumerate([0.0, 0.1, 0.9]):
        assert kept(out[row]) == set((probs[row] >= p * probs[row].max()).nonzero().flatten().tolist())
    assert kept(out[0]) == set(range(VOCAB)) and 1 <= len(kept(out[2])) < len(kept(out[1])) < VOCAB


def test_min_p_one_draws_the_most_likely_token_whatever_the_seed():
    logits = random_logits(1, seed=12)
    best = int(logits[0].argmax())
    assert {sample(logits.clone(), [seq(do_sample=True, temperature=1.5, min_p=1.0, seed=s)])[0]
            for s in range(1, 20)} == {best}
    assert len({sample(logits.clone(), [seq(do_sample=True, temperature=1.5, seed=s)])[0] for s in range(1, 20)}) > 1


def test_logit_bias_moves_greedy_and_drawn_tokens():
    logits = random_logits(2, seed=13)
    worst = int(logits[0].argmin())
    greedy = sample(logits.clone(), [seq(logit_bias={worst: 100.0}), seq(logit_bias={int(logits[1].argmax()): -100.0})])
    assert greedy[0] == worst and greedy[1] != int(logits[1].argmax())
    drawn = {sample(logits[:1].clone(), [seq(do_sample=True, seed=s, logit_bias={worst: 100.0})])[0] for s in range(1, 10)}
    assert drawn == {worst}
    with pytest.raises(ValueError, match="vocabulary"):
        sample(logits[:1].clone(), [seq(logit_bias={VOCAB: 1.0})])


def test_logit_bias_is_added_before_the_repetition_penalty_as_vllm_orders_them():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 1], logits[0, 5] = 10.0, 8.0  # token 1 is in the context [1, 2, 3]
    # (10 + 4) / 2 = 7 < 8: token 5 (bias after the penalty would give 10 / 2 + 4 = 9: token 1)
    assert sample(logits, [seq(repetition_penalty=2.0, logit_bias={1: 4.0})]) == [5]

