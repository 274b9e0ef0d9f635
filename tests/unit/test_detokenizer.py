"""services/tokenizer/detokenizer.py with SmolLM2's real tokenizer (the encoder's length rules: test_encoder.py)."""

from __future__ import annotations

import random

import pytest

from services.tokenizer.detokenizer import REPLACEMENT, IncrementalDecoder, StopMatcher, _feed, next_text, token_texts

TEXTS = [
    "Hello, world! This is a test.",
    "Héllo 世界 🎉 ok",
    "Ünïcödé: naïve café — “quotes” … 漢字かな交じり文 👍🏽 👨‍👩‍👧 done",
    "  two leading spaces\n\n\tand a tab, then   three spaces",
    "def f(x):\n    return x ** 2  # comment\n",
    "12345 + 67890 = 80235; π ≈ 3.14159",
]


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def decode_stream(tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, prompt_ids or [])
    return [decoder.add(token_id) for token_id in ids]


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- IncrementalDecoder -----------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_joined_deltas_equal_whole_decode(tokenizer, text):
    ids = tokenizer(text).input_ids
    deltas = decode_stream(tokenizer, ids)
    assert "".join(deltas) == full_decode(tokenizer, ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_joined_deltas_equal_whole_decode_after_a_prompt(tokenizer, text):
    prompt_ids = tokenizer("The answer is:").input_ids
    ids = tokenizer(" " + text).input_ids
    deltas = decode_stream(tokenizer, ids, prompt_ids)
    assert "".join(deltas) == full_decode(tokenizer, ids)
    # the prompt itself is never re-emitted
    assert "The answer is" not in "".join(deltas)


def test_multibyte_text_never_yields_a_replacement_character(tokenizer):
    text = "Héllo 世界 🎉 ok"
    ids = tokenizer(text).input_ids
    # the test is only meaningful when some character spans several tokens
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    deltas = decode_stream(tokenizer, ids)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) == text
    # incomplete bytes are held back as empty deltas, then released whole
    assert "" in deltas
    assert "世" in deltas and "界" in deltas


@pytest.mark.parametrize("text", TEXTS)
def test_no_delta_holds_a_replacement_character(tokenizer, text):
    deltas = decode_stream(tokenizer, tokenizer(text).input_ids)
    assert all(REPLACEMENT not in delta for delta in deltas)


def test_random_unicode_strings_roundtrip(tokenizer):
    pool = list("abcxyz ,.!?\n") + list("éüßçñ") + list("世界漢字かな") + ["🎉", "👍🏽", "🚀", "∑", "€"]
    rng = random.Random(7)
    for _ in range(30):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 25)))
        ids = tokenizer(text).input_ids
        deltas = decode_stream(tokenizer, ids, tokenizer("Q:").input_ids)
        assert all(REPLACEMENT not in delta for delta in deltas), text
        assert "".join(deltas) == text


