"""The fleet prefix cache: multi-turn conversations on several engines, routed by load, by cache, and by the
default mix, against one engine that holds everything (the hit rate to aim at), in one run.

Workload: ``--conversations`` conversations of ``--turns`` turns start as a Poisson process (``--rate`` per
second); each turn is a streaming chat completion whose history is every earlier turn (a shared system
prompt, a document of the conversation's own, then user messages and the answers); the next turn follows
the answer after an exponential think time (``--think`` s mean). Arrivals and think times come from one
seed, so every deployment sees the same workload. Each engine's KV cache holds about half of the
conversations' final histories (the case that matters: more conversations than one engine holds).

Measured per deployment: the prefix hit rate (prompt tokens found cached over prompt tokens looked up, all
engines, from their heartbeats), TTFT mean / p50 / p90 of the turns after the first, generated tokens/s
over the run, requests per engine (max over mean), and prefixes pulled between engines.

    .venv/bin/python bench/fleet_bench.py                       # SmolLM2-135M, 2 engines
    .venv/bin/python bench/fleet_bench.py --tiny --engines 4    # the tiny random Llama, 4 engines

Prints a Markdown report (also written to .cache/bench/fleet-<model>-<engines>.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peers_report import cpu, git_head  # noqa: E402
from processes import run_main  # noqa: E402
from rounds import publish  # noqa: E402

MAX_SEQ_LEN = 2560  # the shipped config's ModelDeployConfig.maxSeqLen

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone market window lantern harbor quiet orange engine meadow copper signal violet "
         "garden planet silver thunder canyon marble velvet anchor bridge castle dragon falcon glacier").split()
SYSTEM = ("You are a careful assistant for a logistics company. Answer briefly, cite the document when you can, "
          "and say so when the document does not cover a question. ") * 3


@dataclass
class Turn:
    conversation: int
    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    ttft: float = 0.0
    tokens: int = 0


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    hit_rate: float = 0.0
    per_engine: dict[str, int] = field(default_factory=dict)
    pulls: int = 0
    pulled_tokens: int = 0


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Workload:
    """The same conversations, arrivals and think times for every deployment."""

    def __init__(self, args):
        rng = random.Random(args.seed)
        self.args = args
        self.starts, t = [], 0.0
        for _ in range(args.conversations):
            t += rng.expovariate(args.rate)
            self.starts.append(t)
        self.documents = [f"Document {i}: " + text(rng, args.document_words) for i in range(args.conversations)]
        self.questions = [[text(rng, args.user_words) + "?" for _ in range(args.turns)]
                          for _ in range(args.conversations)]
        self.thinks = [[rng.expovariate(1 / args.think) for _ in range(args.turns)] for _ in range(args.conversations)]


async def conversation(client: httpx.AsyncClient, base: str, model: str, work: Workload, i: int, t0: float,
                       run: Run) -> None:
    args = work.args
    await asyncio.sleep(max(0.0, t0 + work.starts[i] - time.perf_counter()))
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(args.turns):
        content = work.questions[i][k] if k else f"{work.documents[i]}\n\n{work.questions[i][k]}"
        messages.append({"role": "user", "content": content})
        turn = Turn(i, k)
        answer = await stream(client, base, model, messages, args.answer_tokens, turn)
        run.turns.append(turn)
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(work.thinks[i][k])


async def stream(client: httpx.AsyncClient, base: str, model: str, messages: list[dict], tokens: int,
                 turn: Turn) -> str:
    started, parts = time.perf_counter(), []
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
                turn.prompt_tokens, turn.tokens = usage["prompt_tokens"], usage["completion_tokens"]
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content"):
                    turn.ttft = turn.ttft or time.perf_counter() - started
                    parts.append(choice["delta"]["content"])
    return "".join(parts)


def final_history_tokens(model_dir: Path, work: Workload) -> int:
    """A conversation's last prompt plus its answer, by the model's chat template (answers of the right length)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    answer = tok.decode([tok.encode(" river")[-1]] * work.args.answer_tokens)
    lengths = []
    for i in range(work.args.conversations):
        messages = [{"role": "system", "content": SYSTEM}]
        for k, question in enumerate(work.questions[i]):
            messages.append({"role": "user", "content": question if k else f"{work.documents[i]}\n\n{question}"})
            messages.append({"role": "assistant", "content": answer})
        lengths.append(len(tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids))
    return round(statistics.mean(lengths))


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)


