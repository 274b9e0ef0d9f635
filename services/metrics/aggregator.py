"""TTFT and TBT per request, and moving averages over the last N finished requests (MindIE: 1000)."""

from __future__ import annotations

from collections import OrderedDict, deque

from shared.messages import MetricsSnapshot
from shared.metrics_messages import PROBE_API, Finished, FirstToken, MetricsEvent

WINDOW = 1000


class Aggregator:
    def __init__(self, window: int = WINDOW):
        self.first_token: OrderedDict[str, float] = OrderedDict()  # in flight: id -> ttft
        self.finished: OrderedDict[str, tuple[float | None, float | None]] = OrderedDict()
        self.window = window
        self.ttfts: deque[float] = deque(maxlen=window)
        self.tbts: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, event: MetricsEvent) -> None:
        if isinstance(event, FirstToken):
            self.first_token[event.id] = event.ttft_s
            while len(self.first_token) > 100 * self.window:  # requests that never finished
                self.first_token.popitem(last=False)
        elif isinstance(event, Finished) and event.api != PROBE_API:  # (a health probe is not a client's request)
            self._finish(event)

    def _finish(self, event: Finished) -> None:
        self.first_token.pop(event.id, None)
        ttft = event.ttft_s
        tbt = None
        if ttft is not None and event.generated_tokens > 1:
            tbt = (event.e2e_s - ttft) / (event.generated_tokens - 1)
        if ttft is not None:
            self.ttfts.append(ttft)
        if tbt is not None:
            self.tbts.append(tbt)
        self.finished[event.id] = (_ms(ttft), _ms(tbt))
        if len(self.finished) > self.window:
            self.finished.popitem(last=False)
        self.count += 1

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            requests=self.count,
            ttft_avg_ms=_ms(_mean(self.ttfts)) or 0.0,
            tbt_avg_ms=_ms(_mean(self.tbts)) or 0.0,
            per_request=dict(self.finished),
        )


def _mean(values) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
