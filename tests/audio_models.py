"""A tiny Qwen2-Audio model folder of the real transformers architecture, and transformers' own outputs.

Like ``tests/vlm_models.py`` for images: the engine's audio path must match transformers token for
token, so the tests need a real folder (config, weights, ``Qwen2AudioProcessor``, chat template) that
loads offline with ``AutoProcessor`` and ``AutoModelForMultimodalLM`` (``AutoModelForImageTextToText``
does NOT map ``qwen2_audio``; ``AutoModelForMultimodalLM``'s mapping is the image-text-to-text one plus
the audio-text models, so it also loads every vision folder of tests/vlm_models.py), yet builds in
seconds on a CPU:

- ``make_qwen2_audio``: a fully random tiny Qwen2-Audio (Whisper-style encoder, linear projector,
  Qwen2 decoder), with SmolLM2's tokenizer plus the audio tokens.

The feature extractor is Qwen2-Audio's real one (WhisperFeatureExtractor, 128 mel bins, 30 s windows
of 3000 frames): the encoder only accepts exactly ``2 * max_source_positions`` frames, so the window
is not shrunk. A clip of S samples gives ``num_audio_tokens(S)`` audio tokens (25 a second, 750 at
most), expanded by the processor itself.

``hf_generate_audio`` / ``hf_audio_prompt_ids`` are the oracle: the processor and greedy ``generate``.
``test_clip`` and ``wav_bytes`` / ``flac_bytes`` make deterministic clips and their encoded files.
"""

from __future__ import annotations

import functools
import io
import json
import wave
from pathlib import Path

import numpy as np
import torch

from tests.vlm_models import SMOL_DIR, chat_template, extended_tokenizer, save_generation_config

RATE = 16000  # Qwen2-Audio's (Whisper's) sampling rate
AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
AUDIO_ITEM = "<|audio_bos|><|AUDIO|><|audio_eos|>"  # an audio clip's place in a prompt, before expansion

# SmolLM2's ChatML template, list-aware (``tests.vlm_models``); an audio item is the markers around <|AUDIO|>.
AUDIO_CHAT_TEMPLATE = chat_template(audio=AUDIO_ITEM)


