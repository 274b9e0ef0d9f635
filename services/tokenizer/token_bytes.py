"""Each token's own bytes, for logprobs (OpenAI's ``bytes``): a token that holds part of a character (an emoji
spread over three byte-level tokens) has bytes of its own even when the text it releases is empty, and the
tokens' bytes joined are the answer's UTF-8 (an answer cut inside a character ends in the bytes its tokens
have, where its text ends in U+FFFD, as decode writes an incomplete character).

* byte-level BPE (GPT-2's vocabulary alphabet, as SmolLM2, Llama 3, Qwen use): each character of the token's
  vocabulary string stands for one byte;
* SentencePiece with byte fallback (Llama 2, Mistral): ``<0xAB>`` tokens are one byte, ``▁`` a space;
* anything else: the token's decoded text in UTF-8.
"""

from __future__ import annotations

import functools

from shared.messages import TokenLogprob, TokenOut, TopToken

SPIECE_SPACE = "\u2581"


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters its vocabulary uses back to the bytes they stand for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """``of(id)``: the token's bytes, by the tokenizer's kind (read once from its decoder)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.kind = _kind(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def out(self, token_id: int, text: str, logprob: TokenLogprob | None = None, own: str | None = None) -> TokenOut:
        """The token as the gateway gets it: ``text`` what it released, with its logprob, alternatives and bytes
        when logprobs were asked."""
        special = token_id in self.special
        if special and own is None and not text:  # the answer leaves it out; its own text is its vocabulary's
            own = self.tok.decode([token_id])
        if logprob is None:
            return TokenOut(token_id, text, special, own=own)
        top = [TopToken(i, self.tok.decode([i]), lp, self.of(i)) for i, lp in zip(logprob.top_ids, logprob.top_logprobs)]
        return TokenOut(token_id, text, special, logprob.logprob, top, self.of(token_id), own, logprob.rank)

    @functools.lru_cache(maxsize=65536)
    def of(self, token_id: int) -> bytes:
        if token_id in self.special:
            return self.tok.decode([token_id]).encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if self.kind == "byte_level":
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif self.kind == "byte_fallback":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace(SPIECE_SPACE, " ").encode("utf-8")
        return self.tok.decode([token_id]).encode("utf-8")


def _kind(tokenizer) -> str:
    """byte_level | byte_fallback | text, from a fast tokenizer's decoder (its JSON names the kinds)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    described = repr(decoder) if decoder is not None else ""
    if "ByteLevel" in described:
        return "byte_level"
    if "ByteFallback" in described:
        return "byte_fallback"
    return "text"
