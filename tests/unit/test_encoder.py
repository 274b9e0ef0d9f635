"""services/tokenizer/encoder.py: prompt encoding and MindIE's length rules (maxInputTokenLen, maxSeqLen,
ModelDeployConfig.truncation, a request's truncate), with SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest

from services.tokenizer.encoder import apply_length_limit, check_token_ids, encode_prompt
from shared.config import ModelConfig, ModelDeployConfig
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import GenerateRequest


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def deploy(truncation: int | bool = 0, max_input: int = 8, max_seq_len: int = 100) -> ModelDeployConfig:
    return ModelDeployConfig(
        max_seq_len=max_seq_len, max_input_token_len=max_input, truncation=truncation,
        model_config=[ModelConfig(model_name="m", model_weight_path="/m")],
    )


def request(prompt: str = "", prompt_ids: list[int] | None = None, truncate: int = 0) -> GenerateRequest:
    return GenerateRequest(id="r", model="m", reply_to="inbox", prompt=prompt, prompt_ids=prompt_ids,
                           truncate=truncate)


def test_encode_prompt_uses_the_tokenizer(tokenizer):
    ids = encode_prompt(tokenizer, request("Hello there"), deploy(max_input=100))
    assert ids == tokenizer("Hello there").input_ids


def test_encode_prompt_takes_prompt_ids_as_given(tokenizer):
    assert encode_prompt(tokenizer, request(prompt_ids=[5, 6, 7]), deploy()) == [5, 6, 7]


def test_empty_prompt_is_a_validation_error(tokenizer):
    with pytest.raises(SwitchboardError) as info:
        encode_prompt(tokenizer, request(""), deploy())
    assert info.value.kind is ErrorKind.VALIDATION


def test_over_long_prompt_is_refused_when_truncation_is_0(tokenizer):
    prompt = "one two three four five six seven eight nine ten"
    assert len(tokenizer(prompt).input_ids) > 8
    with pytest.raises(SwitchboardError) as info:
        encode_prompt(tokenizer, request(prompt), deploy(truncation=0, max_input=8))
    assert info.value.kind is ErrorKind.VALIDATION
    assert info.value.info.status == 422
    assert "limit of 8" in info.value.message


@pytest.mark.parametrize("truncation", [0, False])
def test_apply_length_limit_refuses(truncation):
    with pytest.raises(SwitchboardError) as info:
        apply_length_limit(list(range(9)), deploy(truncation=truncation, max_input=8))
    assert info.value.kind is ErrorKind.VALIDATION


def test_prompt_at_the_limit_passes_untouched():
    ids = list(range(8))
    assert apply_length_limit(ids, deploy(truncation=0, max_input=8)) == ids


def test_limit_is_min_of_max_input_and_max_seq_len_minus_one():
    with pytest.raises(SwitchboardError):
        apply_length_limit(list(range(6)), deploy(truncation=0, max_input=8, max_seq_len=6))
    assert apply_length_limit(list(range(5)), deploy(truncation=0, max_input=8, max_seq_len=6)) == list(range(5))
    assert apply_length_limit(list(range(20)), deploy(truncation=-1, max_input=8, max_seq_len=6)) == list(range(5))


def test_truncation_minus_one_keeps_the_first_tokens():
    assert apply_length_limit(list(range(20)), deploy(truncation=-1, max_input=8)) == list(range(8))


def test_truncation_true_keeps_the_first_tokens_like_minus_one():
    # True == 1 in Python: true must not be taken for 1 (keep the last)
    assert apply_length_limit(list(range(20)), deploy(truncation=True, max_input=8)) == list(range(8))


def test_truncation_true_truncates_to_the_limit():
    assert len(apply_length_limit(list(range(20)), deploy(truncation=True, max_input=8))) == 8


def test_truncation_one_keeps_the_last_tokens():
    assert apply_length_limit(list(range(20)), deploy(truncation=1, max_input=8)) == list(range(12, 20))


def test_encode_prompt_truncates_with_truncation_one(tokenizer):
    prompt = "one two three four five six seven eight nine ten"
    full = tokenizer(prompt).input_ids
    assert encode_prompt(tokenizer, request(prompt), deploy(truncation=1, max_input=4)) == full[-4:]
    assert encode_prompt(tokenizer, request(prompt), deploy(truncation=-1, max_input=4)) == full[:4]


def test_request_truncate_keeps_the_last_n_tokens(tokenizer):
    prompt = "one two three four five six seven eight nine ten"
    full = tokenizer(prompt).input_ids
    assert encode_prompt(tokenizer, request(prompt, truncate=3), deploy(max_input=100)) == full[-3:]
    # a truncate that fits the prompt already changes nothing
    assert encode_prompt(tokenizer, request(prompt, truncate=100), deploy(max_input=100)) == full


def test_request_truncate_applies_before_the_length_limit():
    ids = list(range(20))
    # truncate brings it under the limit, so truncation=0 does not refuse it
    assert encode_prompt(None, request(prompt_ids=ids, truncate=5), deploy(truncation=0, max_input=8)) == ids[-5:]


def test_a_request_truncate_over_the_limit_is_refused_not_cut_again():
    """truncate keeps the last n tokens; above the limit, a deployment that truncates kept a middle slice of the
    prompt without its end (ids[-100:][:48]): refused, naming the prompt's real length, truncate and the limit."""
    ids = list(range(239))
    for truncation in (-1, 1, 0):
        with pytest.raises(SwitchboardError, match="has 239 tokens and the request's truncate keeps its last 100"):
            encode_prompt(None, request(prompt_ids=ids, truncate=100), deploy(truncation=truncation, max_input=48))
    assert encode_prompt(None, request(prompt_ids=ids, truncate=48), deploy(truncation=-1, max_input=48)) == ids[-48:]


def test_check_token_ids():
    check_token_ids([0, 5, 99], vocab_size=100)
    for bad in ([100], [-1], [3, 1000]):
        with pytest.raises(SwitchboardError) as info:
            check_token_ids(bad, vocab_size=100)
        assert info.value.kind is ErrorKind.VALIDATION
