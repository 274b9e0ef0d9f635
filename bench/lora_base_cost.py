"""What base-model requests pay for loaded LoRA adapters: in-process decode steps, with none and with four loaded.

Two runners of the default model (float32): one with no adapter, one with four rank-16 adapters on all
seven projections (bench/lora_bench.py's, made on first use). Sixteen base-model requests decode 64
tokens on each, alternately (the order reversed every other round); the ratio is the median over rounds
of (step time with none ÷ step time with four loaded): 1.0 means nothing is paid.

    .venv/bin/python bench/lora_base_cost.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_bench import MODEL  # noqa: E402
from lora_bench import ADAPTERS, make_adapters  # noqa: E402
from processes import run_main  # noqa: E402
from services.engine.devices import resolve_device  # noqa: E402
from services.engine.engine import Engine, Limits  # noqa: E402
from services.engine.model_runner import ModelRunner  # noqa: E402
from shared.messages import EngineRequest, Sampling  # noqa: E402


def runner(adapters: Path | None) -> ModelRunner:
    r = ModelRunner(str(MODEL), resolve_device("cpu", "float32"), block_size=128, kv_budget_bytes=256 << 20,
                    max_blocks=4000, batch_hint=16, max_loras=8)
    for name in ADAPTERS if adapters else ():
        assert r.lora.load(name, str(adapters / name)).outcome.ok
    return r


def step_ms(r: ModelRunner, requests: int = 16, tokens: int = 64) -> float:
    """Milliseconds per decode step of ``requests`` base-model requests."""
    engine = Engine(r, Limits(32, 32, 8192, 2048), set())
    for i in range(requests):
        engine.add_request(EngineRequest(id=f"r{i}", prompt_ids=[100 + i + j for j in range(30)], reply_to="-",
                                         sampling=Sampling(do_sample=False, max_new_tokens=tokens, ignore_eos=True)))
    engine.step()  # the prefill
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    bare, loaded = runner(None), runner(make_adapters(16))
    ratios = []
    for k in range(args.rounds):
        first, second = (bare, loaded) if k % 2 == 0 else (loaded, bare)
        times = {id(first): step_ms(first), id(second): step_ms(second)}
        none, four = times[id(bare)], times[id(loaded)]
        ratios.append(none / four)
        print(f"round {k + 1}: no adapter {none:.2f} ms/step, four loaded {four:.2f} ms/step", flush=True)
    print(f"base-model throughput with four adapters loaded ÷ with none: {statistics.median(ratios):.3f} "
          f"(median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    run_main(main)
