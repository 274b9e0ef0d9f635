"""The tiny vision-language folders of tests/vlm_models.py build, load, and give transformers' outputs
that depend on the image (and, for SmolVLM, text-only outputs that are exactly SmolLM2's)."""

from __future__ import annotations

import pytest
import torch

from tests import media_items as mi
from tests import vlm_models as vm
from tests import vlm_oracles as vo

QUESTION = "What colour is it?"  # SmolLM2 answers this one from the image (seeds 0, 1, 2 differ)


def image_chat(text: str = QUESTION) -> list[dict]:
    """One user turn: an image item then a text item."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def smolvlm_dir(tmp_path_factory, smol_dir):
    return vm.make_smolvlm(tmp_path_factory.mktemp("smolvlm"), smol_dir, seed=0)


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory, smol_dir):
    return vm.make_llava(tmp_path_factory.mktemp("llava"), smol_dir, seed=0)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory, smol_dir):
    return vm.make_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"), smol_dir, seed=0)


def image_features(model_dir, seed: int) -> torch.Tensor:
    """The features transformers places at the image tokens for test image ``seed``, as one tensor."""
    _, model = vo.load(model_dir)
    inputs = vo.hf_inputs(model_dir, [mi.test_image(seed)], text=vo.placeholder(model_dir))
    with torch.inference_mode():
        if model.config.model_type == "idefics3":
            out = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
        elif model.config.model_type == "llava":
            out = model.model.get_image_features(inputs["pixel_values"], vision_feature_layer=-2,
                                                 vision_feature_select_strategy="default")
        else:
            out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return torch.cat(list(out.pooler_output))


def check_images_matter(model_dir, image_tokens: int, hidden: int) -> None:
    """Image features have one row per image token, differ between images, and so do greedy outputs."""
    processor, _ = vo.load(model_dir)
    ids = vo.hf_prompt_ids(model_dir, [mi.test_image(0)], messages=image_chat())
    assert ids.count(processor.image_token_id) == image_tokens
    first, second = image_features(model_dir, 0), image_features(model_dir, 1)
    assert first.shape == (image_tokens, hidden) and not torch.allclose(first, second, atol=1e-3)
    outputs = [vo.hf_generate(model_dir, [mi.test_image(seed)], messages=image_chat()) for seed in (0, 1, 2)]
    assert len({tuple(o) for o in outputs}) == 3, outputs


def test_smolvlm_folder_loads_with_pil_processor(smolvlm_dir):
    processor, model = vo.load(smolvlm_dir)
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    assert model.config.architectures == ["Idefics3ForConditionalGeneration"]
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    assert torch.equal(model.lm_head.weight, model.model.text_model.embed_tokens.weight)
    assert vo.placeholder(smolvlm_dir) == "<image>"


def test_smolvlm_text_only_equals_smollm2(smolvlm_dir, smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert vo.hf_prompt_ids(smolvlm_dir, [], messages=chat) == list(ids)
    lm = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert vo.hf_generate(smolvlm_dir, [], messages=chat, max_new_tokens=16) == expected


def test_smolvlm_list_content_text_only_renders_as_string(smolvlm_dir):
    as_list = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    as_string = [{"role": "user", "content": "Hello there"}]
    assert vo.hf_prompt_ids(smolvlm_dir, [], messages=as_list) == vo.hf_prompt_ids(smolvlm_dir, [], messages=as_string)


def test_smolvlm_images_change_the_features_and_output(smolvlm_dir):
    check_images_matter(smolvlm_dir, image_tokens=20, hidden=576)  # 2x2 tiles + global, 4 tokens each


def test_smolvlm_raw_text_prompt(smolvlm_dir):
    text = f"{vo.placeholder(smolvlm_dir)}Caption:"
    assert len(vo.hf_generate(smolvlm_dir, [mi.test_image(2)], text=text, max_new_tokens=4)) <= 4


def test_test_images_are_deterministic_and_distinct():
    import numpy as np

    a, b = np.asarray(mi.test_image(0)), np.asarray(mi.test_image(1))
    assert a.shape == (80, 96, 3) and np.array_equal(a, np.asarray(mi.test_image(0)))
    assert np.abs(a.astype(int) - b.astype(int)).mean() > 30
    assert mi.data_url(mi.test_image(0)).startswith("data:image/png;base64,iVBOR")


def test_llava_folder_loads_and_images_matter(llava_dir):
    processor, model = vo.load(llava_dir)
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    assert model.config.architectures == ["LlavaForConditionalGeneration"]
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    assert torch.equal(model.lm_head.weight, model.model.language_model.embed_tokens.weight)
    check_images_matter(llava_dir, image_tokens=16, hidden=576)  # 32x32 image, 8x8 patches, CLS dropped


def test_qwen2_vl_folder_loads_and_images_matter(qwen2_vl_dir):
    processor, model = vo.load(qwen2_vl_dir)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert model.config.architectures == ["Qwen2VLForConditionalGeneration"]
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    check_images_matter(qwen2_vl_dir, image_tokens=9, hidden=64)  # 96x80 -> 84x84: 6x6 patches, 2x2 merge


@pytest.mark.parametrize("arch", ["smolvlm_dir", "llava_dir", "qwen2_vl_dir"])
def test_processor_returns_numpy(arch, request):
    model_dir = request.getfixturevalue(arch)
    inputs = vo.hf_inputs(model_dir, [mi.test_image(0)], messages=image_chat(), return_tensors="np")
    assert type(inputs["input_ids"]).__module__ == "numpy" and type(inputs["pixel_values"]).__module__ == "numpy"
