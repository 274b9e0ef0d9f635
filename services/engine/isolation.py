"""Failure isolation: when a step raises, find the requests that make it raise.

The step's batch runs again in parts — halves, recursively, down to single sequences. A part that
succeeds keeps its results; a single sequence that still raises is a culprit. The function run on
each part must leave the sequences untouched (the engine appends tokens only after it returns), and
running it again must be safe: the KV-cache writes of the same positions are idempotent, the blocks
were allocated by the scheduler before the first try, and sampling is a function of (seed, position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
Item = TypeVar("Item")


@dataclass
class Outcome(Generic[T]):
    """Each item (a sequence's work in the step) either with its result or with the exception it
    raises alone (batch order kept)."""

    results: list[tuple[Any, T]] = field(default_factory=list)
    failures: list[tuple[Any, Exception]] = field(default_factory=list)

    def extend(self, other: "Outcome[T]") -> "Outcome[T]":
        self.results += other.results
        self.failures += other.failures
        return self


def run_isolated(fn: Callable[[list[Item]], list[T]], seqs: list[Item]) -> Outcome[T]:
    """``fn(seqs)``, one result per sequence; on an exception, bisect until only the culprits fail.

    A batch of n sequences with one culprit costs about 2·log2(n) extra runs; the healthy case
    costs nothing extra.
    """
    try:
        return Outcome(list(zip(seqs, fn(seqs), strict=True)))
    except Exception as exc:  # noqa: BLE001 — any failure is isolated, never propagated
        if len(seqs) == 1:
            return Outcome(failures=[(seqs[0], exc)])
    mid = len(seqs) // 2
    return run_isolated(fn, seqs[:mid]).extend(run_isolated(fn, seqs[mid:]))


__all__ = ["Outcome", "run_isolated"]
