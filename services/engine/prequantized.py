"""Linear layers from AWQ and GPTQ 4-bit checkpoints, the most common quantized folders on the Hub.

Such a folder's config.json has a ``quantization_config`` (``quant_method`` "awq" or "gptq", checked by
``shared/model_folder.py``) and each projection is stored as packed 4-bit codes with a scale and a zero point
per group of ``group_size`` input columns: ``w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]``.

- AWQ (GEMM packing): ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [K / group, N / 8] hold 8 output
  columns per int32, nibble i holding column ``8c + AWQ_ORDER[i]``; ``scales`` float16 [K / group, N].
- GPTQ: ``qweight`` int32 [K / 8, N] holds 8 input rows per int32 (nibble i: row ``8r + i``); ``qzeros`` int32
  [K / group, N / 8] in plain order, stored minus one in the original ("gptq") format and as they are in
  "gptq_v2"; ``scales`` float16 [K / group, N]; ``g_idx`` int32 [K], each input row's group.

Both become the engine's ``Q4Linear`` as they are (no float copy of the layer is ever made): the codes, each
block of 32 input columns taking its group's scale ``d = s`` and offset ``m = -z s`` (rounded to float16, at
most 1/256 of a step off). A GPTQ checkpoint made with ``desc_act`` whose groups do not fall on blocks of 32
is dequantized one layer at a time and stored as int8 instead, as is a projection the checkpoint keeps float
(AutoAWQ's ``modules_to_not_convert``). Everything else of the model (embeddings,
norms, biases, the lm_head) is float in these folders and loaded as such.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from services.engine.quant import BLOCK, Q4Linear, Q8Linear, QuantLinear, merge, pack4
from shared.model_folder import ModelFolderError

log = logging.getLogger("switchboard.engine")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACKED = ("qweight", "qzeros", "scales", "g_idx")
PARTS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


class CheckpointError(ModelFolderError):
    """A tensor of the checkpoint is missing or does not match the model; the message names it (a start-up
    error: one line, exit 2)."""


class Tensors:
    """The folder's safetensors files, read one tensor at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            for name in handle.keys():
                self.files[name] = handle
        if not self.files:
            raise CheckpointError(f"{folder}: a quantized checkpoint needs *.safetensors files")

    def get(self, name: str) -> torch.Tensor:
        handle = self.files.get(name)
        if handle is None:
            raise CheckpointError(f"the checkpoint has no tensor {name}")
        return handle.get_tensor(name)

    def floats(self) -> dict[str, torch.Tensor]:
        """Every tensor that is not part of a packed projection (embeddings, norms, biases, the lm_head)."""
        return {name: self.get(name) for name in self.files if name.rsplit(".", 1)[-1] not in PACKED}


class PrequantizedLinears:
    """The checkpoint's packed projections, as the engine's quantized layers (``layer`` as GgufLinears')."""

    def __init__(self, folder: Path, quantization_config: dict, kernels=None, tensors: Tensors | None = None):
        self.method = str(quantization_config["quant_method"]).lower()
        self.group = int(quantization_config.get("group_size", quantization_config.get("q_group_size", 128)))
        self.zeros_minus_one = self.method == "gptq" and quantization_config.get("checkpoint_format", "gptq") == "gptq"
        self.tensors = tensors or Tensors(folder)
        self.kernels = kernels

    def layer(self, index: int, shapes: dict[str, tuple[int, int]]) -> dict[str, QuantLinear]:
        parts = {key: self.part(f"model.layers.{index}.{name}", shapes[key]) for key, name in PARTS.items()}
        return {"qkv": merge([parts["q"], parts["k"], parts["v"]], self.kernels), "o": parts["o"],
                "gate_up": merge([parts["gate"], parts["up"]], self.kernels), "down": parts["down"]}

    def part(self, prefix: str, shape: tuple[int, int]) -> QuantLinear:
        n, k = shape
        if f"{prefix}.qweight" not in self.tensors.files and f"{prefix}.weight" in self.tensors.files:
            # a projection the checkpoint keeps float (AutoAWQ's modules_to_not_convert): int8, one scale a row
            return Q8Linear.from_float(self._get(prefix, "weight", (n, k)).float().contiguous(), kernels=self.kernels)
        group = k if self.group == -1 else self.group
        if k % BLOCK or k % group:
            raise CheckpointError(f"{prefix}: {k} input columns are not whole groups of {group} and blocks of {BLOCK}")
        if self.method == "awq":
            codes = unpack_columns(self._get(prefix, "qweight", (k, n // 8)), AWQ_ORDER)  # [K, N]
            groups = torch.arange(k) // group
        else:
            codes = unpack_rows(self._get(prefix, "qweight", (k // 8, n)))
            groups = self._g_idx(prefix, k, group)
        zeros = unpack_columns(self._get(prefix, "qzeros", (k // group, n // 8)),
                               AWQ_ORDER if self.method == "awq" else tuple(range(8))).to(torch.int32)
        if self.zeros_minus_one:
            zeros = zeros + 1
        scales = self._get(prefix, "scales", (k // group, n)).to(torch.float32)
        per_block = groups.reshape(k // BLOCK, BLOCK)
        if not torch.equal(per_block, per_block[:, :1].expand_as(per_block)):  # desc_act: groups across blocks
            weight = (codes.float() - zeros[groups].float()) * scales[groups]
            return Q8Linear.from_float(weight.T.contiguous(), kernels=self.kernels)
        block_group = per_block[:, 0]  # [K / 32]
        d = scales[block_group].T.contiguous()  # [N, K / 32]
        m = -(zeros[block_group].float() * scales[block_group]).T
        packed = pack4(codes.T.reshape(n, k // BLOCK, BLOCK).to(torch.uint8)).reshape(n, k // 2)
        return Q4Linear(packed, d.to(torch.float16), m.to(torch.float16), kernels=self.kernels)

    def _get(self, prefix: str, name: str, shape: tuple[int, int]) -> torch.Tensor:
        tensor = self.tensors.get(f"{prefix}.{name}")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{prefix}.{name} is {list(tensor.shape)}; the model needs {list(shape)}")
        return tensor

    def _g_idx(self, prefix: str, k: int, group: int) -> torch.Tensor:
        if f"{prefix}.g_idx" not in self.tensors.files:
            return torch.arange(k) // group
        g_idx = self.tensors.get(f"{prefix}.g_idx").to(torch.long)
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group:
            raise CheckpointError(f"{prefix}.g_idx must give each of the {k} input rows a group below {k // group}")
        return g_idx


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C / 8] → uint8 codes [R, C]: nibble i of each int32 is column ``8c + order[i]``."""
    nibbles = (packed[..., None] >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF  # [R, C / 8, 8]
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R / 8, C] → uint8 codes [R, C]: nibble i of each int32 is row ``8r + i``."""
    nibbles = (packed[:, None, :] >> torch.arange(0, 32, 4, dtype=torch.int32)[None, :, None]) & 0xF
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def load_skeleton(path: str, config, dtype: torch.dtype, tensors: Tensors) -> nn.Module:
    """The ``*ForCausalLM`` of ``config`` with the checkpoint's float tensors and its projections left
    unallocated (on the meta device, until the packed layers replace them)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: tensor.to(dtype) for name, tensor in tensors.floats().items()}
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its tables are computed, not stored
    projections = {f"{name}.weight" for name in PARTS.values()}
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if value.is_meta and not any(name.endswith(p) for p in projections):
            raise CheckpointError(f"{path}: the checkpoint has no tensor {name}")
    return model.eval().requires_grad_(False)
