"""Quick side-by-side: Switchboard over HTTP vs HF `generate` in-process, same weights, one run.

    .venv/bin/python bench/smoke.py [--url http://127.0.0.1:1025] [--requests 8] [--tokens 64]

Needs a running server (`make serve`). Reports output tokens/s at concurrency 1 and N, and HF
`generate` for one sequence and for one static padded batch of N, plus the ratios. (The full
engine benchmark against `transformers serve` comes with the continuous-batching issue.)
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = Path(__file__).resolve().parent.parent / ".cache" / "models" / "SmolLM2-135M-Instruct"
PROMPTS = ["My name is Olivier and I", "The capital of Germany is", "Once upon a time", "def fibonacci(n):",
           "The best way to learn", "In 1969, the first", "Water boils at", "My favourite food is"]


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> int:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "do_sample": False, "details": True}}
    r = await client.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["details"]["generated_tokens"]


async def switchboard(url: str, prompts: list[str], tokens: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def run(p):
            async with sem:
                return await one(client, url, p, tokens)
        await one(client, url, "warm up", 2)
        start = time.perf_counter()
        total = sum(await asyncio.gather(*(run(p) for p in prompts)))
    return total / (time.perf_counter() - start)


def hf(prompts: list[str], tokens: int, batch: bool) -> float:
    tok = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    groups = [prompts] if batch else [[p] for p in prompts]
    start, total = time.perf_counter(), 0
    with torch.inference_mode():
        for group in groups:
            enc = tok(group, return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            total += (out.shape[1] - enc.input_ids.shape[1]) * len(group)
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:1025")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = (PROMPTS * (args.requests // len(PROMPTS) + 1))[: args.requests]
    rows = {
        "switchboard, concurrency 1": asyncio.run(switchboard(args.url, prompts, args.tokens, 1)),
        f"switchboard, concurrency {args.requests}": asyncio.run(switchboard(args.url, prompts, args.tokens, args.requests)),
        "HF generate, one at a time": hf(prompts, args.tokens, batch=False),
        f"HF generate, static batch of {args.requests}": hf(prompts, args.tokens, batch=True),
    }
    base = rows["HF generate, one at a time"]
    print(f"{'run':40s} {'out tok/s':>10s} {'vs HF single':>13s}")
    for name, rate in rows.items():
        print(f"{name:40s} {rate:10.1f} {rate / base:12.2f}x")


if __name__ == "__main__":
    main()
