"""Decode steps replayed as CUDA graphs, from static input buffers padded to a ladder of batch sizes.

On a GPU a decode step is a few milliseconds of kernels, and launching its ~300-1,500 kernels one by
one from Python takes longer than running them. So, as vLLM and SGLang do, the step of a pure-decode
batch (every row one token of a running sequence; no LoRA row, no media, no prompt logprobs) is
captured once per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to the largest
batch) and replayed: one launch per step.

A graph reads its inputs from fixed addresses, so every step writes them into static buffers
(token ids, positions, cache slots, lengths, block tables) and pads the batch to the smallest
captured size that holds it. A padding row reads and writes only the runner's scratch block (a
cache block no sequence owns), with one position, so it changes nothing another row sees. Its
logits are computed and dropped.

Prefill and mixed steps change shape every step: they run as graphs between eager attentions
(``step_graphs.py``).

The same buffers and padding run eagerly where no graph is captured (``capture=False``): on a CPU
this is what the tests compare, token for token, with the ordinary step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.engine.batch import Batch
from services.engine.sampler import greedy_ids

log = logging.getLogger("switchboard.engine")

LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MAX_GRAPH_ROWS = LADDER[-1]


@dataclass(frozen=True)
class GraphPlan:
    """How the runner runs decode steps from static buffers.

    ``max_rows``: the largest batch (maxBatchSize, at most ``MAX_GRAPH_ROWS``; larger batches run
    eagerly); ``max_seq_len``: the longest sequence (sizes the block tables and rotary tables);
    ``capture``: record CUDA graphs (cuda only), else run the padded buffers eagerly; ``max_tokens``: prompt and
    mixed steps of up to this many tokens run as graphs between the attentions (``step_graphs.py``; 0: eagerly)."""

    max_rows: int
    max_seq_len: int
    capture: bool = True
    max_tokens: int = 0


def sizes_for(max_rows: int) -> list[int]:
    """The ladder up to ``max_rows`` (``max_rows`` itself included)."""
    top = min(max_rows, MAX_GRAPH_ROWS)
    return sorted({s for s in LADDER if s < top} | {top})


def reserve_bytes(config, max_rows: int, dtype: torch.dtype) -> int:
    """Device memory the graphs' activations and workspaces may take, set aside before the KV cache is
    sized: the largest batch's intermediate tensors (qkv, gate/up, the activation, float logits) and the
    decode attention's pieces (up to 16 float32 softmax states a row and query head: triton_ops.DECODE_SPLITS),
    twice for the allocator's slack, plus 256 MiB for cuBLAS and Triton workspaces."""
    rows = min(max_rows, MAX_GRAPH_ROWS)
    width = (3 * config.hidden_size + 3 * config.intermediate_size) * dtype.itemsize + 6 * config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    width += 16 * heads * (head_dim + 2) * 4
    return 2 * rows * width + (256 << 20)


