"""Structured output in the batched step: each constrained sequence holds an llguidance matcher, and its row of
the step's logits is masked to the tokens that keep its text within the grammar, so constrained and free
requests share a batch (only constrained rows change).

The masks of a step depend only on what each matcher has consumed, so they are computed on a worker
thread while the model runs (llguidance drops the GIL) and applied just before sampling. A matcher
consumes each sampled token when the engine applies it (``Engine._advance``), so a step that runs again
(isolation) computes the same masks. Once the grammar is complete only end-of-sequence tokens are allowed,
so the request ends ``eos_token``; ``max_tokens`` may end it earlier (``length``), as in OpenAI's API.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np
import torch

from shared.errors import ErrorInfo, ErrorKind
from shared.grammar import grammar_text
from shared.messages import Grammar

log = logging.getLogger("switchboard.engine")


class Constraints:
    """The model's tokenizer as llguidance sees it (built on first use) and the mask worker."""

    def __init__(self, tokenizer_path, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built once, on first use (about 2 s for SmolLM2's; the service builds matchers off the step)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
        return self._tokenizer

    def matcher(self, grammar: Grammar, consumed: list[int]) -> llguidance.LLMatcher:
        """A matcher for ``grammar`` that has consumed ``consumed`` (a resumed or handed-over request's
        tokens); ValueError when the grammar cannot be built or the tokens leave it, RuntimeError when the
        model's tokenizer cannot be read."""
        try:
            tokenizer = self.tokenizer
        except Exception as exc:  # noqa: BLE001 - the request ends with this error, the engine goes on
            raise RuntimeError(f"the grammar engine cannot read the model's tokenizer: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(grammar), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be compiled: {_error(matcher)}")
        if consumed and not matcher.consume_tokens(consumed):
            raise ValueError(f"the tokens generated so far leave the grammar: {_error(matcher)}")
        return matcher

    def masks(self, matchers: list[llguidance.LLMatcher]) -> Future:
        """Each matcher's next-token mask (bool [vocab]), computed on the worker thread."""
        return self._pool.submit(_masks, matchers, self.vocab_size)


def left_grammar(matcher: llguidance.LLMatcher, token_id: int, grammar: Grammar) -> ErrorInfo:
    """Why a sampled (so, allowed) token could not be consumed. The grammar engine gave up on the grammar
    at one of its limits (a regex or a schema too large to follow, as ``a{1000000}`` or a schema requiring
    itself): the client's grammar, a 4xx. Anything else is internal. llguidance's state dump is left out."""
    error = _error(matcher)
    if error.startswith(("lexer error", "parser error")) or "TooComplex" in matcher.get_error():
        return ErrorInfo(ErrorKind.VALIDATION, f"{grammar.field or 'the grammar'} is too complex for the grammar "
                                               f"engine to follow ({error}); simplify it", grammar.field or None)
    return ErrorInfo(ErrorKind.INTERNAL, f"token {token_id} left the grammar: {error}")


def _error(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error without the parser state llguidance appends to it."""
    return matcher.get_error().split("\n<state>", 1)[0].strip()


def _masks(matchers: list[llguidance.LLMatcher], vocab_size: int) -> list[torch.Tensor]:
    out = []
    for matcher in matchers:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        out.append(torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)))
    return out


def apply_masks(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """The logits with each constrained row's disallowed tokens at -inf (a copy: the step's logits are
    inference tensors)."""
    out = logits.clone()
    for row, allowed in zip(rows, masks):
        out[row].masked_fill_(~allowed.to(out.device), float("-inf"))
    return out
