"""Quality of the GPU's weight formats (``services/engine/quant_cuda.py``: int4 on the tensor-core int4 kernel's
layout, fp8 e4m3 W8A8) on the default model, measured on a CPU, where the same layers run PyTorch's CPU int4
kernel and its reference fp8 GEMM (slow, the same arithmetic up to summation order).

    .venv/bin/python bench/gpu_formats_quality.py

The model (SmolLM2-135M-Instruct) in bfloat16, as a GPU serves it, with every decoder projection replaced by
the format's layer (the lm_head stays bfloat16, as on a GPU); prints the perplexity of bench/quant_bench.py's
text and the greedy answer to "What is the capital of France?". fp8 twice: the text's rows multiplied as a
prompt's (a scale per row), then as a decode step's (a scale per 128 columns of a row, ``fp8_gemv``). The
GPU's speed is bench/gpu_bench.py's.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_bench import MODEL  # noqa: E402  bench/engine_bench.py
from quant_bench import TEXT  # noqa: E402  bench/quant_bench.py
from services.engine import quant_cuda  # noqa: E402


def load(fmt: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval().requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and fmt != "bfloat16":
                    setattr(parent, name, quant_cuda.quantize(child, fmt))
    return model


def perplexity(model, tokenizer) -> tuple[float, int]:
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = model(ids).logits[0, :-1].float().log_softmax(-1)
    nll = -logits.gather(1, ids[0, 1:, None]).mean().item()
    return math.exp(nll), ids.shape[1] - 1


def answer(model, tokenizer) -> str:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main() -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows, base = [], None
    for fmt in ("bfloat16", "int4", "fp8", "fp8, decode rows' product"):
        start = time.perf_counter()
        model = load(fmt.split(",")[0])
        # the prompt's rows as a decode step's (a scale per 128 columns, fp8_gemv) instead of one per row
        quant_cuda.FP8_GEMV_ROWS = 1 << 30 if "decode" in fmt else 16
        ppl, scored = perplexity(model, tokenizer)
        base = base or ppl
        text = answer(model, tokenizer)
        rows.append(f"| {fmt} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {text!r} |")
        print(f"[{fmt}] perplexity {ppl:.3f} over {scored} tokens; answer {text!r} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    print("\n| weights (GPU formats, on a CPU) | perplexity | vs bf16 | \"What is the capital of France?\" |")
    print("|---|---:|---:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
