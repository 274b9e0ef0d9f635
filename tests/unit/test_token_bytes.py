"""Each token's own bytes (OpenAI's logprobs ``bytes``), for the tokenizer kinds models ship: byte-level BPE (the
default model's), SentencePiece-style byte fallback, and a decoder that is neither (the token's text)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from services.tokenizer.token_bytes import TokenBytes

TEXT = "hi 🙂 日本"


def test_byte_level_tokens_are_their_vocabulary_bytes(smol_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    of = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert of.kind == "byte_level" and b"".join(of.of(i) for i in ids) == TEXT.encode()
    assert any(of.of(i) and not tokenizer.decode([i]).strip("\ufffd") for i in ids)  # part of a character
    assert of.of(tokenizer.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE: "▁" for spaces, characters outside the vocabulary as <0xAB> bytes."""
    vocab = {"<unk>": 0, "\u2581hi": 1, "\u2581": 2, "h": 3, "i": 4, "hi": 5, "\u2581h": 6,
             **{f"<0x{b:02X}>": 7 + b for b in range(256)}}
    merges = [("h", "i"), ("\u2581", "hi")]
    model = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    model.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")


def test_byte_fallback_tokens_are_their_bytes_and_spaces():
    tokenizer = byte_fallback_tokenizer()
    of = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert of.kind == "byte_fallback"
    assert b"".join(of.of(i) for i in ids) == (" " + TEXT).encode()  # (the leading space SentencePiece adds)
    assert of.of(vocab_id(tokenizer, "<0xF0>")) == b"\xf0"


def test_other_decoders_give_the_tokens_text():
    tokenizer = byte_fallback_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()
    of = TokenBytes(tokenizer)
    assert of.kind == "text" and of.of(vocab_id(tokenizer, "h")) == b"h"


def vocab_id(tokenizer, piece: str) -> int:
    return tokenizer.convert_tokens_to_ids(piece)


def test_a_special_token_the_answer_leaves_out_is_shown_by_its_own_text(smol_dir):
    from shared.messages import TokenLogprob

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = TokenBytes(tokenizer).out(eos, "", TokenLogprob(-0.5, [eos], [-0.5]))
    assert (out.text, out.own_text, out.top[0].text, out.raw) == ("", "<|im_end|>", "<|im_end|>", b"<|im_end|>")


def test_a_token_among_its_alternatives_is_labelled_as_it_is_and_the_likeliest_text_keeps_its_place(smol_dir):
    """Part of a character releases "" (chat logprobs' token) and decodes alone to U+FFFD: its own entry in
    ``top_logprobs`` says "" too, not U+FFFD; in the legacy dict, alternatives sharing one text (U+FFFD) keep the
    likeliest's logprob, not the last written."""
    from services.gateway.openai_api.chat_responses import logprob_entry
    from services.gateway.openai_api.completion_responses import Logprobs
    from shared.messages import TokenLogprob

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    ids = tokenizer("🙂", add_special_tokens=False).input_ids
    partial = [i for i in ids if tokenizer.decode([i]) == "\ufffd"]
    others = [i for i in range(300, 20000) if tokenizer.decode([i]) == "\ufffd" and i not in partial][:2]
    lp = TokenLogprob(-0.1, [ids[0], *others], [-0.1, -2.0, -3.0])
    token = TokenBytes(tokenizer).out(ids[0], "", lp)
    entry = logprob_entry(token)
    assert entry["token"] == "" and entry["top_logprobs"][0]["token"] == ""
    assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
    legacy = Logprobs(0).of([token])
    assert legacy["top_logprobs"][0] == {"": -0.1, "\ufffd": -2.0}
