"""What the side-by-side benchmarks share: alternating rounds over named setups, and the report's output."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def alternate(names: list, rounds: int, run: Callable[[object, str], T], show: Callable[[T], str],
              warm_up: Callable[[object], object] | None = None) -> dict[object, list[T]]:
    """A warm-up per setup (``warm_up(name)``, or a run; not counted), then ``rounds`` rounds over every setup,
    the order reversed every other round; ``run(name, label)`` measures one setup once (``label`` is unique
    per run, for nonces)."""
    for name in names:
        warm_up(name) if warm_up is not None else run(name, f"warm-up {name}")
    results: dict[object, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            results[name].append(run(name, f"round {r} {name}"))
            print(f"round {r + 1}: {name}: {show(results[name][-1])}", flush=True)
    return results


def publish(out: Path, lines: list[str]) -> None:
    """The Markdown report: written to ``out`` and printed."""
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
