"""Prompt and mixed steps as CUDA graphs between the attentions ("piecewise", as vLLM captures them).

A step that computes prompt tokens cannot be one graph: its attention depends on how many prompts it
holds, how long, at which positions. Everything else in a layer works row by row on the step's flat
``[tokens, hidden]`` matrix (projections, norms, residuals, SiLU * up, rotary + cache write), so only the
number of tokens shapes it. So a step's token ids, positions and cache slots are written into static
buffers padded to a size of a token ladder, and for each size the model is captured as ``layers + 1``
graphs: the embedding up to layer 0's attention inputs, then from each layer's attention output to the
next layer's attention inputs, and the last from the last attention output to the final norm. Between
replays the attention runs eagerly from the step's ``Batch``: the decode rows' paged decode and one
paged prefill for all of the step's prompt chunks. A 32-layer step is then 33 replays and ~100 kernel
launches instead of ~400-600 launched one by one from Python.

A padding row is token 0 at position 0 writing its K/V to the scratch block; its attention output is
whatever the buffer held, seen by no other row (every captured operation works row by row). The
logits of the sampled rows are computed eagerly after the last replay.

Steps with LoRA rows, media, M-RoPE or prompt logprobs, and steps of more tokens than the largest size,
run the ordinary way. With ``capture=False`` the same buffers and pieces run eagerly: on a CPU this is
what the tests compare, token for token, with the ordinary step.
"""

from __future__ import annotations

import logging
import time

import torch

from services.engine.batch import Batch

log = logging.getLogger("switchboard.engine")

TOKEN_LADDER = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
MAX_GRAPH_TOKENS = TOKEN_LADDER[-1]


def token_sizes(max_tokens: int) -> list[int]:
    """The ladder up to ``max_tokens`` (itself included), at most ``MAX_GRAPH_TOKENS``."""
    top = min(max_tokens, MAX_GRAPH_TOKENS)
    return sorted({s for s in TOKEN_LADDER if s < top} | {top})


def reserve_bytes(config, max_tokens: int, dtype: torch.dtype) -> int:
    """Device memory of the static buffers and the graphs' pool at the largest size: the buffers (residual,
    qkv, attention output, final hidden) and a piece's intermediates (normed input, gate/up, activation),
    twice for the allocator's slack."""
    tokens = min(max_tokens, MAX_GRAPH_TOKENS)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv = (heads + 2 * (getattr(config, "num_key_value_heads", None) or heads)) * head_dim
    width = 4 * config.hidden_size + 2 * qkv + heads * head_dim + 3 * config.intermediate_size
    return 2 * tokens * width * dtype.itemsize


class StepBuffers:
    """The static inputs and the between-piece tensors of a step of up to ``tokens`` tokens."""

    def __init__(self, runner, tokens: int):
        device, dtype, config = runner.device, runner.dtype, runner.config
        self.scratch_slot = runner.scratch_block * runner.block_size
        self.scalars = torch.zeros(3, tokens, dtype=torch.long, device=device)  # ids, positions, slots
        self.scalars[2] = self.scratch_slot
        width = runner.num_heads * runner.head_dim
        self.residual = torch.zeros(tokens, config.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(tokens, width + 2 * runner.num_kv_heads * runner.head_dim, dtype=dtype, device=device)
        self.o = torch.zeros(tokens, width, dtype=dtype, device=device)
        self.hidden = torch.zeros(tokens, config.hidden_size, dtype=dtype, device=device)

    def fill(self, batch, size: int) -> None:
        """The step's ids, positions and slots into rows [0, n); padding into [n, size)."""
        n = batch.input_ids.shape[0]
        for i, values in enumerate((batch.input_ids, batch.positions, batch.slots)):
            self.scalars[i, :n].copy_(values, non_blocking=True)
        if size > n:
            self.scalars[:2, n:size].zero_()
            self.scalars[2, n:size].fill_(self.scratch_slot)

    def batch(self, size: int):
        """The ``Batch`` the pieces read: rows [0, size) of the buffers (no attention metadata: that stays the step's)."""
        empty = self.scalars[0, :0]
        return Batch(self.scalars[0, :size], self.scalars[1, :size], self.scalars[2, :size], 0, None, None, [], empty)


class StepGraphs:
    """Runs prompt and mixed steps from ``StepBuffers``: replayed CUDA graphs between eager attentions, or
    every piece eagerly."""

    def __init__(self, runner, max_tokens: int, capture: bool):
        self.runner = runner
        self.sizes = token_sizes(max_tokens)
        self.layers = len(runner.linears)
        self.rope = runner.cos.data_ptr()  # a graph holds the rotary tables' address
        self.buffers = StepBuffers(runner, self.sizes[-1])
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.steps = 0  # steps run from the buffers (tests read it)
        self.replays = 0  # of which by graph replays (the benchmark reads it)
        if capture:
            self.capture()

    def fits(self, batch, hidden_rows) -> bool:
        return (not hidden_rows and batch.lora is None and batch.media_rows is None and batch.rope_cos is None
                and batch.input_ids.shape[0] <= self.sizes[-1] and self.runner.cos.data_ptr() == self.rope)

    def run(self, batch) -> torch.Tensor:
        """Float32 logits [S, vocab] of the step's sampled rows."""
        n = batch.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        b = self.buffers
        b.fill(batch, size)
        graphs = self.graphs.get(size)
        self.steps += 1
        self.replays += graphs is not None
        for index in range(self.layers + 1):
            if graphs is not None:
                graphs[index].replay()
            else:
                self.piece(index, size)
            if index < self.layers:
                self.runner.attend(index, b.qkv[:n], batch, out=b.o[:n])
        return self.runner.model.lm_head(b.hidden[:n][batch.sample_rows]).float()

    def piece(self, index: int, size: int) -> None:
        """Piece ``index`` on rows [0, size): from layer ``index - 1``'s attention output (the embedding for
        0) to layer ``index``'s attention inputs (the final hidden states for the last)."""
        r, b = self.runner, self.buffers
        batch, residual = b.batch(size), b.residual[:size]
        if index == 0:
            residual.copy_(r.model.model.embed_tokens(b.scalars[0, :size]))
            x = r.ops.rms_norm(residual, *r.norms[0].before)
        else:
            x = r.after_attention(index - 1, b.o[:size], residual, batch)
        if index < self.layers:
            b.qkv[:size].copy_(r.before_attention(index, x, batch))
        else:
            b.hidden[:size].copy_(x)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record each size's pieces, largest size first, in one memory pool: every piece leaves what the next
        reads in the static buffers, so what one piece frees in the pool another may use."""
        started, pool = time.monotonic(), None
        current = torch.cuda.current_stream()
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up off the graph: Triton compiles, cuBLAS picks its kernels
                    for index in range(self.layers + 1):
                        self.piece(index, size)
            current.wait_stream(stream)
            graphs = []
            for index in range(self.layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.piece(index, size)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        log.info("step graphs captured", extra={"tokens": self.sizes, "seconds": round(time.monotonic() - started, 2)})
