"""LLaVA, Qwen2-VL and Qwen2.5-VL through the tokenizer's processing and the engine's step: outputs with images
equal transformers' ``generate`` token for token. Qwen2-VL's image tokens rotate by 3-D (temporal,
height, width) positions (M-RoPE) and the tokens after them by a shifted position, so its batches mix
rows of both kinds with text-only rows, in Mix chunks too."""

from __future__ import annotations

import pytest

from services.engine.engine import Engine
from services.tokenizer.media.multimodal import MediaProcessor
from tests.media_items import png_bytes, test_image
from tests.unit.engine_helpers import assert_pool_whole, limits, make_runner, media_request, run_until_idle
from tests.vlm_models import make_llava, make_qwen2_5_vl, make_qwen2_vl
from tests.vlm_oracles import hf_generate, hf_generate_prepared

NEW = 12
IMAGES = {"one": [test_image(1)], "other": [test_image(2)], "two": [test_image(1), test_image(3)], "text": []}
QUESTION = "What colour is it?"


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen2_5_vl"])
def model_dir(request, tmp_path_factory, smol_dir):
    make = {"llava": make_llava, "qwen2_vl": make_qwen2_vl, "qwen2_5_vl": make_qwen2_5_vl}[request.param]
    return make(tmp_path_factory.mktemp(request.param), smol_dir)


def messages(case: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}] + [{"type": "image"}] * len(IMAGES[case])}]


def engine_request(processor: MediaProcessor, case: str):
    return media_request(processor, case, messages(case)[0]["content"],
                         [("image", png_bytes(img)) for img in IMAGES[case]], NEW)


def test_images_equal_transformers_alone_together_and_in_chunks(model_dir):
    processor = MediaProcessor.load(str(model_dir))
    assert "image" in processor.modalities
    reference = {case: hf_generate(model_dir, IMAGES[case], messages=messages(case), max_new_tokens=NEW)
                 for case in IMAGES}
    assert reference["one"] != reference["other"]
    runner = make_runner(model_dir, 64)
    for case in ("one", "two"):
        engine = Engine(runner, limits(), {2})
        engine.add_request(engine_request(processor, case))
        assert run_until_idle(engine).tokens[case] == reference[case], case
    for limit_kw in ({}, {"mix": True, "prefill_chunk_size": 5}):
        engine = Engine(runner, limits(**limit_kw), {2})
        for case in IMAGES:
            engine.add_request(engine_request(processor, case))
        assert run_until_idle(engine, check_blocks=True).tokens == reference, limit_kw
        assert_pool_whole(engine)


# ---- Qwen2-VL videos ------------------------------------------------------------------------


def hf_from_request(model_dir, req) -> list[int]:
    return hf_generate_prepared(model_dir, req.prompt_ids, req.media, NEW)


def video_content(items: list[tuple[str, bytes]]) -> list[dict]:
    return [{"type": "text", "text": "What happens here?"}] + [{"type": kind} for kind, _ in items]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen2_vl_dir(request, tmp_path_factory, smol_dir):
    make = {"qwen2_vl": make_qwen2_vl, "qwen2_5_vl": make_qwen2_5_vl}[request.param]
    return make(tmp_path_factory.mktemp(f"{request.param}-video"), smol_dir)


def test_qwen2_vl_videos_equal_transformers_with_images_in_batches_and_chunks(qwen2_vl_dir):
    from tests.video_items import hf_generate_video, make_mp4

    processor = MediaProcessor.load(str(qwen2_vl_dir))
    assert processor.modalities == ["image", "video"]
    clips = {"v1": make_mp4(frames=8, seed=1), "v2": make_mp4(frames=6, seed=2)}
    cases = {"v1": [("video", clips["v1"])], "v2": [("video", clips["v2"])],
             "mixed": [("image", png_bytes(test_image(1))), ("video", clips["v1"])]}
    reqs = {rid: media_request(processor, rid, video_content(items), items, NEW) for rid, items in cases.items()}
    reference = {rid: hf_from_request(qwen2_vl_dir, req) for rid, req in reqs.items()}
    for rid in ("v1", "v2"):  # tests.video_items' oracle builds transformers' inputs on its own
        content = video_content(cases[rid])
        assert hf_generate_video(qwen2_vl_dir, [clips[rid]], messages=[{"role": "user", "content": content}],
                                 max_new_tokens=NEW) == reference[rid]
    assert reference["v1"] != reference["v2"]
    runner = make_runner(qwen2_vl_dir, 64)
    for limit_kw in ({}, {"mix": True, "prefill_chunk_size": 7}):
        engine = Engine(runner, limits(**limit_kw), {2})
        for rid, items in cases.items():
            engine.add_request(media_request(processor, rid, video_content(items), items, NEW))
        engine.add_request(engine_request(MediaProcessor.load(str(qwen2_vl_dir)), "text"))
        out = run_until_idle(engine, check_blocks=True)
        text_ref = hf_generate(qwen2_vl_dir, [], messages=messages("text"), max_new_tokens=NEW)
        assert out.tokens == {**reference, "text": text_ref}, limit_kw


# ---- SmolVLM2 videos ------------------------------------------------------------------------


def test_smolvlm2_videos_and_images_equal_transformers_in_batches_and_chunks(tmp_path_factory, smol_dir):
    from tests.smolvlm2_models import make_smolvlm2
    from tests.video_items import make_mp4

    model_dir = make_smolvlm2(tmp_path_factory.mktemp("smolvlm2"), smol_dir)
    processor = MediaProcessor.load(str(model_dir))
    assert processor.modalities == ["image", "video"]
    cases = {"v1": [("video", make_mp4(frames=16, fps=4, seed=0))], "v2": [("video", make_mp4(frames=8, fps=4, seed=5))],
             "img": [("image", png_bytes(test_image(1)))]}
    reqs = {rid: media_request(processor, rid, video_content(items), items, NEW) for rid, items in cases.items()}
    reference = {rid: hf_from_request(model_dir, req) for rid, req in reqs.items()}
    assert reference["v1"] != reference["v2"]
    runner = make_runner(model_dir, 64)
    assert runner.modalities == ["image", "video"]
    for limit_kw in ({}, {"mix": True, "prefill_chunk_size": 11}):
        engine = Engine(runner, limits(**limit_kw), {2})
        for rid, items in cases.items():
            engine.add_request(media_request(processor, rid, video_content(items), items, NEW))
        assert run_until_idle(engine, check_blocks=True).tokens == reference, limit_kw


def test_a_folder_naming_its_processor_in_preprocessor_config_loads(qwen2_vl_dir, tmp_path):
    """As Qwen2-VL's folders on the Hub: no processor_config.json, the class in preprocessor_config.json."""
    import json
    import shutil

    folder = tmp_path / "hub-layout"
    shutil.copytree(qwen2_vl_dir, folder)
    processor = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").unlink()
    pre = json.loads((folder / "preprocessor_config.json").read_text()) if (folder / "preprocessor_config.json").exists() \
        else dict(processor.get("image_processor", {}))
    pre["processor_class"] = processor["processor_class"]
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    loaded = MediaProcessor.load(str(folder))
    assert loaded.modalities == ["image", "video"]
    assert type(loaded.processor).__name__ == processor["processor_class"]
