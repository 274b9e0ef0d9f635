"""A Prometheus histogram fed whole histograms: each request's inter-token intervals come counted in the
buckets already (``shared.metrics_messages.Intervals``), one message per request rather than one per token."""

from __future__ import annotations

from prometheus_client.core import HistogramMetricFamily


class SummedHistogram:
    """A collector: ``add`` sums a histogram's per-bucket counts into the labelled series' own."""

    def __init__(self, name: str, documentation: str, labels: list[str], buckets: tuple[float, ...]):
        self.name, self.documentation, self.labels, self.buckets = name, documentation, labels, buckets
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def add(self, values: tuple[str, ...], counts: list[int], total: float) -> None:
        if len(counts) != len(self.buckets) + 1:
            raise ValueError(f"{self.name}: {len(counts)} bucket counts for {len(self.buckets)} bounds and +Inf")
        kept, kept_total = self._series.setdefault(values, ([0] * len(counts), [0.0]))
        for i, count in enumerate(counts):
            kept[i] += count
        kept_total[0] += total

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labels)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, (counts, total) in self._series.items():
            cumulative, running = [], 0
            for bound, count in zip([*map(_bound, self.buckets), "+Inf"], counts):
                running += count
                cumulative.append((bound, running))
            family.add_metric(list(values), cumulative, total[0])
        yield family


def _bound(value: float) -> str:
    return str(float(value))