def num_audio_tokens(samples: int, hop_length: int = 160) -> int:
    """The audio tokens a clip of ``samples`` 16 kHz samples becomes: Qwen2AudioProcessor's formula on
    the feature mask's length (ceil(samples / 160) frames, at most 3000: the feature extractor cuts a
    clip at 30 s); conv2 halves the frames, the average pool halves them again."""
    frames = min(-(-samples // hop_length), 3000)
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


# ---------------------------------------------------------------------------------------------- folder


def qwen2_audio_processor(tokenizer):
    """A Qwen2AudioProcessor: Qwen2-Audio's WhisperFeatureExtractor (128 mel bins, 16 kHz, 30 s) and
    ``tokenizer`` (which must know the audio tokens), with the list-aware ChatML template."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE, hop_length=160, chunk_length=30,
                                        n_fft=400, return_attention_mask=True)
    return Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=AUDIO_CHAT_TEMPLATE)


def make_qwen2_audio(out: Path, base: Path = SMOL_DIR, seed: int = 0) -> Path:
    """Save a tiny random Qwen2AudioForConditionalGeneration into ``out``, with SmolLM2's tokenizer from
    ``base`` plus the audio tokens: Qwen2 decoder hidden 64, 2 layers, 4 heads, 2 KV heads (head_dim 16,
    plain RoPE), its own LM head (untied: Qwen2AudioForConditionalGeneration declares no tied weights,
and Qwen2-Audio-7B's head is untied); Whisper-style encoder d_model 64, 2 layers, 4 heads, 128 mel bins, 1500
    positions (Qwen2-Audio's 30 s window); a linear projector 64 -> 64.

    Weights are drawn with std 0.1, not the default 0.02: at 0.02 the tied head's argmax is the last
    input token (the residual stream is almost only its embedding), whatever the audio, and a test
could not tell clips apart."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    out = Path(out)
    tokenizer = extended_tokenizer(base, AUDIO_TOKENS)
    tokenizer.chat_template = AUDIO_CHAT_TEMPLATE
    text = {"model_type": "qwen2", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": False, "initializer_range": 0.1}
    audio = {"model_type": "qwen2_audio_encoder", "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4,
             "encoder_ffn_dim": 128, "num_mel_bins": 128, "max_source_positions": 1500, "initializer_range": 0.1}
    config = Qwen2AudioConfig(text_config=text, audio_config=audio,
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
                              tie_word_embeddings=False, initializer_range=0.1)
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    qwen2_audio_processor(tokenizer).save_pretrained(out)
    save_generation_config(base, out)
    check_loads(out, model.state_dict())
    return out


def check_loads(out: Path, state: dict) -> None:
    """The saved folder reloads through the Auto classes with exactly the weights in ``state``."""
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Qwen2AudioProcessor", type(processor)
    model = AutoModelForMultimodalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2AudioForConditionalGeneration", type(model)
    loaded = model.state_dict()
    assert loaded.keys() == state.keys(), set(loaded) ^ set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state), "weights differ after reload"


# ---------------------------------------------------------------------------------------------- oracle


@functools.lru_cache(maxsize=4)
def load(model_dir: Path):
    """(processor, model) for ``model_dir``, float32, eval mode; cached, as loading dominates a test."""
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForMultimodalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return processor, model


def audio_placeholder(model_dir: Path) -> str:
    """What goes where an audio clip is in a raw text prompt: the processor's audio token inside the
    audio markers, as the chat template writes an audio item (the processor expands <|AUDIO|>)."""
    processor, _ = load(Path(model_dir))
    return processor.audio_bos_token + processor.audio_token + processor.audio_eos_token


def hf_audio_inputs(model_dir: Path, audios: list[np.ndarray], *, text: str | None = None,
                    messages: list | None = None, return_tensors: str = "pt"):
    """The processor's outputs, as transformers documents: a chat through ``apply_chat_template``, or raw
    ``text`` with ``audio_placeholder(model_dir)`` where clips go; clips are 16 kHz float mono."""
    processor, _ = load(Path(model_dir))
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text= or messages=")
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not audios:
        return processor(text=text, return_tensors=return_tensors)
    return processor(text=text, audio=list(audios), sampling_rate=RATE, return_tensors=return_tensors)


def hf_audio_prompt_ids(model_dir: Path, audios: list[np.ndarray], *, text: str | None = None,
                        messages: list | None = None) -> list[int]:
    """The processor's input_ids: the prompt with each <|AUDIO|> expanded to the clip's audio tokens."""
    return hf_audio_inputs(model_dir, audios, text=text, messages=messages)["input_ids"][0].tolist()


def hf_generate_audio(model_dir: Path, audios: list[np.ndarray], *, text: str | None = None,
                      messages: list | None = None, max_new_tokens: int = 16) -> list[int]:
    """transformers' greedy generation for the prompt and the clips: only the new token ids."""
    _, model = load(Path(model_dir))
    inputs = hf_audio_inputs(model_dir, audios, text=text, messages=messages)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_audio_features(model_dir: Path, audios: list[np.ndarray]) -> torch.Tensor:
    """What transformers' forward places at the <|AUDIO|> tokens for these clips (in prompt order, one
    row per audio token), captured at the language model's input: the oracle for an engine's encoder."""
    processor, model = load(Path(model_dir))
    inputs = hf_audio_inputs(model_dir, audios, text=audio_placeholder(model_dir) * len(audios))
    captured = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _, args, kwargs: captured.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        hook.remove()
    return captured["embeds"][inputs["input_ids"] == processor.audio_token_id]


def audio_features_by_hand(model, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
    """The same features computed as Qwen2AudioModel.forward does (there is no get_audio_features):
    the encoder over the full 3000-frame window with a bidirectional mask hiding the conv2 outputs past
    each clip's length, the projector, then each clip's first ``output_lengths`` rows, concatenated."""
    from transformers.masking_utils import create_bidirectional_mask

    tower = model.model.audio_tower
    conv_lengths, output_lengths = tower._get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
    batch, _, frames = input_features.shape
    positions = (frames - 2) // 2 + 1  # 1500: conv2's outputs
    valid = (torch.arange(positions)[None, :] < conv_lengths[:, None]).long()
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(batch, positions, 1),
                                     attention_mask=valid)
    with torch.inference_mode():
        hidden = tower(input_features, attention_mask=mask).last_hidden_state  # (clips, 750, d_model)
        projected = model.model.multi_modal_projector(hidden)  # (clips, 750, text hidden)
    keep = torch.arange(projected.shape[1])[None, :] < output_lengths[:, None]
    return projected[keep]


# ---------------------------------------------------------------------------------------------- clips


def test_clip(seed: int, seconds: float = 1.0, rate: int = RATE) -> np.ndarray:
    """A deterministic float32 mono clip in [-1, 1]: three seeded tones (50 Hz to 4 kHz, each with a
    seeded amplitude envelope) plus seeded noise, so two seeds give clearly different spectrograms."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate), dtype=np.float64) / rate
    signal = np.zeros_like(t)
    for _ in range(3):
        freq, phase = rng.uniform(50, 4000), rng.uniform(0, 2 * np.pi)
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.5, 4) * t + rng.uniform(0, 2 * np.pi))
        signal += rng.uniform(0.1, 0.3) * envelope * np.sin(2 * np.pi * freq * t + phase)
    signal += rng.normal(0, 0.02, t.shape)
    return np.clip(signal, -1, 1).astype(np.float32)


test_clip.__test__ = False  # not a pytest test, despite the name


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    """``samples`` (float in [-1, 1]; shape (n,) mono or (n, channels)) as a 16-bit PCM WAV file."""
    samples = np.asarray(samples, dtype=np.float64)
    frames = samples if samples.ndim == 2 else samples[:, None]
    pcm = np.clip(np.round(frames * 32767), -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(frames.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def flac_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    """``samples`` as a 16-bit FLAC file (needs ``soundfile``)."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.asarray(samples, dtype=np.float32), rate, format="FLAC", subtype="PCM_16")
    return buffer.getvalue()


def model_type(model_dir: Path) -> str:
    """``config.model_type`` of the folder (qwen2_audio)."""
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def main(argv=None) -> None:
    """python -m tests.audio_models DIR [--base PATH] [--seed N]: a demo Qwen2-Audio folder."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", type=Path, default=SMOL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_qwen2_audio(args.out, args.base, seed=args.seed))


if __name__ == "__main__":
    main()