def deploy(work_dir: Path, model_dir: Path, args, name: str, engines: int, kv_mb: int, routing: dict):
    from tests.integration.cluster import Cluster, FleetListener

    folder = work_dir / name.replace(" ", "-")
    folder.mkdir()
    threads = max(1, args.cores // engines)
    cluster = Cluster(folder, model_dir, engines=engines, tokenizers=1,
                      args={f"engine-{i}": ["--torch-threads", str(threads)] for i in range(engines)},
                      Switchboard={"kvCacheMemoryMb": kv_mb, "dtype": args.dtype, "routing": routing,
                                   "prefillOrder": args.prefill_order},
                      **{"BackendConfig.ScheduleConfig": {"enablePrefixCache": True, "cacheBlockSize": 16}})
    cluster.wait_ready(900)
    for i in range(engines):
        cluster.wait_started(f"engine-{i}", 1)
    model = httpx.get(cluster.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    return cluster, FleetListener(cluster.url, model), model


def measure(cluster, listener, model: str, work: Workload) -> Run:
    run = Run()
    before = listener.prefix_counters()
    routed_before, pulled_before = len(listener.routed), len(listener.pulled)

    async def everything():
        async with httpx.AsyncClient(timeout=600) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*[conversation(client, cluster.base, model, work, i, t0, run)
                                   for i in range(work.args.conversations)])
            return time.perf_counter() - t0

    run.seconds = asyncio.run(everything())
    time.sleep(1.5)  # the last heartbeats
    hit, queried = (a - b for a, b in zip(listener.prefix_counters(), before))
    run.hit_rate = hit / queried if queried else 0.0
    for routed in listener.routed[routed_before:]:
        run.per_engine[routed.engine] = run.per_engine.get(routed.engine, 0) + 1
    pulled = [p for p in listener.pulled[pulled_before:] if p.ok]
    run.pulls, run.pulled_tokens = len(pulled), sum(p.tokens for p in pulled)
    return run


def later_ttfts(run: Run) -> list[float]:
    return sorted(t.ttft for t in run.turns if t.index > 0)


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (4 layers, hidden 256) instead of "
                                                            "SmolLM2-135M")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2, help="torch threads to share among the engines")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rate", type=float, default=0.5, help="conversations starting per second (Poisson)")
    parser.add_argument("--think", type=float, default=3.0, help="mean seconds between an answer and the next turn")
    parser.add_argument("--document-words", type=int, default=120)
    parser.add_argument("--user-words", type=int, default=25)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policies", default="load,cache,mix")
    parser.add_argument("--routing", type=json.loads, default={},
                        help='other Switchboard.routing keys of the --engines deployments, e.g. \'{"pullMinTokens": 64}\'')
    parser.add_argument("--prefill-order", default="shortest", choices=["arrival", "shortest"],
                        help="Switchboard.prefillOrder of every engine")
    args = parser.parse_args()

    from tests.conftest import SMOL_DIR, make_tiny_model

    work_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    # tiny: 4 layers of 4 KV heads of 64 (4 KiB a token in bfloat16), so that half the conversations' K/V is more
    # than the smallest kvCacheMemoryMb (16 MiB)
    model_dir = make_tiny_model(work_dir / "tiny", hidden=256, layers=4, heads=4, kv_heads=4) if args.tiny else SMOL_DIR
    work = Workload(args)
    final_tokens = final_history_tokens(model_dir, work)
    per_token = kv_bytes_per_token(model_dir, args.dtype)
    least_mb = max(16, math.ceil(MAX_SEQ_LEN * per_token / 2**20))  # an engine refuses a cache short of maxSeqLen
    half_mb = max(least_mb, math.ceil(args.conversations / 2 * final_tokens * per_token / 2**20))
    all_mb = max(least_mb, math.ceil(1.5 * args.conversations * final_tokens * per_token / 2**20))
    print(f"KV per engine: {half_mb} MiB (about half of {args.conversations} conversations of ~{final_tokens} "
          f"tokens at {per_token} B/token); one engine holding everything: {all_mb} MiB", flush=True)
    deployments = [(f"{args.engines} engines, {policy}", args.engines, half_mb, {**args.routing, "policy": policy})
                   for policy in args.policies.split(",")]
    deployments.append(("1 engine holding everything", 1, all_mb, {"policy": "load"}))
    runs: dict[str, Run] = {}
    for name, engines, kv_mb, routing in deployments:
        cluster, listener = None, None
        try:
            cluster, listener, model = deploy(work_dir, model_dir, args, name, engines, kv_mb, routing)
            print(f"[{name}] running", flush=True)
            runs[name] = measure(cluster, listener, model, work)
            print(f"[{name}] {summary(runs[name])}\n[{name}] {breakdown(runs[name])}", flush=True)
        finally:
            if listener is not None:
                listener.close()
            if cluster is not None:
                cluster.stop()
    report(args, runs, half_mb, all_mb)
    return 0


