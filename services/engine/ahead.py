"""Steps launched ahead: the next decode step goes to the device before this one's tokens are read back.

On a GPU a decode step replays one graph in a few milliseconds, and between two replays the host schedules, fills
the buffers, waits for the sampled tokens, appends them and publishes them: the device idles meanwhile (0.3-0.7 ms
of a 4.7 ms step at one row of an 8B model). vLLM v1's async scheduling takes that time out of the device's path,
and so does this, for the steps where it is simple: pure-decode steps replayed from the decode graphs
(``graphs.py``) whose every row's token is drawn on the device alone (no grammar or handoff; logprobs are computed
there and read back with the tokens). Such a step's tokens are the graph's own argmax
(``DecodeBuffers.next_ids``), with the tokens of the rows that sample or have penalties written over it from
``sampler.sample_on_device`` (the ordinary step's sampling, which makes no host sync), so the step after it can be
launched at once, its token ids copied on the device from the last step's; the host reads the last step's tokens
back (``Flight.results``) while the device runs the new one.

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
from services.engine.sampler import check_sampling, on_device, plain_greedy, sample_on_device
from services.engine.scheduler import Scheduled
from services.engine.sequence import Sequence, Status
from shared.messages import TokenLogprob

PENDING = -1  # a token id in flight: sampled on the device, not read back yet


@dataclass
class Flight:
    """A launched step: its rows' sequences, where each row's token goes in ``seq.token_ids``, and what is being
    copied back to ``host`` (done when ``event`` is): the tokens, then, when rows asked for logprobs (``asking``,
    each wanting ``ks`` alternatives), the chosen tokens' logprobs and the top alternatives' ids and logprobs."""

    seqs: list[Sequence]
    indices: list[int]
    host: list[torch.Tensor]
    event: torch.cuda.Event | None
    asking: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    rows: dict[int, int] = field(default_factory=dict)  # id(seq) -> its row

    def results(self) -> list[tuple[int, TokenLogprob | None]]:
        """Each row's token and, where asked for, its logprob (``sampler.token_logprob``'s)."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self.asking:
            chosen, ids, values = (t.tolist() for t in self.host[1:])
            for j, (row, k) in enumerate(zip(self.asking, self.ks)):
                logprobs[row] = TokenLogprob(chosen[j], ids[j][:k], values[j][:k]) if k > 0 else TokenLogprob(chosen[j])
        return list(zip(tokens, logprobs))


def runs_ahead(seq: Sequence) -> bool:
    """Whether a sequence's next token is drawn on the device alone (the graph's argmax, or
    ``sampler.sample_on_device``) and nothing else is needed of its step but its logprobs: no grammar or bad word
    of several tokens (their masks need the last token on the host) or handoff."""
    try:
        check_sampling(seq.sampling)
    except ValueError:
        return False  # the ordinary step ends it, alone
    return (seq.matcher is None and not seq.handoff and not seq.wants_prompt_logprobs
            and all(len(word) == 1 for word in seq.sampling.bad_words_ids))


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
        special = [i for i, item in enumerate(items) if not plain_greedy(item.seq.sampling)]
        if special:  # draws and penalties: their tokens replace the graph's argmax
            rows = on_device(special, device, torch.long)
            last = self.graphs.buffers.scalars[0].index_select(0, rows)  # the step's input ids: each row's last token
            tokens = sample_on_device(logits.index_select(0, rows), [items[i].seq for i in special], last)
            next_ids.index_copy_(0, rows, tokens)
        asking = [i for i, item in enumerate(items) if item.seq.sampling.logprobs is not None]
        ks = [items[i].seq.sampling.logprobs for i in asking]
        out = [next_ids[:n], *(logprob_rows(logits, next_ids, on_device(asking, device, torch.long), max(ks))
                               if asking else ())]
        host = [readback(t) for t in out]
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        seqs = [item.seq for item in items]
        for seq in seqs:
            seq.num_computed += 1
            seq.token_ids.append(PENDING)
        self.flight = Flight(seqs, [len(seq) - 1 for seq in seqs], host, event, asking, ks,
                             {id(seq): i for i, seq in enumerate(seqs)})
        self.launches += 1
        return flight

    def take(self) -> Flight | None:
        """The flight, taken to be landed before a step of another kind (or dropped)."""
        flight, self.flight = self.flight, None
        return flight


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, k: int) -> list[torch.Tensor]:
    """For ``rows``: the log-probability of each one's token under the raw distribution, and the ids and
    log-probabilities of the ``k`` most likely tokens (``sampler.raw_logprobs`` and ``token_logprob``), on the
    device."""
    table = logits.index_select(0, rows).float().log_softmax(dim=-1)
    chosen = table.gather(1, tokens.index_select(0, rows)[:, None])[:, 0]
    top = table.topk(min(max(k, 1), table.shape[-1]))
    return [chosen, top.indices, top.values]


def readback(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` under way (pinned on cuda: complete when an event recorded after it is)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
    return host.copy_(tensor, non_blocking=True)


def land(flight: Flight, registry: dict[str, Sequence]) -> list[tuple[Sequence, int, int, TokenLogprob | None]]:
    """(sequence, index, token, logprob) of each of the flight's rows whose sequence has not ended, the token read
    back and put in place of its placeholder."""
    landed = []
    for seq, index, (token, logprob) in zip(flight.seqs, flight.indices, flight.results()):
        if seq.status is Status.FINISHED or registry.get(seq.id) is not seq:
            continue
        seq.token_ids[index] = token
        landed.append((seq, index, token, logprob))
    return landed
