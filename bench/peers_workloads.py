"""The peers benchmark's workloads (bench/peers_bench.py runs them against each server): the plan,
prompts of exact token lengths, the streaming client, and the table, long-prompt and shared-prefix
workloads with their results.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from statistics import median

import httpx

from engine_bench import MODEL, REQUEST_TIMEOUT_S  # bench/engine_bench.py
from results import MODEL_NAME, Run, Sample, percentile  # bench/results.py

# Prompts are cut from this text at exact token counts (the model's tokenizer).
PARAGRAPH = """The printing press changed how ideas travelled across Europe in the fifteenth century. A good recipe for
bread needs flour, water, salt, yeast and a great deal of patience. Rivers carve valleys slowly, moving sand and stones
a little further every single year. The committee met on Tuesday to discuss the budget for the new public library. Bees
visit thousands of flowers each day and carry pollen from one plant to the next. In distributed systems, a consensus
protocol lets many machines agree on a single value. The old lighthouse keeper wrote in his logbook every evening
before lighting the lamp. Electric trains draw power from overhead lines and brake by feeding energy back to them.
Children learn languages by listening long before they begin to speak whole sentences. The telescope revealed rings
around the planet that nobody had noticed before. A database index trades extra storage and slower writes for much
faster lookups. Farmers rotate crops so that the soil keeps its nutrients from one season to the next. The orchestra
tuned their instruments while the audience slowly found their seats. Glaciers store most of the fresh water on the
planet as ice that is thousands of years old. Mountain climbers carry oxygen because the air near the summit is very
thin. The chess player sacrificed her queen and won the game four moves later."""
SENTENCES = [s.strip().rstrip(".") + "." for s in PARAGRAPH.replace("\n", " ").split(". ") if s.strip()]
QUESTIONS = """What did the printing press change? What does bread need? How do rivers carve valleys? When did the
committee meet? What do bees carry? What does a consensus protocol do? What did the lighthouse keeper write? How do
electric trains brake? How do children learn languages? What did the telescope reveal? What does a database index
trade? Why do farmers rotate crops? What did the orchestra do? Where is most fresh water stored? How many eggs did the
baker use? Why do climbers carry oxygen?""".replace("\n", " ").split("? ")


@dataclass(frozen=True)
class Plan:
    concurrency: int = 16
    requests: int = 32
    single: int = 8  # requests at concurrency 1
    tokens: int = 64
    decoders: int = 16
    decoder_tokens: int = 128
    long_prompt: int = 1000  # tokens
    prefix_requests: int = 16
    prefix_concurrency: int = 4
    prefix_tokens: int = 32
    prefix_len: int = 500  # tokens of the shared system text


QUICK = Plan(concurrency=4, requests=8, single=2, tokens=16, decoders=4, decoder_tokens=64, prefix_requests=4,
             prefix_concurrency=2)


# ---- prompts ---------------------------------------------------------------------------------


class Prompts:
    """Deterministic prompts of exact token lengths (the model's tokenizer), no two sharing a 16-token prefix."""

    def __init__(self, plan: Plan):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(MODEL)
        n = plan.requests + plan.single
        self.table = [self.text(f"Note {i}:", i, 20 + 13 * i % 34) for i in range(n)]
        self.warm = [self.text(f"Warm-up {i}:", i + 7, 20 + 13 * i % 34) for i in range(plan.concurrency)]
        self.decoders = [self.text(f"Story {i}:", i + 3, 30) for i in range(plan.decoders)]
        self.long = [self.text(f"Document {k}:", 11 * i, plan.long_prompt) for i, k in enumerate("AB")]  # warm-up, measured
        system = self.text("You are a helpful assistant. Answer from these notes.", 5, plan.prefix_len)
        self.shared = [f"{system}\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)].rstrip('?')}? Answer:"
                       for i in range(plan.prefix_requests)]
        assert len(set(self.table + self.warm + self.decoders)) == n + plan.concurrency + plan.decoders

    def text(self, lead: str, start: int, tokens: int) -> str:
        rotated = SENTENCES[start % len(SENTENCES):] + SENTENCES[:start % len(SENTENCES)]
        body = " ".join(rotated * (1 + tokens // 200))
        return self.tok.decode(self.tok(f"{lead} {body}", add_special_tokens=False).input_ids[:tokens])

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False).input_ids)


# ---- streaming client ------------------------------------------------------------------------


@dataclass
class Trace:
    """One streamed completion: when it was sent, when each event carrying text arrived, the text."""

    start: float = 0.0
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    end: float = 0.0

    @property
    def sample(self) -> Sample:
        return Sample(self.times[0] - self.start, self.end - self.start, self.tokens)

    @property
    def gaps(self) -> list[tuple[float, float]]:
        return list(zip(self.times, self.times[1:]))


def client(connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits)


async def stream(http: httpx.AsyncClient, url: str, prompt: str, tokens: int, trace: Trace | None = None) -> Trace:
    trace = trace or Trace()
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    trace.start = time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            payload = line[len("data:"):].strip() if line.startswith("data:") else "[DONE]"
            if payload == "[DONE]":
                continue
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"{url}: error event {event}")
            text = "".join(c.get("text") or "" for c in event.get("choices") or [])
            if text:
                trace.times.append(time.perf_counter())
                trace.text += text
            if event.get("usage"):
                trace.tokens = event["usage"]["completion_tokens"]
    trace.end = time.perf_counter()
    if not trace.times:
        raise RuntimeError(f"{url}: the stream carried no text")
    trace.tokens = trace.tokens or len(trace.times)
    return trace


