"""The tiny Qwen2-Audio folder of tests/audio_models.py builds, loads through the Auto classes, and
gives transformers' outputs that depend on the clip, and valid text-only chats."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests import audio_models as am

QUESTION = "What is this sound?"


def audio_chat(text: str = QUESTION) -> list[dict]:
    """One user turn: an audio item then a text item."""
    return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def qwen2_audio_dir(tmp_path_factory, smol_dir):
    return am.make_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio"), smol_dir, seed=0)


def test_folder_loads_with_the_auto_classes(qwen2_audio_dir):
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    config = json.loads((qwen2_audio_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert config["text_config"]["hidden_size"] == 64 and config["audio_config"]["d_model"] == 64
    processor = AutoProcessor.from_pretrained(qwen2_audio_dir)
    model = AutoModelForMultimodalLM.from_pretrained(qwen2_audio_dir)
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    assert processor.feature_extractor.feature_size == model.config.audio_config.num_mel_bins == 128
    assert processor.audio_token_id == model.config.audio_token_id
    decoder = model.model.language_model
    assert len(decoder.layers) == 2 and decoder.norm is not None and decoder.rotary_emb is not None
    assert model.lm_head.weight.shape == decoder.embed_tokens.weight.shape


def test_string_chats_render_as_smollm2_does(qwen2_audio_dir, smol_dir):
    from transformers import AutoTokenizer

    processor, _ = am.load(qwen2_audio_dir)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Bye"}]
    smol = AutoTokenizer.from_pretrained(smol_dir)
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    rendered = processor.apply_chat_template(audio_chat(), add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What is this sound?<|im_end|>" in rendered


def test_the_processor_expands_each_clip_to_its_audio_tokens(qwen2_audio_dir):
    processor, _ = am.load(qwen2_audio_dir)
    placeholder = am.audio_placeholder(qwen2_audio_dir)
    assert placeholder == "<|audio_bos|><|AUDIO|><|audio_eos|>"
    clips = [am.test_clip(0, 1.0), am.test_clip(1, 0.5)]
    out = am.hf_audio_inputs(qwen2_audio_dir, clips, text=f"{placeholder}and{placeholder}", return_tensors="np")
    assert out["input_features"].shape == (2, 128, 3000) and out["feature_attention_mask"].shape == (2, 3000)
    assert out["feature_attention_mask"].sum(-1).tolist() == [100, 50]
    ids = out["input_ids"][0].tolist()
    assert ids.count(processor.audio_token_id) == am.num_audio_tokens(16000) + am.num_audio_tokens(8000) == 25 + 12


def test_features_at_the_audio_tokens_are_the_masked_encoder_rows(qwen2_audio_dir):
    _, model = am.load(qwen2_audio_dir)
    clips = [am.test_clip(0, 1.0), am.test_clip(1, 0.5)]
    placed = am.hf_audio_features(qwen2_audio_dir, clips)
    assert placed.shape == (25 + 12, 64)
    inputs = am.hf_audio_inputs(qwen2_audio_dir, clips, text=am.audio_placeholder(qwen2_audio_dir) * 2)
    by_hand = am.audio_features_by_hand(model, inputs["input_features"], inputs["feature_attention_mask"])
    assert torch.equal(placed, by_hand)
    alone = am.hf_audio_features(qwen2_audio_dir, clips[1:])  # a clip's features do not depend on its batch
    assert torch.allclose(alone, placed[25:], atol=1e-5)
    with torch.inference_mode():  # the mask matters: unmasked, the rows also attend to the padding
        unmasked = model.model.multi_modal_projector(model.model.audio_tower(inputs["input_features"][1:]).last_hidden_state)
    assert not torch.allclose(unmasked[0, :12], placed[25:], atol=1e-3)


def test_two_clips_give_different_outputs(qwen2_audio_dir):
    outputs = [am.hf_generate_audio(qwen2_audio_dir, [am.test_clip(seed)], messages=audio_chat()) for seed in (0, 1, 2)]
    assert all(len(o) == 16 for o in outputs)
    assert len({tuple(o) for o in outputs}) == 3, outputs
    again = am.hf_generate_audio(qwen2_audio_dir, [am.test_clip(0)], messages=audio_chat())
    assert again == outputs[0]


def test_two_clips_in_one_prompt(qwen2_audio_dir):
    placeholder = am.audio_placeholder(qwen2_audio_dir)
    clips = [am.test_clip(0, 0.7), am.test_clip(1, 1.3)]
    both = am.hf_generate_audio(qwen2_audio_dir, clips, text=f"{placeholder}{placeholder}Compare.", max_new_tokens=8)
    swapped = am.hf_generate_audio(qwen2_audio_dir, clips[::-1], text=f"{placeholder}{placeholder}Compare.",
                                   max_new_tokens=8)
    assert len(both) == 8 and both != swapped


def test_text_only_chat_gives_valid_tokens(qwen2_audio_dir):
    processor, model = am.load(qwen2_audio_dir)
    out = am.hf_generate_audio(qwen2_audio_dir, [], messages=[{"role": "user", "content": "Hello"}])
    assert 1 <= len(out) <= 16 and all(0 <= i < model.config.text_config.vocab_size for i in out)
    assert isinstance(processor.tokenizer.decode(out), str)
    assert am.hf_audio_prompt_ids(qwen2_audio_dir, [], messages=[{"role": "user", "content": "Hello"}]) == \
        processor.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)


def test_clips_are_deterministic_and_distinct():
    assert np.array_equal(am.test_clip(4), am.test_clip(4))
    assert am.test_clip(4).dtype == np.float32 and am.test_clip(4, 0.5, 8000).shape == (4000,)
    assert np.abs(am.test_clip(4) - am.test_clip(5)).mean() > 0.05
    assert np.abs(am.test_clip(4)).max() <= 1
