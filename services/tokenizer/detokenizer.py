"""Incremental detokenization and stop strings.

Text is released token by token, never half a multi-byte character (a trailing U+FFFD means the
bytes are incomplete, so we wait), and with stop strings the last ``len(longest)-1`` characters are
held back so a stop string is cut out before any of it reaches the client.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens decoded along, so the first token's leading space is right


class IncrementalDecoder:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """The new complete text this token makes, possibly empty."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end: what is still held back (an incomplete character shows as U+FFFD, as decode does)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)


class StopMatcher:
    """Accumulates generated text and releases what is safe to send."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include  # keep the stop string itself in the output (vLLM include_stop_str_in_output)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.released = 0
        self.matched = ""  # the stop string that ended the text, once one has

    def feed(self, delta: str, final: bool, armed: bool = True) -> tuple[str, bool]:
        """(text to release now, whether a stop string was hit); not ``armed`` (before min_tokens, as vLLM), no
        stop string is looked for and the text goes out whole."""
        self.text += delta
        if not armed:
            return self._release(len(self.text)), False
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            return self._release(cut), True
        end = len(self.text) if final else len(self.text) - self._held()
        return self._release(end), False

    def _held(self) -> int:
        """How many trailing unreleased characters could still begin a stop string: only those wait (as vLLM
        holds back), so text that cannot start one streams as it comes."""
        tail = self.text[self.released:]
        start, held = max(0, len(tail) - self.hold), 0
        for stop in self.stops:
            at = tail.find(stop[0], start)
            while 0 <= at and len(tail) - at > held:
                if stop.startswith(tail[at:]):
                    held = len(tail) - at
                    break
                at = tail.find(stop[0], at + 1)
        return held

    def _first_stop(self) -> int | None:
        hits = [(i, len(s), s) for s in self.stops if (i := self.text.find(s, self.released)) >= 0]
        if not hits:
            return None
        start, length, self.matched = min(hits)
        return start + length if self.include else start

    def _release(self, end: int) -> str:
        piece = self.text[self.released : end]
        self.released = end
        return piece


def next_text(decoder: IncrementalDecoder, stops: StopMatcher, token_id: int, final: bool,
              ended_on_eos: bool, armed: bool = True) -> tuple[str, str | None, bool]:
    """One generated token's text: what it releases into the answer, its own text where that differs (a stop
    string's hold-back), and whether a stop string ended the answer. ``final``: the answer's last token (what is
    held back goes out with it); the EOS or stop id it ended on leaves its own text out unless
    include_stop_str_in_output, as vLLM's (its text shows when special tokens are not skipped)."""
    added = "" if final and ended_on_eos and not stops.include else decoder.add(token_id)
    held = decoder.flush() if final else ""
    text, stopped = _feed(stops, added, held, final, armed)
    delta = added + held
    return text, (delta if delta != text else None), stopped


def _feed(stops: StopMatcher, added: str, held: str, final: bool, armed: bool) -> tuple[str, bool]:
    """``stops.feed`` of a token's text; at the end, the U+FFFD that stands for an incomplete character in what the
    decoder held back is decode's placeholder, not text the model wrote: no stop string is looked for in it."""
    real = held.rstrip(REPLACEMENT)
    if len(real) == len(held):
        return stops.feed(added + held, final, armed)
    text, stopped = stops.feed(added + real, False, armed)
    if stopped:
        return text, True
    rest, _ = stops.feed(held[len(real):], True, armed=False)
    return text + rest, False


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, special tokens shown; a character split over tokens appears once."""
    decoder = IncrementalDecoder(tokenizer, [], skip_special_tokens=False)
    pieces = [decoder.add(i) for i in ids]
    pieces.append(decoder.flush())
    return [p for p in pieces if p]


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text as a stream releases it (special tokens shown): a character split over tokens is in the
    token that completes it ("" before), so the texts join into the ids' decoded text and their lengths are
    offsets in it (an incomplete character at the end is the last token's U+FFFD)."""
    decoder = IncrementalDecoder(tokenizer, [], skip_special_tokens=False)
    texts = [decoder.add(i) for i in ids]
    if texts:
        texts[-1] += decoder.flush()
    return texts
