"""Steps launched ahead: the next decode step goes to the device before this one's tokens are read back.

On a GPU a decode step replays one graph in a few milliseconds, and between two replays the host schedules,
fills the buffers, waits for the sampled tokens, appends them and publishes them: the device idles meanwhile
(0.3-0.7 ms of a 4.7 ms step at one row of an 8B model). vLLM v1's async scheduling takes that time out of the
device's path, and so does this, for the steps where it is simple: pure-decode steps replayed from the decode
graphs (``graphs.py``) whose every row's token is drawn on the device alone (no penalty, typical-p, logprobs,
grammar or handoff). Such a step's tokens are the graph's own argmax (``DecodeBuffers.next_ids``), the rows that
sample drawn over it on the device (``sampler.draw_on_device``: the same seeded draw as the ordinary step's), so
the step after it can be launched at once, its token ids copied on the device from the last step's; the host
reads the last step's tokens back (``Flight.tokens``) while the device runs the new one.

A sequence in flight holds a placeholder (``PENDING``) where its next token goes, and ``num_computed`` counts
the position the flight computes, so the scheduler sees it as one token further on, as it will be. The
engine lands a flight (``Engine._land``) right after launching the next one, or, before any other kind of
step, on its own:

- the token replaces the placeholder; the finish rules see the sequence's length at that token;
- a sequence that finishes had a row in the newer flight: that row's token is dropped when it lands (its
  K/V went to a slot of its own blocks, freed now; device work runs in launch order, so a later owner
  writes after it);
- blocks that became full are put into the prefix cache only once their tokens are known, when the flight
  that sampled their last token lands;
- a sequence ended meanwhile (cancelled, timed out, its step failed) is skipped.

Events come one step later than they would (a token is reported while the next one is being computed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.graphs import DecodeGraphs
from services.engine.sampler import check_sampling, draw_on_device, draws, draws_on_device, on_device
from services.engine.scheduler import Scheduled
from services.engine.sequence import Sequence, Status

PENDING = -1  # a token id in flight: sampled on the device, not read back yet


@dataclass
class Flight:
    """A launched step: its rows' sequences, where each row's token goes in ``seq.token_ids``, and the tokens
    being copied back to ``host`` (done when ``event`` is)."""

    seqs: list[Sequence]
    indices: list[int]
    host: torch.Tensor
    event: torch.cuda.Event | None
    rows: dict[int, int] = field(default_factory=dict)  # id(seq) -> its row

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def runs_ahead(seq: Sequence) -> bool:
    """Whether a sequence's next token is drawn on the device alone (the graph's argmax, or ``draw_on_device``)
    and nothing else is needed of its step: no penalty, logprobs, grammar or handoff."""
    try:
        check_sampling(seq.sampling)
    except ValueError:
        return False  # the ordinary step ends it, alone
    return (draws_on_device(seq.sampling) and seq.sampling.logprobs is None and seq.matcher is None
            and not seq.handoff and not seq.wants_prompt_logprobs)


class StepsAhead:
    def __init__(self, graphs: DecodeGraphs):
        self.graphs = graphs
        self.flight: Flight | None = None
        self.launches = 0  # steps launched ahead (tests and the benchmark read it)

    def takes(self, items: list[Scheduled]) -> bool:
        """Whether this step can be launched ahead: decode rows the graphs run, each ``runs_ahead``, and (with a flight)
        each one a row of that flight, so its token id is on the device."""
        if not items or not self.graphs.fits(items, None) or not all(runs_ahead(item.seq) for item in items):
            return False
        return self.flight is None or all(id(item.seq) in self.flight.rows for item in items)

    @torch.inference_mode()
    def launch(self, items: list[Scheduled]) -> Flight | None:
        """Launch the step; each sequence moves one token on, a placeholder where its token goes. Returns the
        flight launched before it (None if none), for the engine to land."""
        flight = self.flight
        sources = [flight.rows[id(item.seq)] for item in items] if flight is not None else None
        logits = self.graphs.run(items, sources)
        next_ids, n = self.graphs.buffers.next_ids, len(items)
        device = next_ids.device
        drawing = [i for i, item in enumerate(items) if draws(item.seq.sampling)]
        if drawing:  # their tokens replace the graph's argmax
            rows = on_device(drawing, device, torch.long)
            drawn, valid = draw_on_device(logits.index_select(0, rows), [items[i].seq for i in drawing])
            next_ids.index_copy_(0, rows, torch.where(valid, drawn, next_ids.index_select(0, rows)))
        host = torch.empty(n, dtype=torch.long, pin_memory=device.type == "cuda")
        host.copy_(next_ids[:n], non_blocking=True)
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        seqs = [item.seq for item in items]
        for seq in seqs:
            seq.num_computed += 1
            seq.token_ids.append(PENDING)
        self.flight = Flight(seqs, [len(seq) - 1 for seq in seqs], host, event, {id(seq): i for i, seq in enumerate(seqs)})
        self.launches += 1
        return flight

    def take(self) -> Flight | None:
        """The flight, taken to be landed before a step of another kind (or dropped)."""
        flight, self.flight = self.flight, None
        return flight


def land(flight: Flight, registry: dict[str, Sequence]) -> list[tuple[Sequence, int, int]]:
    """(sequence, index, token) of each of the flight's rows whose sequence has not ended, the token read back and
    put in place of its placeholder."""
    landed = []
    for seq, index, token in zip(flight.seqs, flight.indices, flight.tokens()):
        if seq.status is Status.FINISHED or registry.get(seq.id) is not seq:
            continue
        seq.token_ids[index] = token
        landed.append((seq, index, token))
    return landed
