"""Linear layers straight from a GGUF file's quantized tensors (``Switchboard.quantization: "gguf"``).

The model folder holds the transformers files (config, tokenizer, float weights for the norms and the
embeddings) and one ``*.gguf`` file of the same model, as llama.cpp users have it (the default model's folder
gets the Q4_1 GGUF it was made from). Each decoder layer's projections are read from the GGUF instead of the
float weights: Q4_0 and Q4_1 tensors become ``Q4Linear`` blocks as they are (the same 32-column blocks, scale
and offset; Q4_0's offset is -8 x its scale), Q8_0 and every other type the ``gguf`` package reads (Q4_K,
Q5_K, Q6_K, F16, ...) are dequantized one tensor at a time and quantized again, to int4 (4-bit types) or
int8. llama.cpp's converter reorders the rows of each attention head's q and k for its rotary layout; the
rows are put back in transformers' order (as transformers' own GGUF reader does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services.engine.quant import Q4Linear, Q8Linear, QuantLinear, merge
from shared.model_folder import ModelFolderError

NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
         "down": "ffn_down"}


class GgufError(ModelFolderError):
    """The model folder's GGUF file is missing, unreadable or does not match the model."""


def find(folder: Path) -> Path:
    files = sorted(Path(folder).glob("*.gguf"))
    if len(files) != 1:
        raise GgufError(f"{folder}: Switchboard.quantization \"gguf\" needs exactly one *.gguf file in the model "
                        f"folder, found {len(files)}")
    return files[0]


class GgufLinears:
    """The GGUF file's projection tensors, as the engine's quantized layers."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int, kernels=None):
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix, named
            raise GgufError(f"{path}: not a readable GGUF file ({exc})") from None
        self.path, self.kernels = path, kernels
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.heads = {"q": num_heads, "k": num_kv_heads}

    def layer(self, index: int, shapes: dict[str, tuple[int, int]]) -> dict[str, QuantLinear]:
        """Layer ``index``'s merged projections (qkv, o, gate_up, down); ``shapes``: each projection's
        [out, in] in the model, which the file's tensors must match."""
        parts = {key: self._part(index, key, shapes[key]) for key in NAMES}
        return {"qkv": merge([parts["q"], parts["k"], parts["v"]], self.kernels), "o": parts["o"],
                "gate_up": merge([parts["gate"], parts["up"]], self.kernels), "down": parts["down"]}

    def _part(self, index: int, key: str, shape: tuple[int, int]) -> QuantLinear:
        name = f"blk.{index}.{NAMES[key]}.weight"
        tensor = self.tensors.get(name)
        if tensor is None:
            raise GgufError(f"{self.path}: has no tensor {name}")
        got = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if got != tuple(shape):
            raise GgufError(f"{self.path}: tensor {name} is {list(got)}, the model's is {list(shape)}")
        layer = convert(tensor, self.kernels)
        if key in self.heads:
            layer = permute_rows(layer, unrotate(shape[0], self.heads[key]))
        return layer


def convert(tensor, kernels=None) -> QuantLinear:
    """One GGUF tensor as a quantized layer: Q4_0 / Q4_1 exactly, anything else through float."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    n, k = (int(d) for d in reversed(tensor.shape))
    raw = np.asarray(tensor.data)
    if tensor.tensor_type in (T.Q4_0, T.Q4_1):
        size = 18 if tensor.tensor_type == T.Q4_0 else 20
        blocks = raw.reshape(n, k // 32, size)
        d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].copy())
        if tensor.tensor_type == T.Q4_1:
            m = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].copy())
        else:
            m = d * -8  # w = d * (q - 8); exact in float16
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., size - 16:]).reshape(n, k // 2).copy())
        return Q4Linear(codes, d, m, kernels=kernels)
    try:
        weight = torch.from_numpy(np.asarray(quants.dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(n, k))
    except NotImplementedError:
        raise GgufError(f"tensor {tensor.name} is of GGUF type {tensor.tensor_type.name}, which the gguf package "
                        "cannot read") from None
    four_bit = tensor.tensor_type.name.startswith(("Q4", "IQ4", "MXFP4"))
    return (Q4Linear if four_bit else Q8Linear).from_float(weight, kernels=kernels)


def unrotate(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of a q or k weight with ``heads`` heads."""
    index = torch.arange(rows)
    return index.reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def permute_rows(layer: QuantLinear, order: torch.Tensor) -> QuantLinear:
    """``layer`` with its output rows taken in ``order`` (rows are independent in both formats)."""
    if isinstance(layer, Q4Linear):
        q, d, m = layer.canonical()
        return Q4Linear(q[order], d[order], m[order], kernels=layer.kernels)
    return Q8Linear(layer.q[order], layer.s[order], kernels=layer.kernels)
