"""Where the CPU goes under load: CPU seconds of each Switchboard process during a streaming run.

    .venv/bin/python bench/cpu_share.py [--url http://127.0.0.1:1025] [--requests 32] [--concurrency 16]

Needs a running `make serve` on this machine (reads /proc, Linux only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time

import httpx

PROMPTS = ["My name is Olivier and I", "The capital of Germany is", "Once upon a time", "def fibonacci(n):"]
SERVICES = ("gateway", "tokenizer", "engine", "metrics")


def processes() -> dict[str, int]:
    found = {"client": os.getpid()}
    for line in subprocess.run(["ps", "-ewwo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]:
        pid, args = line.strip().split(" ", 1)
        for name in SERVICES:
            if f"switchboard.cli {name}" in args:
                found[name] = int(pid)
        if "nats-server" in args and "switchboard-nats" in args:
            found["nats"] = int(pid)
    return found


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, requests: int, concurrency: int, tokens: int) -> int:
    gate = asyncio.Semaphore(concurrency)
    count = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: str) -> None:
            nonlocal count
            body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "do_sample": False}}
            async with gate, client.stream("POST", url + "/generate_stream", json=body) as r:
                async for line in r.aiter_lines():
                    count += line.startswith("data:")
        await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(requests)))
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:1025")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    procs = processes()
    before = {name: cpu_seconds(pid) for name, pid in procs.items()}
    start = time.perf_counter()
    tokens = asyncio.run(load(args.url, args.requests, args.concurrency, args.tokens))
    wall = time.perf_counter() - start
    print(f"{tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s\n")
    print("| process | CPU s | share of one core |\n|---|---:|---:|")
    for name, pid in procs.items():
        used = cpu_seconds(pid) - before[name]
        print(f"| {name} | {used:.1f} | {used / wall * 100:.1f}% |")


if __name__ == "__main__":
    main()
