"""Runs a Hugging Face decoder on our own block-based KV cache.

The weights and modules (projections, norms, rotary embedding, MLP) are transformers'; the
attention over the paged cache and the batching are ours, so prefill of several prompts and
decode of many sequences each run as one pass of the linear layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine import linears
from services.engine.devices import Device
from services.engine.sequence import Sequence

log = logging.getLogger("switchboard.engine")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModel(RuntimeError):
    pass


@dataclass
class Batch:
    """Flat token batch of one step, plus what attention needs to find each sequence's cache."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot each new token is written to
    last_index: torch.Tensor  # [B] index in T of each sequence's last token
    is_prefill: bool
    spans: list[tuple[int, int]]  # prefill: each sequence's [start, end) in T
    context_slots: torch.Tensor | None = None  # decode: [B, Lmax] cache slots to attend to
    context_mask: torch.Tensor | None = None  # decode: [B, 1, 1, Lmax] valid positions


class ModelRunner:
    def __init__(self, path: str, device: Device, block_size: int, kv_budget_bytes: int, max_blocks: int,
                 batch_hint: int = 16):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        check_architecture(config)
        self.config = config
        self.device = device.torch_device
        self.dtype = device.dtype
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.linears = linears.build(self.model, self.device, self.dtype, batch_hint)
        self.block_size = block_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_blocks = min(max_blocks, kv_budget_bytes // self.block_bytes)
        if self.num_blocks < 1:
            raise RuntimeError(f"KV-cache budget of {kv_budget_bytes} bytes holds no block of {self.block_bytes} bytes")
        self.k_cache, self.v_cache = self._allocate_cache()

    @property
    def block_bytes(self) -> int:
        layers = self.config.num_hidden_layers
        return 2 * layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _allocate_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.config.num_hidden_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        log.info("kv cache", extra={"blocks": self.num_blocks, "block_size": self.block_size})
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    # ---- batch preparation ------------------------------------------------------------------

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare_prefill(self, seqs: list[Sequence]) -> Batch:
        ids, positions, slots, spans, last = [], [], [], [], []
        for seq in seqs:
            self._check_ids(seq.token_ids)
            start = len(ids)
            ids.extend(seq.token_ids)
            positions.extend(range(len(seq)))
            slots.extend(self._slots(seq, 0, len(seq)))
            spans.append((start, len(ids)))
            last.append(len(ids) - 1)
        return Batch(self._long(ids), self._long(positions), self._long(slots), self._long(last), True, spans)

    def _check_ids(self, ids: list[int]) -> None:
        """Raise for an id the embedding has no row for (on a GPU the lookup would abort the device)."""
        size = self.model.model.embed_tokens.num_embeddings
        if ids and not 0 <= min(ids) <= max(ids) < size:
            bad = next(i for i in ids if not 0 <= i < size)
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {size}")

    def prepare_decode(self, seqs: list[Sequence]) -> Batch:
        lmax = max(len(s) for s in seqs)
        context = torch.zeros((len(seqs), lmax), dtype=torch.long)
        mask = torch.zeros((len(seqs), 1, 1, lmax), dtype=torch.bool)
        for i, seq in enumerate(seqs):
            context[i, : len(seq)] = torch.tensor(self._slots(seq, 0, len(seq)))
            mask[i, ..., : len(seq)] = True
        ids = [s.last_token for s in seqs]
        positions = [len(s) - 1 for s in seqs]
        new_slots = context[torch.arange(len(seqs)), torch.tensor(positions)]
        return Batch(self._long(ids), self._long(positions), new_slots.to(self.device),
                     self._long(range(len(seqs))), False, [],
                     context.to(self.device), mask.to(self.device))

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

    # ---- forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits [B, vocab] (float32) for the next token of each sequence."""
        batch = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        inner = self.model.model
        h = inner.embed_tokens(batch.input_ids)
        cos, sin = inner.rotary_emb(h[None], batch.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        for index, layer in enumerate(inner.layers):
            h = self._layer(index, layer, self.linears[index], h, cos, sin, batch)
        h = inner.norm(h[batch.last_index])
        return self.model.lm_head(h).float()

    def _layer(self, index: int, layer, lin: linears.LayerLinears, h, cos, sin, batch: Batch) -> torch.Tensor:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        n = x.shape[0]
        q, k, v = (t.view(n, -1, self.head_dim) for t in lin.qkv(x).split(lin.qkv_sizes, dim=-1))
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache[index].index_copy_(0, batch.slot_mapping, k)
        self.v_cache[index].index_copy_(0, batch.slot_mapping, v)
        if batch.is_prefill:
            o = self._attend_prefill(q, k, v, batch, attn.scaling)
        else:
            o = self._attend_decode(q, index, batch, attn.scaling)
        h = h + lin.o(o.reshape(n, -1))
        return h + lin.mlp(layer.post_attention_layernorm(h))

    def _attend_prefill(self, q, k, v, batch: Batch, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, end in batch.spans:
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _attend_decode(self, q, index: int, batch: Batch, scale: float) -> torch.Tensor:
        keys = self.k_cache[index][batch.context_slots].transpose(1, 2)  # [B, kvh, L, d]
        values = self.v_cache[index][batch.context_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=batch.context_mask,
                                           scale=scale, enable_gqa=True)
        return o[:, :, 0, :]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def check_architecture(config) -> None:
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModel(
            f"unsupported model architecture {archs or config.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
