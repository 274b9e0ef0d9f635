"""A Qwen2-VL folder served by the real services: the tokenizer service builds its processor without
the video processor transformers cannot load here, and an image through TGI, OpenAI chat and the
TGI markdown form gives transformers' own tokens (M-RoPE positions in the engine's step)."""

from __future__ import annotations

import pytest
from text_generation import Client
from transformers import AutoTokenizer

from tests.integration.stack import post, running_stack
from tests.media_items import data_url, test_image
from tests.vlm_models import make_qwen2_vl
from tests.vlm_oracles import hf_generate, placeholder

NEW = 12
GREEDY = {"max_new_tokens": NEW, "do_sample": False}
IMG = test_image(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_dir):
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"), smol_dir)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    with running_stack(tmp_path_factory.mktemp("qwen2-vl-stack"), model_dir) as stack:
        yield stack


def test_an_image_equals_transformers_in_tgi_chat_and_markdown(stack, model_dir):
    want = hf_generate(model_dir, [IMG], text=f"What colour is {placeholder(model_dir)}?", max_new_tokens=NEW)
    items = [{"type": "text", "text": "What colour is "}, {"type": "image_url", "image_url": data_url(IMG)},
             {"type": "text", "text": "?"}]
    r = post(stack, "/generate", {"inputs": items, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want
    by_client = Client(stack.url, timeout=60).generate(f"What colour is ![]({data_url(IMG)})?", **GREEDY)
    assert [t.id for t in by_client.details.tokens] == want
    messages = [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"}, {"type": "image"}]}]
    chat_want = hf_generate(model_dir, [IMG], messages=messages, max_new_tokens=NEW)
    chat = post(stack, "/v1/chat/completions", {"model": stack.model, "max_tokens": NEW, "temperature": 0,
                                                "messages": [{"role": "user", "content": [
                                                    {"type": "text", "text": "What colour is it?"},
                                                    {"type": "image_url", "image_url": {"url": data_url(IMG)}}]}]})
    assert chat.status_code == 200, chat.text
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert chat.json()["choices"][0]["message"]["content"] == tokenizer.decode(chat_want, skip_special_tokens=True)
    assert chat.json()["usage"]["completion_tokens"] == len(chat_want)


def test_a_video_equals_transformers_and_an_image_model_refuses_nothing_it_takes(stack, model_dir):
    from tests.video_items import hf_generate_video, make_mp4, video_data_url

    clip = make_mp4(frames=8, seed=3)
    want = hf_generate_video(model_dir, [clip], text="What happens in <|vision_start|><|video_pad|><|vision_end|>?",
                             max_new_tokens=NEW)
    items = [{"type": "text", "text": "What happens in "}, {"type": "video_url", "video_url": video_data_url(clip)},
             {"type": "text", "text": "?"}]
    r = post(stack, "/generate", {"inputs": items, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want
    audio = post(stack, "/generate", {"inputs": [{"type": "text", "text": "Hi"}, {
        "type": "audio_url", "audio_url": "data:audio/wav;base64,UklGRgAAAABXQVZF"}], "parameters": GREEDY})
    assert audio.status_code == 422
    assert "audio inputs are not supported: the served model takes image, video inputs only" in audio.json()["error"]
