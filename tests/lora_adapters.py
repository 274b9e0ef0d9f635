"""Real LoRA adapters for tests and benchmarks, made with PEFT (a test-only dependency) for a model folder.

``init_lora_weights=False`` draws A and B at random (PEFT's default zeroes B, an adapter that changes
nothing); B is then scaled by ``b_scale`` so the outputs differ visibly from the base model's while
staying text. PEFT's own ``generate`` with the adapter is the reference the engine must match.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: Path, out_dir: Path, seed: int = 0, r: int = 8, alpha: int = 16,
                 targets=ALL_TARGETS, rslora: bool = False, b_scale: float = 1.0, **extra) -> Path:
    """Save a PEFT LoRA adapter for ``model_dir`` into ``out_dir`` (``extra``: more LoraConfig fields)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=rslora, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], new_tokens: int):
    """PEFT's greedy generation with the adapter (the base model when None): (tokens, logits) per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: the end-of-text token may be drawn, and does not stop
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            results.append((out.sequences[0, len(ids):].tolist(), torch.cat(out.scores)))
    return results


if __name__ == "__main__":  # python -m tests.lora_adapters OUT_DIR [MODEL_DIR]: a demo adapter (README)
    import sys

    root = Path(__file__).resolve().parent.parent
    model = Path(sys.argv[2]) if len(sys.argv) > 2 else root / ".cache" / "models" / "SmolLM2-135M-Instruct"
    print(make_adapter(model, Path(sys.argv[1]), seed=1, r=8, alpha=16))
