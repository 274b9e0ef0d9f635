"""Wire messages to the metrics service (``subjects.METRICS_EVENTS``): lifecycle events from the gateways,
tokenizers and engines, one tagged union, encoded as every wire message (``shared.messages.encode``)."""

from __future__ import annotations

import bisect
from typing import Union

import msgspec

from shared.ends import FinishReason
from shared.messages import Msg


PROBE_API = "health"  # the ``api`` of /health/timed's one-token probe: counted, but not in latencies or averages
# time_per_output_token_seconds' buckets (MindIE's): each request's inter-token intervals are counted in them
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)


class Intervals(msgspec.Struct):
    """One request's inter-token intervals as a histogram: ``counts[i]`` intervals fell in TPOT_BUCKETS[i] (the
    last, above every bound), ``total`` their sum. Tokens that come together share their interval evenly."""

    counts: list[int] = msgspec.field(default_factory=lambda: [0] * (len(TPOT_BUCKETS) + 1))
    total: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        each = seconds / tokens
        self.counts[bisect.bisect_left(TPOT_BUCKETS, each)] += tokens
        self.total += seconds


class Received(Msg, tag="received"):
    model: str
    adapter: str = ""  # the request's LoRA adapter ("" = base model): a label on the request counters
    api: str = ""  # the API family and route it came by (tgi, openai-chat, anthropic, …): a label too
    gateway: str = ""  # the gateway's instance: its requests still open when its lease runs out end as errors


class Queued(msgspec.Struct, tag="queued", omit_defaults=True):
    """Engine: seconds each request of this step waited from receipt to its first schedule."""

    model: str
    seconds: list[float]


class FirstToken(Msg, tag="first_token"):
    model: str
    ttft_s: float


class Finished(Msg, tag="finished"):
    model: str
    arrival: float
    e2e_s: float
    ttft_s: float | None
    prompt_tokens: int
    generated_tokens: int
    finish_reason: FinishReason
    adapter: str = ""
    api: str = ""
    intervals: Intervals | None = None  # its inter-token intervals (time_per_output_token_seconds)


class KvTransferred(msgspec.Struct, tag="kv", omit_defaults=True):
    """Prefill engine: one request's K/V handed to a decode engine (bytes sent, seconds it took)."""

    model: str
    bytes: int
    seconds: float


class Routed(msgspec.Struct, tag="routed", omit_defaults=True):
    """Tokenizer: one routing decision (``services/tokenizer/routing.py``): the engine chosen, the prompt tokens
    it was expected to find cached, the most any engine held, and the load gap between the chosen engine and
    the least loaded one (requests)."""

    model: str
    engine: str
    prompt_tokens: int
    hit_tokens: int
    best_hit_tokens: int
    load_gap: int
    pulled: bool = False  # the engine was told to pull the holder's longer prefix


class PrefixPulled(msgspec.Struct, tag="pulled", omit_defaults=True):
    """Engine: a prefix pulled from another engine's cache (tokens received, seconds), or given up on."""

    model: str
    tokens: int
    seconds: float
    ok: bool = True


class Refused(msgspec.Struct, tag="refused", omit_defaults=True):
    """Gateway: an inference request answered with an error before it was received as one (bad input, the slots
    full, no engine serving, a body too large): its family's route and the HTTP status."""

    model: str
    api: str
    status: int


MetricsEvent = Union[Received, Queued, FirstToken, Finished, KvTransferred, Routed, PrefixPulled, Refused]