async def batch(url: str, prompts: list[str], tokens: int, concurrency: int) -> tuple[float, list[Trace]]:
    """Every prompt with at most ``concurrency`` in flight: the wall time and the traces, in prompt order."""
    gate = asyncio.Semaphore(concurrency)
    async with client(concurrency) as http:
        async def one(prompt: str) -> Trace:
            async with gate:
                return await stream(http, url, prompt, tokens)

        start = time.perf_counter()
        traces = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, list(traces)


# ---- workloads -------------------------------------------------------------------------------


@dataclass
class Long:
    ttft: float
    max_gap: float  # decoders' largest inter-token gap overlapping the long prefill
    median_gap: float

    @property
    def stall(self) -> float:
        return self.max_gap / self.median_gap


@dataclass
class Prefix:
    ttft_p50: float
    texts: list[str]


def table(url: str, name: str, plan: Plan, prompts: Prompts) -> dict[int, Run]:
    """The table workload once: the c{n} batch, then the c1 batch; the runs by concurrency."""
    runs = {}
    for level, chosen in ((plan.concurrency, prompts.table[:plan.requests]), (1, prompts.table[plan.requests:])):
        wall, traces = asyncio.run(batch(url, chosen, plan.tokens, level))
        runs[level] = Run(name, level, wall, [t.sample for t in traces])
    return runs


async def long_stall(url: str, decoders: list[str], tokens: int, prompt: str) -> Long:
    async with client(len(decoders) + 1) as http:
        traces = [Trace() for _ in decoders]
        tasks = [asyncio.create_task(stream(http, url, p, tokens, t)) for p, t in zip(decoders, traces)]
        try:
            while not all(t.times for t in traces):
                for task in tasks:
                    if task.done():
                        task.result()  # a decoder's error
                await asyncio.sleep(0.005)
            big = await stream(http, url, prompt, 8)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    begin, end = big.start, big.times[0]
    during = [b - a for t in traces for a, b in t.gaps if a < end and b > begin]
    return Long(end - begin, max(during, default=0.0), median(b - a for t in traces for a, b in t.gaps))


def long_prompt(url: str, plan: Plan, prompts: Prompts) -> Long:
    return asyncio.run(long_stall(url, prompts.decoders, plan.decoder_tokens, prompts.long[1]))


def shared_prefix(url: str, plan: Plan, prompts: Prompts) -> Prefix:
    asyncio.run(batch(url, ["Warm-up: tell me about the weather."], plan.prefix_tokens, 1))
    _, traces = asyncio.run(batch(url, prompts.shared, plan.prefix_tokens, plan.prefix_concurrency))
    return Prefix(percentile([t.sample.ttft for t in traces], 50), [t.text for t in traces])


def warm_up(url: str, plan: Plan, prompts: Prompts, long: bool) -> None:
    asyncio.run(batch(url, ["Warm-up: hello"], plan.tokens, 1))
    asyncio.run(batch(url, prompts.warm, plan.tokens, plan.concurrency))
    if long:
        asyncio.run(batch(url, prompts.long[:1], 8, 1))