class DecodeBuffers:
    """The static inputs of a decode step, for up to ``rows`` rows."""

    def __init__(self, rows: int, width: int, scratch_block: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        # ids, positions, slots, lens, and each row's source: its id's row in ``next_ids`` (a step launched ahead)
        self.scalars = torch.zeros(5, rows, dtype=torch.long, device=device)
        self.scalars[2] = self.scratch_slot
        self.scalars[3] = 1
        self.tables = torch.full((rows, width), scratch_block, dtype=torch.long, device=device)
        self.sample_rows = torch.arange(rows, device=device)
        self.next_ids = torch.zeros(rows, dtype=torch.long, device=device)  # each row's greedy token, every step
        self.pin = device.type == "cuda"

    def fill(self, items, bucket: int, sources: list[int] | None = None) -> None:
        """Write ``items`` (decode rows) into rows [0, len(items)) and padding into [len(items), bucket). With
        ``sources``, row i's token id is not known here yet: it is the last step's ``next_ids[sources[i]]``,
        copied on the device."""
        ids, positions, slots, lens, tables = [], [], [], [], []
        bs = self.block_size
        for item in items:
            seq = item.seq
            position = seq.num_computed
            ids.append(0 if sources is not None else seq.token_ids[position])
            positions.append(position)
            slots.append(seq.block_table[position // bs] * bs + position % bs)
            lens.append(position + 1)
            tables.append(seq.block_table[: position // bs + 1])
        pad = bucket - len(items)
        width = max(len(t) for t in tables)
        scalars = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad,
                                lens + [1] * pad, (sources or [0] * len(items)) + [0] * pad], dtype=torch.long)
        stage = torch.tensor([t + [self.scratch_block] * (width - len(t)) for t in tables]
                             + [[self.scratch_block] * width] * pad, dtype=torch.long)
        if self.pin:
            scalars, stage = scalars.pin_memory(), stage.pin_memory()
        self.scalars[:, :bucket].copy_(scalars, non_blocking=True)
        self.tables[:bucket, :width].copy_(stage, non_blocking=True)
        if sources is not None:
            n = len(items)
            self.scalars[0, :n].copy_(self.next_ids.index_select(0, self.scalars[4, :n]))

    def batch(self, bucket: int):
        """The runner's ``Batch`` over rows [0, bucket) of the buffers."""
        return Batch(self.scalars[0, :bucket], self.scalars[1, :bucket], self.scalars[2, :bucket], bucket,
                          self.tables[:bucket], self.scalars[3, :bucket], [], self.sample_rows[:bucket])


class DecodeGraphs:
    """Runs pure-decode steps from ``DecodeBuffers``: replayed CUDA graphs, or eagerly."""

    def __init__(self, runner, plan: GraphPlan):
        self.runner = runner
        self.sizes = sizes_for(plan.max_rows)
        width = -(-plan.max_seq_len // runner.block_size)
        self.max_position = width * runner.block_size
        runner._rope_tables(self.max_position)  # sized once: a graph holds the tables' address
        self.rope = runner.cos.data_ptr()
        self.buffers = DecodeBuffers(self.sizes[-1], width, runner.scratch_block, runner.block_size, runner.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # steps run from the buffers (tests read it)
        self.replays = 0  # of which by a graph replay (the benchmark reads it)
        if plan.capture:
            self.capture()

    def fits(self, items, hidden_rows) -> bool:
        """Whether this step runs from the buffers: decode rows only, as many as the largest size, with
        no adapter, media, prompt logprobs or position past the tables."""
        if hidden_rows or not items or len(items) > self.sizes[-1] or self.runner.cos.data_ptr() != self.rope:
            return False
        for item in items:
            seq = item.seq
            if (item.num_tokens != 1 or seq.num_computed == 0 or seq.num_computed != len(seq) - 1
                    or seq.lora is not None or seq.media is not None or seq.media_rows is not None
                    or seq.num_computed >= self.max_position):
                return False
        return True

    def bucket(self, n: int) -> int:
        return next(size for size in self.sizes if size >= n)

    def run(self, items, sources: list[int] | None = None) -> torch.Tensor:
        """Float32 logits [len(items), vocab] of the step's decode rows; each row's greedy token is left in
        ``buffers.next_ids``. ``sources``: the rows' token ids are the last step's ``next_ids`` at these rows
        (a step launched before the last one's tokens were read back: ``ahead.py``)."""
        if sources is None:
            self.runner._check_ids([item.seq.token_ids[item.seq.num_computed] for item in items])
        bucket = self.bucket(len(items))
        self.buffers.fill(items, bucket, sources)
        self.steps += 1
        captured = self.graphs.get(bucket)
        if captured is None:
            return self._pass(bucket)[: len(items)]
        graph, logits = captured
        graph.replay()
        self.replays += 1
        return logits[: len(items)]

    def _pass(self, bucket: int) -> torch.Tensor:
        """The model on the buffers' first ``bucket`` rows, and their greedy tokens into ``next_ids``, with no
        host sync (what a graph records)."""
        logits, _ = self.runner.forward(self.buffers.batch(bucket))
        self.buffers.next_ids[:bucket].copy_(greedy_ids(logits))
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, in one shared memory pool (each replay overwrites
        what the last one left; a step reads its logits before the next replays)."""
        started, pool = time.monotonic(), None
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, off the graph
                    self._pass(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._pass(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        log.info("decode graphs captured", extra={"sizes": self.sizes, "seconds": round(time.monotonic() - started, 2)})
