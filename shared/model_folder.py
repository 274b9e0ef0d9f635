"""A model folder as users have them, checked before any service loads it: each file the engine or the
tokenizer will read must be there and parse, and an error names the file and what it needs (instead of a
traceback from deep inside transformers at start). No torch or transformers here: the launcher runs it.

A vision-language folder names its processor class in ``processor_config.json``, or — as Qwen2-VL's and
many folders on the Hub do — in ``preprocessor_config.json`` or ``tokenizer_config.json``
(transformers' own order); ``processor_class`` finds it in any of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "tokenizer.json",
              "model.safetensors.index.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


class ModelFolderError(ValueError):
    """A file of the model folder is missing or malformed; the message names it and what it needs."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ModelFolderError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot be read ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{path}: is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelFolderError(f"{path}: must hold a JSON object, not {type(value).__name__}")
    return value


def check(folder: Path, quantization: str = "none") -> None:
    """Raise ModelFolderError for the first missing or malformed file a service would need (``quantization``,
    the Switchboard key's value: with "gguf", the one ``*.gguf`` file it reads the layers from; with anything
    but "none", a folder whose weights are not already quantized)."""
    gguf = quantization == "gguf"
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: is not a folder (ModelConfig.modelWeightPath names the model's folder)")
    config = read_json(folder / "config.json")
    for name in JSON_FILES[1:]:  # the others, where present
        if (folder / name).exists():
            read_json(folder / name)
    if not config.get("model_type") and not config.get("architectures"):
        raise ModelFolderError(f"{folder / 'config.json'}: names neither model_type nor architectures: "
                               "it is not a transformers model's config")
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ModelFolderError(f"{folder}: holds no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin")):
        raise ModelFolderError(f"{folder}: holds no weights (*.safetensors or *.bin files)" + (
            "; with Switchboard.quantization \"gguf\" the layers come from the *.gguf file, the rest of the model "
            "(embeddings, norms) from these float weights" if gguf else ""))
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights)
    check_shards(folder)
    settings, where = quantization_config(folder, config)
    method = checkpoint_quantization(settings, where)
    if method and quantization != "none":
        raise ModelFolderError(f"{where}: the folder's weights are already {method.upper()} "
                               f"(quantization_config); Switchboard.quantization {quantization!r} would quantize "
                               "float weights: leave it \"none\"")
    if gguf and len(list(folder.glob("*.gguf"))) != 1:
        raise ModelFolderError(f"{folder}: Switchboard.quantization \"gguf\" needs exactly one *.gguf file here, "
                               f"found {len(list(folder.glob('*.gguf')))}")


def check_shards(folder: Path) -> None:
    """Every file ``model.safetensors.index.json``'s weight_map names is in the folder (a download that stopped
    between shards)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFolderError(f"{index}: its weight_map must be an object of tensor names to file names")
    absent = sorted({name for name in weight_map.values() if not (folder / name).is_file()})
    if absent:
        raise ModelFolderError(f"{index}: names {absent[0]}" + (f" and {len(absent) - 1} more" if len(absent) > 1 else "")
                               + ", which the folder does not hold (an interrupted download?)")


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose tensors' bytes are all there (a copy cut short, or a
    file that is not safetensors, is named here instead of failing deep in the engine's load)."""
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            total = path.stat().st_size
            if not 2 <= size <= min(total - 8, 100 * 1024 * 1024):
                raise ModelFolderError(f"{path}: is not a safetensors file (its 8-byte header length is {size}, "
                                       f"the file has {total} bytes)")
            header = json.loads(f.read(size))
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot be read ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{path}: its safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path}: is not a safetensors file (its header is not a JSON object)")
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    if max(ends, default=0) > total - 8 - size:
        raise ModelFolderError(f"{path}: is cut short: its tensors need {8 + size + max(ends)} bytes, the file has "
                               f"{total} (an interrupted download or copy?)")


CHECKPOINT_METHODS = ("awq", "gptq")  # 4-bit checkpoints the engine converts at load (services/engine/prequantized.py)


# the files older AutoGPTQ and AutoAWQ checkpoints keep their settings in, beside a config.json without them (as
# TheBloke's uploads on the Hub; vLLM reads them too), with the method each writes
QUANTIZE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def quantization_config(folder: Path, config: dict[str, Any]) -> tuple[Any, Path]:
    """The folder's quantization settings and the file they are in: config.json's ``quantization_config``, else
    the ``QUANTIZE_FILES`` one beside it (its ``quant_method`` that file's tool's when it names none); None for
    float weights."""
    if config.get("quantization_config") is not None:
        return config["quantization_config"], folder / "config.json"
    for name, method in QUANTIZE_FILES.items():
        if (folder / name).exists():
            settings = read_json(folder / name)
            return {"quant_method": method, **settings}, folder / name
    return None, folder / "config.json"


def checkpoint_quantization(qc: Any, where: Path | str = "config.json") -> str | None:
    """The quantization a folder's weights are stored in (``quantization_config``'s settings): "awq" or
    "gptq" (4 bits, groups of a multiple of 32 input columns), None for float weights; ModelFolderError naming
    the key for any other."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelFolderError(f"{where}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ModelFolderError(f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not a format "
                               f"Switchboard reads (it reads {', '.join(CHECKPOINT_METHODS)} 4-bit checkpoints, "
                               "GGUF files, and float weights it quantizes itself)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelFolderError(f"{where}: quantization_config.bits is {bits!r}; Switchboard reads {method} checkpoints "
                               "of 4 bits")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
        raise ModelFolderError(f"{where}: quantization_config.group_size {group!r} must be -1 or a multiple of 32")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelFolderError(f"{where}: quantization_config.version {version!r}: Switchboard reads AWQ's GEMM "
                                   f"packing (the usual one), not {version}'s")
        if qc.get("zero_point", True) is not True:
            raise ModelFolderError(f"{where}: quantization_config.zero_point false: Switchboard reads AWQ "
                                   "checkpoints with zero points")
    else:
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelFolderError(f"{where}: quantization_config.checkpoint_format {fmt!r}: Switchboard reads "
                                   "\"gptq\" and \"gptq_v2\"")
    return method


def processor_config(folder: Path) -> dict[str, Any]:
    """The first of ``PROCESSOR_FILES`` that names a ``processor_class`` (its whole object)."""
    for name in PROCESSOR_FILES:
        if (folder / name).exists():
            config = read_json(folder / name)
            if isinstance(config.get("processor_class"), str):
                return config
    raise ModelFolderError(f"{folder}: none of {', '.join(PROCESSOR_FILES)} names the model's processor_class "
                           "(a vision or audio model needs one)")
