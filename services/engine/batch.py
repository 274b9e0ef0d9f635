"""What one model pass reads: the step's rows (``Batch``) and, for a prompt piece attended from the cache, its
rows and positions (``Chunk``). ``ModelRunner.prepare`` makes them; the decode graphs and step graphs make them
over their static buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.lora import Rows


@dataclass
class Chunk:
    """A prefill item's rows [start, end) in the step, and where its positions are."""

    start: int
    end: int
    slots: torch.Tensor  # cache slots of positions [0, context + n): earlier ones and its own
    mask: torch.Tensor  # [n, context + n]: row i sees positions up to context + i


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot each token's K/V is written to
    num_decode: int  # rows [0, num_decode) are decode rows, one per sequence
    decode_tables: torch.Tensor | None  # [num_decode, max blocks] block tables, zero-padded
    decode_lens: torch.Tensor | None  # [num_decode] positions each decode row attends to
    chunks: list[Chunk]
    sample_rows: torch.Tensor  # [S] rows whose logits are sampled, in item order
    lora: Rows | None = None  # each row's adapter; None when no row has one
    media_rows: torch.Tensor | None = None  # [M] rows that are media tokens; None when the step has none
    media_embeds: torch.Tensor | None = None  # [M, hidden] their features (in place of token embeddings)
    rope_cos: torch.Tensor | None = None  # M-RoPE: [T, head_dim / 2] each row's own cos and sin (rows
    rope_sin: torch.Tensor | None = None  # then rotate by row index); None: by position, from the tables
    prefill: object | None = None  # the prompt rows as one ``paged_prefill`` launch reads them (in place of chunks)
