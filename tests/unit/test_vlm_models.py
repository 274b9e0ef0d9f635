"""The tiny vision-language folders of tests/vlm_models.py build, load, and give transformers' outputs
that depend on the image (and, for SmolVLM, text-only outputs that are exactly SmolLM2's)."""

from __future__ import annotations

import pytest
import torch

from tests import vlm_models as vm

QUESTION = "What colour is it?"  # SmolLM2 answers this one from the image (seeds 0, 1, 2 differ)


def image_chat(text: str = QUESTION) -> list[dict]:
    """One user turn: an image item then a text item."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def smolvlm_dir(tmp_path_factory, smol_dir):
    return vm.make_smolvlm(tmp_path_factory.mktemp("smolvlm"), smol_dir, seed=0)


def test_smolvlm_folder_loads_with_pil_processor(smolvlm_dir):
    processor, model = vm.load(smolvlm_dir)
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    assert model.config.architectures == ["Idefics3ForConditionalGeneration"]
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    assert torch.equal(model.lm_head.weight, model.model.text_model.embed_tokens.weight)
    assert vm.placeholder(smolvlm_dir) == "<image>"


def test_smolvlm_prompt_expands_image_into_tiles(smolvlm_dir):
    processor, _ = vm.load(smolvlm_dir)
    ids = vm.hf_prompt_ids(smolvlm_dir, [vm.test_image(0)], messages=image_chat())
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == 5 * 4  # 2x2 tiles + the global image, 4 tokens each (96x80 -> 128x107)


def test_smolvlm_text_only_equals_smollm2(smolvlm_dir, smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert vm.hf_prompt_ids(smolvlm_dir, [], messages=chat) == list(ids)
    lm = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert vm.hf_generate(smolvlm_dir, [], messages=chat, max_new_tokens=16) == expected


def test_smolvlm_list_content_text_only_renders_as_string(smolvlm_dir):
    as_list = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    as_string = [{"role": "user", "content": "Hello there"}]
    assert vm.hf_prompt_ids(smolvlm_dir, [], messages=as_list) == vm.hf_prompt_ids(smolvlm_dir, [], messages=as_string)


def test_smolvlm_images_change_the_features_and_output(smolvlm_dir):
    _, model = vm.load(smolvlm_dir)
    features = []
    for seed in (0, 1):
        inputs = vm.hf_inputs(smolvlm_dir, [vm.test_image(seed)], text="<image>")
        with torch.inference_mode():
            out = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
        features.append(torch.cat(out.pooler_output))
    assert features[0].shape == (20, 576) and not torch.allclose(features[0], features[1], atol=1e-3)
    outputs = [vm.hf_generate(smolvlm_dir, [vm.test_image(seed)], messages=image_chat()) for seed in (0, 1, 2)]
    assert len({tuple(o) for o in outputs}) == 3


def test_smolvlm_raw_text_prompt(smolvlm_dir):
    text = f"{vm.placeholder(smolvlm_dir)}Caption:"
    assert len(vm.hf_generate(smolvlm_dir, [vm.test_image(2)], text=text, max_new_tokens=4)) <= 4


def test_test_images_are_deterministic_and_distinct():
    import numpy as np

    a, b = np.asarray(vm.test_image(0)), np.asarray(vm.test_image(1))
    assert a.shape == (80, 96, 3) and np.array_equal(a, np.asarray(vm.test_image(0)))
    assert np.abs(a.astype(int) - b.astype(int)).mean() > 30
    assert vm.data_url(vm.test_image(0)).startswith("data:image/png;base64,iVBOR")
