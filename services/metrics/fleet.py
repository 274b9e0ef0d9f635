"""Metrics of routing across engines (tokenizers' ``Routed`` events) and of prefixes pulled between engines
(``PrefixPulled``): how much of the prompts the chosen engines held, what the best holder held, how far
a choice was from the least loaded engine, and the live engines' load imbalance (max over mean)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.messages import EngineInfo
from shared.metrics_messages import PrefixPulled, Routed

GAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
PULL_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FleetMetrics:
    def __init__(self, model: str, registry: CollectorRegistry):
        self.model = model
        r, label = registry, ["model_name"]
        self.decisions = Counter("route_decisions", "Routing decisions by outcome: cache (the chosen engine holds part "
                                 "of the prompt), pull (it pulls a holder's prefix), load (no engine holds any).",
                                 [*label, "outcome"], registry=r)
        self.prompt = Counter("route_prompt_tokens", "Prompt tokens of routed requests.", label, registry=r)
        self.hit = Counter("route_hit_tokens", "Prompt tokens the chosen engines held in their prefix caches, "
                           "as the routers saw them.", label, registry=r)
        self.best = Counter("route_best_hit_tokens", "Prompt tokens the best holding engine held.", label, registry=r)
        self.gap = Histogram("route_load_gap", "Requests the chosen engine had over the least loaded one.", label,
                             buckets=GAP_BUCKETS, registry=r)
        self.imbalance = Gauge("engine_load_imbalance", "Live engines' requests (running and waiting): the most "
                               "loaded engine's over the mean (1 = even).", label, registry=r)
        self.pulled = Counter("prefix_pull_tokens", "Prompt tokens pulled from another engine's prefix cache.", label,
                              registry=r)
        self.pull_failed = Counter("prefix_pull_failures", "Prefix pulls given up (holder dead, slow or refusing).",
                                   label, registry=r)
        self.pull_seconds = Histogram("prefix_pull_seconds", "Seconds a prefix pull took.", label,
                                      buckets=PULL_SECONDS_BUCKETS, registry=r)

    def routed(self, event: Routed) -> None:
        m = self.model
        outcome = "pull" if event.pulled else "cache" if event.hit_tokens else "load"
        self.decisions.labels(m, outcome).inc()
        self.prompt.labels(m).inc(event.prompt_tokens)
        self.hit.labels(m).inc(event.hit_tokens)
        self.best.labels(m).inc(event.best_hit_tokens)
        self.gap.labels(m).observe(event.load_gap)

    def pulled_prefix(self, event: PrefixPulled) -> None:
        m = self.model
        if not event.ok:
            self.pull_failed.labels(m).inc()
            return
        self.pulled.labels(m).inc(event.tokens)
        self.pull_seconds.labels(m).observe(event.seconds)

    def engines(self, live: dict[str, EngineInfo]) -> None:
        loads = [e.running + e.waiting for e in live.values()]
        mean = sum(loads) / len(loads) if loads else 0.0
        self.imbalance.labels(self.model).set(max(loads) / mean if mean else 1.0)