def breakdown(run: Run) -> str:
    """TTFT of the later turns by the prompt tokens they computed (a hit computes the new turn only)."""
    parts = []
    for low, high in ((0, 128), (128, 256), (256, 10**9)):
        group = [t.ttft for t in run.turns if t.index > 0 and low <= t.prompt_tokens - t.cached_tokens < high]
        if group:
            parts.append(f"{low}-{high if high < 10**9 else ''} computed: {len(group)} turns, mean {statistics.mean(group):.3f} s")
    return "; ".join(parts)


def summary(run: Run) -> str:
    ttfts = later_ttfts(run)
    return (f"hit rate {run.hit_rate:.1%}, TTFT after the first turn mean {statistics.mean(ttfts):.3f} s "
            f"p50 {percentile(ttfts, 0.5):.3f} p90 {percentile(ttfts, 0.9):.3f}, "
            f"{sum(t.tokens for t in run.turns) / run.seconds:.1f} tok/s, per engine {sorted(run.per_engine.values())}, "
            f"pulls {run.pulls} ({run.pulled_tokens} tokens)")


def report(args, runs: dict[str, Run], half_mb: int, all_mb: int) -> None:
    model, flags = cpu()
    name = "tiny random Llama (4 layers, hidden 256)" if args.tiny else "SmolLM2-135M-Instruct"
    lines = [f"# Fleet prefix cache: {args.engines} engines, {name} (git {git_head()})", "",
             f"CPU: {model}; flags: {' '.join(flags)}",
             f"Workload: {args.conversations} conversations x {args.turns} turns, Poisson starts at {args.rate:g}/s, "
             f"think time {args.think:g} s mean, document {args.document_words} words, user turns {args.user_words} "
             f"words, answers {args.answer_tokens} tokens; {args.dtype}; KV {half_mb} MiB per engine (about half the "
             f"conversations), {all_mb} MiB for the one engine holding everything; {args.cores} torch threads shared"
             f"{'; routing ' + json.dumps(args.routing) if args.routing else ''}.",
             "", "| deployment | prefix hit rate | TTFT mean (turns 2+) | p50 | p90 | tokens/s | requests per engine "
             "(max / mean) | pulls (tokens) |", "|---|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        ttfts = later_ttfts(run)
        loads = list(run.per_engine.values()) or [0]
        lines.append(f"| {label} | {run.hit_rate:.1%} | {statistics.mean(ttfts):.3f} s | {percentile(ttfts, 0.5):.3f} s | "
                     f"{percentile(ttfts, 0.9):.3f} s | {sum(t.tokens for t in run.turns) / run.seconds:.1f} | "
                     f"{sorted(loads)} ({max(loads) / statistics.mean(loads):.2f}) | {run.pulls} ({run.pulled_tokens}) |")
    base = runs.get(f"{args.engines} engines, load")
    mix = runs.get(f"{args.engines} engines, mix")
    ideal = runs.get("1 engine holding everything")
    if base and mix and ideal:
        b, m = later_ttfts(base), later_ttfts(mix)
        lines += ["", f"mix vs load: TTFT mean **{statistics.mean(b) / statistics.mean(m):.2f}x** better, p90 "
                      f"**{percentile(b, 0.9) / percentile(m, 0.9):.2f}x**, tokens/s "
                      f"**{(sum(t.tokens for t in mix.turns) / mix.seconds) / (sum(t.tokens for t in base.turns) / base.seconds):.2f}x**; "
                      f"hit rate **{mix.hit_rate / ideal.hit_rate:.1%}** of one engine holding everything."]
    suffix = "tiny" if args.tiny else "smollm2"
    publish(ROOT / ".cache" / "bench" / f"fleet-{suffix}-{args.engines}.md", lines)


if __name__ == "__main__":
    run_main(main)
