"""services/tokenizer/media/audio.py: WAV (stdlib) and FLAC/MP3 (soundfile) decode to float32 mono at the
model's rate; other rates are resampled; bad or absurd audio is a 422 naming the media item."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from services.tokenizer.media import audio
from services.tokenizer.media.audio import decode_audio
from shared.errors import ErrorKind, SwitchboardError
from tests.audio_models import flac_bytes, test_clip, wav_bytes


def pcm_wav(pcm: np.ndarray, rate: int, width: int, channels: int = 1) -> bytes:
    """Little-endian PCM samples, already encoded ``width`` bytes each, as a WAV file."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def int16_of(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as clip:
        return np.frombuffer(clip.readframes(clip.getnframes()), "<i2")


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * freq * np.arange(round(seconds * rate)) / rate)


def test_wav_16bit_at_the_model_rate_round_trips_exactly():
    data = wav_bytes(test_clip(0), 16000)
    samples = decode_audio(data, 0, 16000)
    assert samples.dtype == np.float32 and samples.shape == (16000,)
    assert np.array_equal(samples * 32768, int16_of(data).astype(np.float32))  # no resampling, no rounding
    assert np.abs(samples - test_clip(0)).max() < 2 / 32768


def test_stdlib_wav_equals_libsndfile_and_flac_equals_wav():
    soundfile = pytest.importorskip("soundfile")
    clip = test_clip(1)
    data = wav_bytes(clip, 16000)
    read, _ = soundfile.read(io.BytesIO(data), dtype="float32")
    assert np.array_equal(decode_audio(data, 0, 16000), read)  # same scaling, either decoder
    flac = io.BytesIO()
    soundfile.write(flac, read, 16000, format="FLAC", subtype="PCM_16")
    assert np.array_equal(decode_audio(flac.getvalue(), 0, 16000), read)  # FLAC is lossless
    assert np.abs(decode_audio(flac_bytes(clip), 0, 16000) - clip).max() < 2 / 32768


def test_mp3_decodes_to_the_tone():
    soundfile = pytest.importorskip("soundfile")
    buffer = io.BytesIO()
    soundfile.write(buffer, tone(440, 1.0, 16000).astype(np.float32), 16000, format="MP3")
    samples = decode_audio(buffer.getvalue(), 0, 16000)
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16000 / len(samples) - 440) < 3


def test_stereo_is_averaged_to_mono():
    left, right = tone(300, 0.5, 16000), tone(1000, 0.5, 16000, 0.25)
    data = wav_bytes(np.stack([left, right], axis=1), 16000)
    pcm = int16_of(data).reshape(-1, 2).astype(np.float64) / 32768
    samples = decode_audio(data, 0, 16000)
    assert samples.shape == (8000,)
    assert np.allclose(samples, pcm.mean(axis=1), atol=1e-7)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_8_24_and_32_bit_pcm(width):
    signal = tone(500, 0.25, 16000, 0.9)
    if width == 1:
        pcm = np.round(signal * 127 + 128).astype(np.uint8)
        expected = (pcm.astype(np.float64) - 128) / 128
    elif width == 3:
        ints = np.round(signal * (2**23 - 1)).astype("<i4")
        pcm = ints.view(np.uint8).reshape(-1, 4)[:, :3].copy()
        expected = ints / 2**23
    else:
        ints = np.round(signal * (2**31 - 1)).astype("<i4")
        pcm, expected = ints, ints / 2**31
    samples = decode_audio(pcm_wav(pcm, 16000, width), 0, 16000)
    assert samples.shape == signal.shape and np.allclose(samples, expected, atol=1e-7)
    assert np.abs(samples - signal).max() < max(1.5 / 2 ** (8 * width - 1), 2**-24)  # float32 holds 24 bits


def test_8khz_is_resampled_to_16khz_with_the_same_tone():
    samples = decode_audio(wav_bytes(tone(440, 1.0, 8000), 8000), 0, 16000)
    assert samples.dtype == np.float32 and samples.shape == (16000,)
    inner = slice(400, -400)  # the ends see the zeros beyond the clip
    assert np.abs(samples - tone(440, 1.0, 16000))[inner].max() < 1e-3
    assert abs(np.argmax(np.abs(np.fft.rfft(samples))) - 440) <= 1  # 1 s: bin k is k Hz


def test_44khz_downsampling_removes_what_16khz_cannot_hold():
    source = tone(440, 1.0, 44100) + tone(12000, 1.0, 44100, 0.3)  # 12 kHz is above 16 kHz's Nyquist
    samples = audio.resample(source.astype(np.float32), 44100, 16000)
    assert samples.shape == (16000,)
    assert np.abs(samples - tone(440, 1.0, 16000))[400:-400].max() < 1e-3  # no alias of 12 kHz at 4 kHz


def test_resampling_length_and_determinism():
    clip = test_clip(2, 0.3, 22050)
    first = audio.resample(clip, 22050, 16000)
    assert len(first) == -(-len(clip) * 16000 // 22050)
    assert np.array_equal(first, audio.resample(clip, 22050, 16000))
    assert np.array_equal(audio.resample(np.ones(4000, np.float32), 8000, 16000)[100:-100], np.ones(7800))


def assert_refused(data: bytes, *words: str) -> None:
    with pytest.raises(SwitchboardError) as caught:
        decode_audio(data, 3, 16000)
    assert caught.value.kind is ErrorKind.VALIDATION
    assert caught.value.message.startswith("media item 3: "), caught.value.message
    for word in words:
        assert word in caught.value.message, caught.value.message


@pytest.mark.parametrize("data", [b"", b"this is not audio at all" * 10, b"RIFF\x10\x00\x00\x00WAVEfmt junk",
                                  bytes(range(256)) * 8])
def test_garbage_is_a_validation_error(data):
    assert_refused(data, "the audio cannot be decoded")


def test_truncated_and_empty_wav_are_refused():
    data = wav_bytes(test_clip(0), 16000)
    assert_refused(data[:1000], "the audio cannot be decoded", "truncated")
    assert_refused(wav_bytes(np.zeros(0), 16000), "the audio cannot be decoded", "no samples")


def test_a_clip_over_the_limit_is_refused_before_decoding():
    header = pcm_wav(np.zeros(1, "<i2"), 8000, 2)
    frames = (audio.MAX_SECONDS + 1) * 8000
    # A header that claims MAX_SECONDS + 1 s of audio over a tiny file: refused from the header alone.
    lying = header[:4] + (36 + 2 * frames).to_bytes(4, "little") + header[8:40] + (2 * frames).to_bytes(4, "little")
    assert_refused(lying + header[44:], f"the limit is {audio.MAX_SECONDS} s")


def test_long_flac_is_refused():
    pytest.importorskip("soundfile")
    data = flac_bytes(np.zeros((audio.MAX_SECONDS + 1) * 1000, np.float32), 1000)  # compresses to almost nothing
    assert len(data) < 200_000
    assert_refused(data, f"the limit is {audio.MAX_SECONDS} s")
