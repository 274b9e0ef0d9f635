"""A SmolVLM2 folder served by the real services: a video (as a data: URL in TGI ``inputs`` and in an
OpenAI chat) answers with transformers' own tokens for the frames, timestamps and image tokens
SmolVLM2's processor would produce; an image and a video in one request are refused as transformers
cannot run them together."""

from __future__ import annotations

import pytest

from services.tokenizer.media.multimodal import MediaProcessor
from tests.integration.stack import post, running_stack
from tests.media_items import data_url, test_image
from tests.smolvlm2_models import make_smolvlm2
from tests.video_items import make_mp4, video_data_url
from tests.vlm_oracles import hf_generate_prepared

NEW = 12
GREEDY = {"max_new_tokens": NEW, "do_sample": False}
CLIP = make_mp4(frames=16, fps=4, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_dir):
    return make_smolvlm2(tmp_path_factory.mktemp("smolvlm2"), smol_dir)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    with running_stack(tmp_path_factory.mktemp("smolvlm2-stack"), model_dir) as stack:
        yield stack


def transformers_tokens(model_dir, text: str) -> list[int]:
    """transformers' greedy generate on the prompt ``text`` with CLIP where its ``<video>`` is."""
    prepared = MediaProcessor.load(str(model_dir)).process(text, [("video", CLIP)])
    return hf_generate_prepared(model_dir, prepared.ids, prepared.media, NEW)


def test_a_video_equals_transformers_in_tgi_and_chat(stack, model_dir):
    items = [{"type": "video_url", "video_url": video_data_url(CLIP)}, {"type": "text", "text": "What happens?"}]
    r = post(stack, "/generate", {"inputs": items, "parameters": {**GREEDY, "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == transformers_tokens(model_dir, "<video>What happens?")
    chat = post(stack, "/v1/chat/completions", {"model": stack.model, "max_tokens": NEW, "temperature": 0,
                                                "messages": [{"role": "user", "content": [
                                                    {"type": "video_url", "video_url": {"url": video_data_url(CLIP)}},
                                                    {"type": "text", "text": "What happens?"}]}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > 4 * 4  # four frames of four image tokens, and their text
    both = post(stack, "/generate", {"inputs": [{"type": "image_url", "image_url": data_url(test_image(1))}] + items,
                                     "parameters": GREEDY})
    assert both.status_code == 422, both.text
