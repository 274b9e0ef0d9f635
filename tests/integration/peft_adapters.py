"""Real PEFT LoRA adapters for tests: random weights on every projection, the B matrices scaled down so a
model's greedy text changes yet stays text."""

from __future__ import annotations

from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCALE = 0.2  # of the random B matrices: SmolLM2's greedy texts differ from the base model's within a dozen tokens


def make_adapter(model_dir: Path, folder: Path, rank: int, seed: int):
    """A PEFT LoRA adapter of ``rank`` for the model in ``model_dir``, saved to ``folder`` (adapter_config.json
    and adapter_model.safetensors) and returned as the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.mul_(SCALE)
    model.save_pretrained(folder)
    return model