def test_special_tokens_are_skipped_like_decode(tokenizer):
    messages = [{"role": "user", "content": "Héllo 世界"}, {"role": "assistant", "content": "Bonjour 🎉!"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    deltas = decode_stream(tokenizer, ids)
    joined = "".join(deltas)
    assert joined == full_decode(tokenizer, ids)
    assert "<|im_start|>" not in joined and "<|im_end|>" not in joined
    assert "Bonjour 🎉!" in joined


def test_one_delta_per_token(tokenizer):
    ids = tokenizer("simple words only").input_ids
    deltas = decode_stream(tokenizer, ids)
    assert len(deltas) == len(ids)
    assert deltas == [tokenizer.decode([i]) for i in ids]


# ---- StopMatcher ------------------------------------------------------------------------------


def feed_all(matcher: StopMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    out = []
    for i, delta in enumerate(deltas):
        piece, hit = matcher.feed(delta, final=i == len(deltas) - 1)
        out.append(piece)
        if hit:
            return out, True
    return out, False


def test_stop_string_and_everything_after_it_are_cut():
    matcher = StopMatcher(["STOP"])
    pieces, hit = feed_all(matcher, ["Hello ", "world STOP and", " more text"])
    assert hit
    assert "".join(pieces) == "Hello world "


def test_stop_string_kept_when_included():
    matcher = StopMatcher(["STOP"], include=True)
    pieces, hit = feed_all(matcher, ["Hello ", "world ST", "OP and", " more text"])
    assert hit
    assert "".join(pieces) == "Hello world STOP"


def test_stop_string_inside_one_delta():
    matcher = StopMatcher(["\n\n"])
    piece, hit = matcher.feed("first line\n\nsecond", final=False)
    assert hit
    assert piece == "first line"


def test_stop_string_split_over_many_deltas():
    matcher = StopMatcher(["<end>"])
    pieces, hit = feed_all(matcher, ["abc", "<", "e", "n", "d", ">", "tail"])
    assert hit
    assert "".join(pieces) == "abc"
    assert "<" not in "".join(pieces)


def test_partial_stop_prefix_is_held_back_until_disambiguated():
    matcher = StopMatcher(["STOP"])
    first, hit = matcher.feed("Go ST", final=False)
    assert not hit
    assert "ST" not in first  # might still become STOP
    assert "Go".startswith(first) or first.startswith("Go")
    second, hit = matcher.feed("ART the engine now", final=False)
    assert not hit  # "START" is not "STOP": the held "ST" is released with what follows
    released = first + second
    assert released.startswith("Go START")
    rest, hit = matcher.feed("", final=True)
    assert not hit
    assert first + second + rest == "Go START the engine now"


def test_partial_prefix_that_completes_is_never_released():
    matcher = StopMatcher(["STOP"])
    released = ""
    for delta in ["Go S", "T", "O", "P!"]:
        piece, hit = matcher.feed(delta, final=False)
        released += piece
        assert "S" not in released
        if hit:
            break
    assert hit
    assert released == "Go "


def test_everything_is_released_when_final():
    matcher = StopMatcher(["STOP"])
    first, _ = matcher.feed("ends with ST", final=False)
    assert not first.endswith("ST")
    rest, hit = matcher.feed("", final=True)
    assert not hit
    assert first + rest == "ends with ST"


def test_final_delta_with_a_stop_is_still_cut():
    matcher = StopMatcher(["STOP"])
    piece, hit = matcher.feed("abc STOP def", final=True)
    assert hit
    assert piece == "abc "


def test_earliest_of_several_stops_wins():
    matcher = StopMatcher(["world", "lo"])
    pieces, hit = feed_all(matcher, ["Hel", "lo world"])
    assert hit
    assert "".join(pieces) == "Hel"


def test_only_a_tail_that_may_begin_a_stop_is_held_back():
    matcher = StopMatcher(["x", "abcdef"])
    assert matcher.feed("0123456789", final=False) == ("0123456789", False)  # nothing here can begin a stop
    assert matcher.feed("zzabc", final=False) == ("zz", False)  # "abc" may begin "abcdef"
    assert matcher.feed("dX", final=False) == ("abcdX", False)  # it did not
    assert matcher.feed("abcde", final=False) == ("", False)  # the longest stop less one, at most
    assert matcher.feed("f!", final=False) == ("", True) and matcher.matched == "abcdef"
    repeat = StopMatcher(["aab"])
    assert repeat.feed("aaaa", final=False) == ("aa", False)  # "aa" may still begin "aab"


def test_no_stops_release_everything_at_once():
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        piece, hit = matcher.feed("anything at all", final=False)
        assert (piece, hit) == ("anything at all", False)


def test_released_text_is_always_a_prefix_of_the_stream():
    text = "alpha beta END gamma"
    matcher = StopMatcher(["END", "gamma delta"])
    released = ""
    for i, ch in enumerate(text):
        piece, hit = matcher.feed(ch, final=i == len(text) - 1)
        released += piece
        assert text.startswith(released)
        if hit:
            break
    assert hit
    assert released == "alpha beta "


def test_stop_matcher_with_real_token_stream(tokenizer):
    text = "Sure! Here is 世界 🎉.\nUser: ignore this"
    decoder = IncrementalDecoder(tokenizer, [])
    matcher = StopMatcher(["\nUser:"])
    released = ""
    hit = False
    ids = tokenizer(text).input_ids
    for i, token_id in enumerate(ids):
        piece, hit = matcher.feed(decoder.add(token_id), final=i == len(ids) - 1)
        assert REPLACEMENT not in piece
        released += piece
        if hit:
            break
    assert hit
    assert released == "Sure! Here is 世界 🎉."


def test_flush_releases_an_incomplete_character_at_the_end(tokenizer):
    ids = tokenizer("ok 🎉", add_special_tokens=False).input_ids
    decoder = IncrementalDecoder(tokenizer, [])
    text = "".join(decoder.add(i) for i in ids[:-1])  # stop one token short of the emoji's last byte
    text += decoder.flush()
    assert text == tokenizer.decode(ids[:-1]) and text.endswith("\ufffd")
    assert decoder.flush() == ""


def test_a_stop_matcher_not_armed_yet_releases_everything_and_matches_nothing():
    """Before min_tokens (vLLM's), a stop string in the text does not end it; once armed, stop strings in the text
    still to come do."""
    stops = StopMatcher(["stop"])
    assert stops.feed("no stop here ", final=False, armed=False) == ("no stop here ", False)
    assert stops.feed("then stop", final=False) == ("then ", True) and stops.matched == "stop"


@pytest.mark.parametrize("text", ["Emoji: 😀😃😄", "中文：你好，世界。我", TEXTS[2]])
def test_token_texts_join_into_the_decoded_ids_and_their_lengths_are_offsets(tokenizer, text):
    """Prompt tokens as echo and its logprobs show them: a character split over tokens is in the token that
    completes it, so the texts join into the text (each decoded alone they were several U+FFFD)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any(tokenizer.decode([i]) == REPLACEMENT for i in ids)  # the text does split characters
    texts = token_texts(tokenizer, ids)
    assert len(texts) == len(ids) and "".join(texts) == text
    assert REPLACEMENT not in "".join(texts)
    inside = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    cut = token_texts(tokenizer, ids[:inside])  # ends inside a character: the last token shows decode's U+FFFD
    assert "".join(cut) == tokenizer.decode(ids[:inside]) and cut[-1].endswith(REPLACEMENT)


def test_a_stop_string_is_not_found_in_the_placeholder_of_a_character_cut_at_the_end(tokenizer):
    """max_tokens ending inside an emoji leaves decode's U+FFFD at the end: it is not the model's text, so a
    stop string "\ufffd" does not end the answer there (finish stays length); real text flushed with it still
    meets the stop strings."""
    ids = tokenizer("ok 🎉", add_special_tokens=False).input_ids
    decoder, stops = IncrementalDecoder(tokenizer, []), StopMatcher(["\ufffd"])
    pieces = [next_text(decoder, stops, i, final=False, ended_on_eos=False) for i in ids[:-2]]
    pieces.append(next_text(decoder, stops, ids[-2], final=True, ended_on_eos=False))
    assert "".join(p[0] for p in pieces) == "ok \ufffd" and not any(p[2] for p in pieces)
    assert _feed(StopMatcher(["ab"]), "x", "ab\ufffd", final=True, armed=True) == ("x", True)
    assert _feed(StopMatcher(["\ufffd"]), "x", "ab\ufffd", final=True, armed=True) == ("xab\ufffd", False)
