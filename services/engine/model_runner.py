"""Runs a Hugging Face decoder on our own paged KV cache, one flat batch per step.

The weights are transformers'; the step is ours. Every scheduled item computes ``num_tokens``
tokens of one sequence from ``seq.num_computed`` on, so a step may mix decoding sequences (one token
each), whole prompts, prompt chunks and prompts whose prefix the cache already holds. All of the
step's tokens go through each linear layer as one matrix product; attention is per kind of row:

- decode rows (the step's first rows, one token each) attend over their cached positions through
  their block tables in one ``paged_decode`` call, with nothing gathered;
- a prompt, a prompt chunk or a prompt after a cached prefix reads its positions from the cache
  (its own keys were just written there) and attends with a causal mask offset by what came
  before: one path, so a row's result does not depend on how its prompt was chunked or cached.

The cache is ``[layers, kv_heads, slots, head_dim]`` for K and for V: slot = block * block_size +
offset, so one head's block of positions is contiguous. The small per-layer operations (norms,
rotary embedding + cache write, SiLU * up, residuals) are ``kernels`` ops: fused C++ on the CPU, the
same math in PyTorch on cuda and npu.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from services.engine import gguf_weights, kernels, layer_loop, linears
from services.engine.batch import Batch, Chunk
from services.engine.devices import Device
from services.engine.gguf_weights import GgufLinears
from services.engine import step_graphs
from services.engine.graphs import DecodeGraphs, GraphPlan, reserve_bytes
from services.engine.kv_cache import KvCache, token_bytes
from services.engine.lora import GroupStack, LoraSet
from services.engine.model_loading import UnsupportedModel, load_model, prequantized_config
from services.engine.model_parts import layer_norms, mrope_axes
from services.engine.scheduler import Scheduled

log = logging.getLogger("switchboard.engine")


class ModelRunner:
    def __init__(self, path: str, device: Device, block_size: int, kv_budget_bytes, max_blocks: int,
                 batch_hint: int = 16, cpu_kernels: bool = True, max_loras: int = 0, max_lora_rank: int = 64,
                 graphs: GraphPlan | None = None, quantization: str = "none", kv_cache_dtype: str = "auto"):
        """``kv_budget_bytes``: bytes, or a function giving them once the model is loaded (an
        accelerator's free memory); ``graphs``: run pure-decode steps from static buffers (as CUDA
        graphs when ``graphs.capture``), their memory set aside before the KV cache is sized;
        ``quantization``: the linear layers' weight format (``quant.py`` on cpu, ``quant_cuda.py`` on cuda); ``kv_cache_dtype``: "auto"
        (the model's dtype), "int8" (``kv_cache.py``; cpu only) or "fp8_e4m3" (cuda, 8.9+)."""
        self.path = path  # the model folder (its tokenizer builds structured output's grammars)
        self.device = device.torch_device
        self.dtype = device.dtype
        self.ops = kernels.for_device(self.device, cpu_kernels)
        quant_kernels = self.ops if hasattr(self.ops, "q8_linear") else None
        checkpoint = prequantized_config(path)
        if checkpoint is not None:  # an AWQ or GPTQ folder: its layers as they are stored
            if quantization != "none":
                raise ValueError(f"Switchboard.quantization {quantization!r}: the model folder's weights are already "
                                 f"{checkpoint['quant_method'].upper()}; leave it \"none\"")
            quantization = str(checkpoint["quant_method"]).lower()
        linears.check_format(quantization, device.torch_device)
        self.model, self.encoder, source = load_model(path, self.device, self.dtype, checkpoint, quant_kernels)
        self.config = config = self.model.config
        if quantization == "gguf":
            heads = config.num_attention_heads
            source = GgufLinears(gguf_weights.find(Path(path)), heads,
                                 getattr(config, "num_key_value_heads", None) or heads, quant_kernels)
        self.linears = linears.build(self.model, self.device, self.dtype, batch_hint, quantization, quant_kernels, source,
                                     ops=self.ops)
        if checkpoint is not None:  # its skeleton was read on the host, its packed projections now replaced
            self.model.to(self.device)
        self.quantization = quantization
        self.block_size = block_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.model.model.layers[0].self_attn.scaling
        self.norms = layer_norms(self.model.model)
        self.kv_cache_dtype = kv_cache_dtype
        budget = kv_budget_bytes() if callable(kv_budget_bytes) else kv_budget_bytes
        if graphs is not None and graphs.capture:
            budget -= reserve_bytes(self.config, graphs.max_rows, self.dtype)
            budget -= step_graphs.reserve_bytes(self.config, graphs.max_tokens, self.dtype) if graphs.max_tokens else 0
        self.num_blocks = min(max_blocks, budget // self.block_bytes)
        if self.num_blocks < 1:
            raise RuntimeError(f"KV-cache budget of {budget} bytes holds no block of {self.block_bytes} bytes")
        self.scratch_block = self.num_blocks  # one more block, owned by no sequence: padding rows write there
        self.kv = self._allocate_cache(kv_cache_dtype)
        self.plans_prefill = self.ops.prefills(self.dtype, self.head_dim, self.kv.quantized)  # else SDPA per chunk
        self.cos = self.sin = torch.empty(0, self.head_dim // 2)
        self._rope_tables(1024)
        self.lora = LoraSet(config, self.device, self.dtype, max_loras, max_lora_rank)
        self.mrope_axes = mrope_axes(self.model.model.rotary_emb, self.head_dim // 2, self.device)
        self.loop = layer_loop.build(self)  # decode steps' layers in one C++ call (cpu); before the graphs' passes
        self.graphs = DecodeGraphs(self, graphs) if graphs is not None else None
        self.pieces = (step_graphs.StepGraphs(self, graphs.max_tokens, graphs.capture)
                       if graphs is not None and graphs.max_tokens else None)
        log.info("model runner ready", extra={"dtype": str(self.dtype), "fused_ops": self.ops.fused,
                                               "layer_loop": self.loop is not None,
                                               "decode_graphs": bool(self.graphs and self.graphs.graphs),
                                               "step_graphs": bool(self.pieces and self.pieces.graphs)})

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv.k

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv.v

    @property
    def block_bytes(self) -> int:
        return self.block_size * token_bytes(self.config.num_hidden_layers, self.num_kv_heads, self.head_dim,
                                             self.dtype, self.kv_cache_dtype)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def modalities(self) -> list[str]:
        """Media kinds the model takes besides text; [] for a text model."""
        return self.encoder.modalities if self.encoder is not None else []

    @property
    def media_token_ids(self) -> frozenset[int]:
        return self.encoder.token_ids if self.encoder is not None else frozenset()

    def _allocate_cache(self, kv_dtype: str) -> KvCache:
        slots = (self.num_blocks + 1) * self.block_size  # the scratch block last
        log.info("kv cache", extra={"blocks": self.num_blocks, "block_size": self.block_size, "kv_dtype": kv_dtype})
        return KvCache(self.config.num_hidden_layers, self.num_kv_heads, slots, self.head_dim, self.dtype, kv_dtype,
                       self.device)

    def _rope_tables(self, positions: int) -> None:
        """cos and sin [P, head_dim / 2] (float32) of the model's own rotary embedding for positions
        [0, P); grown by doubling when a longer sequence comes."""
        if positions <= self.cos.shape[0]:
            return
        size = max(positions, 2 * self.cos.shape[0])
        probe = torch.zeros(1, 1, self.head_dim, dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            cos, sin = self.model.model.rotary_emb(probe, torch.arange(size, device=self.device)[None])
        half = self.head_dim // 2
        if not torch.equal(cos[0, :, :half], cos[0, :, half:]):
            raise UnsupportedModel("the model's rotary embedding does not rotate the two halves of each head alike")
        self.cos, self.sin = cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous()

    # ---- batch preparation ------------------------------------------------------------------

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def prepare(self, items: list[Scheduled]) -> Batch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        lens: list[int] = []
        chunks: list[Chunk] = []
        sample_rows: list[int] = []
        media: list[tuple[torch.Tensor, torch.Tensor]] = []
        pieces: list[tuple] = []  # prompt pieces for one paged prefill launch (ops that have it)
        num_decode = 0
        for item in items:
            seq, start, n = item.seq, item.seq.num_computed, item.num_tokens
            self._check_ids(seq.token_ids[start:start + n])
            row = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slot(seq.block_table, p) for p in range(start, start + n))
            if n == 1 and start > 0 and not chunks and not pieces:
                num_decode += 1
                tables.append(seq.block_table[: (start + self.block_size) // self.block_size])
                lens.append(start + 1)
            elif self.plans_prefill:
                pieces.append((row, start, n, seq.block_table))
            else:
                chunks.extend(self._chunks(seq, row, start, n, item.segment))
            if item.samples:
                sample_rows.append(len(ids) - 1)
            if seq.media_rows is not None or seq.media is not None:
                self._media(seq, row, start, n, media)
        self._rope_tables(max(positions) + 1)
        decode_tables = decode_lens = None
        if tables:
            width = max(len(t) for t in tables)
            decode_tables = self._long(b for t in tables for b in t + [0] * (width - len(t))).view(len(tables), width)
            decode_lens = self._long(lens)
        batch = Batch(self._long(ids), self._long(positions), self._long(slots), num_decode, decode_tables,
                      decode_lens, chunks, self._long(sample_rows),
                      self.lora.rows([(item.seq.lora, item.num_tokens) for item in items], self.device))
        if pieces:
            batch.prefill = self.ops.prefill_plan(pieces, self.block_size, self.device)
        if media:
            batch.media_rows = torch.cat([rows for rows, _ in media])
            batch.media_embeds = torch.cat([embeds for _, embeds in media])
        if any(item.seq.media_rows is not None and item.seq.media_rows.rope is not None for item in items):
            self._mrope(items, batch)
        return batch

    def _mrope(self, items: list[Scheduled], batch: Batch) -> None:
        """Each row's cos and sin under Qwen2-VL's multimodal rotary embedding: frequency j of a row
        rotates by the row's position on axis ``axes[j]`` (temporal, height or width); a row of a
        request without media has its position on all three."""
        rows = []
        for item in items:
            seq, start, n = item.seq, item.seq.num_computed, item.num_tokens
            if seq.media_rows is not None and seq.media_rows.rope is not None:
                rows.append(seq.media_rows.rope_positions(start, start + n))
            else:
                rows.append(torch.arange(start, start + n, device=self.device)[:, None].expand(-1, 3))
        positions = torch.cat(rows)  # [T, 3]
        self._rope_tables(int(positions.max()) + 1)
        index = positions.gather(1, self.mrope_axes[None].expand(positions.shape[0], -1))  # [T, head_dim / 2]
        batch.rope_cos = self.cos.gather(0, index)
        batch.rope_sin = self.sin.gather(0, index)

    def _media(self, seq, row: int, start: int, n: int, out: list) -> None:
        """The step rows of ``seq``'s positions [start, start + n) that are media tokens, with their
        features; the request's media are encoded on its first step (and kept for a recompute)."""
        if seq.media_rows is None:
            if self.encoder is None:
                raise ValueError("the served model is text-only: it takes no media")
            seq.media_rows = self.encoder.encode(seq.media, seq.prompt_ids)
            seq.media = None
        found = seq.media_rows.within(start, start + n)
        if found is not None:
            positions, embeds = found
            out.append((positions - start + row, embeds))

    def _chunks(self, seq, row: int, start: int, n: int, segment: int) -> list[Chunk]:
        """The attention pieces of positions [start, start + n) at rows from ``row``: one, or one per segment
        between multiples of ``segment``: a row's keys then end where its segment does, whatever else the
        step computes (flash SDPA sums differently for a different key length)."""
        if not segment:
            return [self._chunk(seq, row, start, n)]
        cuts = [start, *range((start // segment + 1) * segment, start + n, segment), start + n]
        return [self._chunk(seq, row + a - start, a, b - a) for a, b in zip(cuts, cuts[1:])]

    def _chunk(self, seq, row: int, start: int, n: int) -> Chunk:
        positions = torch.arange(start + n, device=self.device)
        mask = positions[None, :] <= (start + torch.arange(n, device=self.device))[:, None]
        return Chunk(row, row + n, self._long(self._slot(seq.block_table, p) for p in range(start + n)), mask)

    def _check_ids(self, ids: list[int]) -> None:
        """Raise for an id the embedding has no row for (on a GPU the lookup would abort the device)."""
        size = self.model.model.embed_tokens.num_embeddings
        if ids and not 0 <= min(ids) <= max(ids) < size:
            bad = next(i for i in ids if not 0 <= i < size)
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {size}")

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

    # ---- forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, items: list[Scheduled], hidden_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [S, vocab] (float32) for the next token of each item that samples, in item order; and the
        final hidden states of ``hidden_rows`` (rows of the flat batch: items' tokens in item order), for
        logits the caller takes in slices (prompt logprobs), or None."""
        if self.graphs is not None and self.graphs.fits(items, hidden_rows):
            return self.graphs.run(items), None
        batch = self.prepare(items)
        if self.pieces is not None and self.pieces.fits(batch, hidden_rows):
            return self.pieces.run(batch), None
        return self.forward(batch, hidden_rows)

    def forward(self, batch: Batch, hidden_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on a prepared batch (graph capture records this; it makes no host sync)."""
        inner = self.model.model
        residual = inner.embed_tokens(batch.input_ids)
        if batch.media_rows is not None:
            residual[batch.media_rows] = batch.media_embeds
        x = self.ops.rms_norm(residual, *self.norms[0].before)
        if self.loop is not None and layer_loop.runs(batch):
            x = self.loop.run(x, residual, self.cos, self.sin, batch.positions, batch.slots, batch.decode_tables,
                              batch.decode_lens)
        else:
            for index in range(len(self.linears)):
                x = self._layer(index, x, residual, batch)
        hidden = x[torch.tensor(hidden_rows, device=x.device)] if hidden_rows else None
        return self.model.lm_head(x[batch.sample_rows]).float(), hidden

    def _layer(self, index: int, x: torch.Tensor, residual: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One decoder layer on the normed input ``x``; ``residual`` is updated in place. Returns the
        residual normed by the next layer's input norm (the final norm after the last layer)."""
        return self.after_attention(index, self.attend(index, self.before_attention(index, x, batch), batch), residual,
                                    batch)

    def before_attention(self, index: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer ``index``'s qkv for the normed input ``x``, q and k rotated, K/V written to the cache. The
        projections' ``forward`` is called directly: a module's ``__call__`` costs microseconds, 120 times a step."""
        norms, lin = self.norms[index], self.linears[index]
        stacks = self.lora.stacks[index] if batch.lora is not None else None
        qkv = self._lora(lin.qkv.forward(x), x, stacks, "qkv", batch)
        if norms.qk is not None:  # Qwen3: RMSNorm of each head's q and k before the rotation
            self._qk_norm(qkv, norms.qk)
        if batch.rope_cos is None:
            self._store(index, qkv, self.cos, self.sin, batch.positions, batch.slots)
        else:
            self._store(index, qkv, batch.rope_cos, batch.rope_sin, self._row_index(qkv.shape[0]), batch.slots)
        return qkv

    def after_attention(self, index: int, o: torch.Tensor, residual: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The rest of layer ``index`` from its attention output ``o``: ``residual`` updated in place, returned
        normed by the next layer's input norm."""
        norms, lin = self.norms[index], self.linears[index]
        stacks = self.lora.stacks[index] if batch.lora is not None else None
        x = self.ops.add_rms_norm(self._lora(lin.o.forward(o), o, stacks, "o", batch), residual, *norms.middle)
        act = lin.act_mul(self.ops, self._lora(lin.gate_up.forward(x), x, stacks, "gate_up", batch))
        return self.ops.add_rms_norm(self._lora(lin.down.forward(act), act, stacks, "down", batch), residual,
                                     *norms.after)

    def _row_index(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    def _lora(self, y: torch.Tensor, x: torch.Tensor, stacks: dict[str, GroupStack] | None, group: str,
              batch: Batch) -> torch.Tensor:
        """``y`` (a projection group's base output for input ``x``) plus each row's adapter, in place."""
        if stacks is not None:
            stack = stacks[group]
            self.ops.lora_apply(y, x, stack.a_parts, stack.bts, batch.lora)
        return y

    def _qk_norm(self, qkv: torch.Tensor, attn) -> None:
        n, q_width = qkv.shape[0], self.num_heads * self.head_dim
        k_width = self.num_kv_heads * self.head_dim
        q = qkv[:, :q_width].view(n, self.num_heads, self.head_dim)
        k = qkv[:, q_width:q_width + k_width].view(n, self.num_kv_heads, self.head_dim)
        q.copy_(attn.q_norm(q))
        k.copy_(attn.k_norm(k))

    def _store(self, index: int, qkv: torch.Tensor, cos, sin, positions, slots) -> None:
        """Rotate q and k in place and write the rows' K/V to layer ``index``'s cache at ``slots``."""
        layer = self.kv.layers[index]
        if self.kv.quantized:
            self.ops.rope_store_q8(qkv, cos, sin, positions, layer.k, layer.v, layer.k_scale, layer.v_scale, slots,
                                   self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            self.ops.rope_store(qkv, cos, sin, positions, layer.k, layer.v, slots, self.num_heads, self.num_kv_heads,
                                self.head_dim)

    def _decode(self, index: int, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The decode rows' attention over their cached positions in layer ``index``."""
        layer = self.kv.layers[index]
        shape = (batch.decode_tables, batch.decode_lens, self.block_size, self.num_heads, self.num_kv_heads,
                 self.head_dim, self.scale)
        if self.kv.quantized:
            return self.ops.paged_decode_q8(q, layer.k, layer.v, layer.k_scale, layer.v_scale, *shape)
        return self.ops.paged_decode(q, layer.k, layer.v, *shape)

    def attend(self, index: int, qkv: torch.Tensor, batch: Batch, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, heads * head_dim]: each row's attention output (into ``out`` when given)."""
        width = self.num_heads * self.head_dim
        q = qkv[:, :width]
        if out is None and not batch.chunks and batch.prefill is None:
            return self._decode(index, q, batch)
        if out is None:
            out = torch.empty(qkv.shape[0], width, dtype=qkv.dtype, device=qkv.device)
        if batch.num_decode:
            out[: batch.num_decode] = self._decode(index, q[: batch.num_decode], batch)
        if batch.prefill is not None:
            layer = self.kv.layers[index]
            self.ops.paged_prefill(q, layer.k, layer.v, batch.prefill, out, self.block_size, self.num_heads,
                                   self.num_kv_heads, self.head_dim, self.scale)
        for chunk in batch.chunks:
            out[chunk.start:chunk.end] = self._attend_chunk(index, qkv[chunk.start:chunk.end], chunk)
        return out

    def _attend_chunk(self, index: int, qkv: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """Query i (position context + i) attends to positions [0, context + i], read from the cache.

        Every chunk takes this one path, a prompt's first chunk included: a row's result then depends
        only on its own position and keys, not on how the prompt was cut into chunks or which prefix
        came from the cache (in bfloat16 a different kernel path flips near-tie tokens)."""
        n, h, d = qkv.shape[0], self.num_heads, self.head_dim
        q = qkv[:, : h * d].view(n, h, d).transpose(0, 1)[None]
        k, v = self.kv.read(index, chunk.slots, qkv.dtype)
        o = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=chunk.mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, h * d)
