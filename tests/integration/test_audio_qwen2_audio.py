"""A Qwen2-Audio folder served by the real services: a clip as OpenAI ``input_audio`` (the ``openai``
client), as a TGI ``audio_url`` data: URL and as a local WAV under the media root gives transformers'
own tokens; an image on this audio model is a 422."""

from __future__ import annotations

import base64

import openai
import pytest
from transformers import AutoTokenizer

from tests.audio_models import audio_placeholder, hf_generate_audio, make_qwen2_audio, test_clip, wav_bytes
from tests.integration.stack import post, running_stack
from tests.media_items import PNG_URL

NEW = 12
GREEDY = {"max_new_tokens": NEW, "do_sample": False}
CLIP = test_clip(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_dir):
    return make_qwen2_audio(tmp_path_factory.mktemp("qwen2-audio"), smol_dir)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("audio-media")
    (root / "clip.wav").write_bytes(wav_bytes(CLIP))
    with running_stack(tmp_path_factory.mktemp("qwen2-audio-stack"), model_dir,
                       Switchboard={"mediaRoot": str(root)}) as stack:
        yield stack


def test_a_clip_equals_transformers_from_the_openai_client_tgi_and_a_path(stack, model_dir):
    data = base64.b64encode(wav_bytes(CLIP)).decode()
    want = hf_generate_audio(model_dir, [CLIP], text=f"Listen: {audio_placeholder(model_dir)}", max_new_tokens=NEW)
    for source in (f"data:audio/wav;base64,{data}", "clip.wav"):
        r = post(stack, "/generate", {"inputs": [{"type": "text", "text": "Listen: "},
                                                 {"type": "audio_url", "audio_url": source}],
                                      "parameters": {**GREEDY, "details": True}})
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == want, source
    question = [{"type": "text", "text": "What do you hear?"}]
    chat_want = hf_generate_audio(model_dir, [CLIP], messages=[{"role": "user", "content": question + [
        {"type": "audio"}]}], max_new_tokens=NEW)
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = api.chat.completions.create(model=stack.model, max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": question + [{"type": "input_audio",
                                                 "input_audio": {"data": data, "format": "wav"}}]}])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert out.choices[0].message.content == tokenizer.decode(chat_want, skip_special_tokens=True)
    image = post(stack, "/generate", {"inputs": [{"type": "text", "text": "Hi"},
                                                 {"type": "image_url", "image_url": PNG_URL}], "parameters": GREEDY})
    assert image.status_code == 422
    assert "image inputs are not supported: the served model takes audio inputs only" in image.json()["error"]
