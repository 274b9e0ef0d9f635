"""A request's audio clip decoded into what an audio model's processor takes: float32 mono samples at its rate.

Audio processors (Qwen2-Audio's WhisperFeatureExtractor) take raw samples at one fixed rate (16 kHz)
and do not resample, so the tokenizer service decodes every clip, averages its channels to mono and
resamples it to that rate before the processor runs. The media policy admits WAV, FLAC and MP3:

- PCM WAV (8-, 16-, 24- and 32-bit integer samples) is read with the standard library's ``wave``, so
  the common case needs no native library and is exact;
- everything else (FLAC, MP3, float WAV, WAVE_FORMAT_EXTENSIBLE, OGG) goes through ``soundfile``
  (libsndfile, bundled in its wheels).

Integers are scaled as libsndfile scales them (divided by 2^(bits-1)), so one WAV read either way
gives the same floats. Compressed audio can expand enormously (20 MB of FLAC silence is hours), so the
duration and the decoded size are checked from the header, and reads stop at the limit, before the
samples are materialised.
"""

from __future__ import annotations

import io
import math
import wave

import numpy as np

from shared.errors import validation

MAX_SECONDS = 300  # Qwen2-Audio hears the first 30 s anyway; longer clips are refused, not cut silently
MAX_CHANNELS = 8
MIN_RATE, MAX_RATE = 1_000, 384_000
MAX_VALUES = 64 * 2**20  # decoded samples x channels: 256 MiB as float32, whatever the duration says

# The resampling filter: a Kaiser-windowed sinc of 16 zero crossings each side (resampy's and
# librosa's "kaiser_fast": ~80 dB stop band), its cut-off at the lower of the two Nyquist frequencies.
ZERO_CROSSINGS = 16
KAISER_BETA = 8.555
BLOCK = 1 << 16  # output samples resampled at a time (bounds the gather's memory)


def decode_audio(data: bytes, index: int, rate: int) -> np.ndarray:
    """Float32 mono samples at ``rate`` Hz, in [-1, 1]; 422 for bytes that are no audio, or too long.

    A clip already at ``rate`` is returned as decoded (mono, unresampled), bit for bit."""
    samples, source_rate = _decode(data, index)
    samples = to_mono(samples)
    if len(samples) == 0:
        raise _undecodable(index, "it has no samples")
    return samples if source_rate == rate else resample(samples, source_rate, rate)


def _undecodable(index: int, why: object):
    return validation(f"media item {index}: the audio cannot be decoded: {why}")


def _decode(data: bytes, index: int) -> tuple[np.ndarray, int]:
    """(frames x channels float32 samples, their rate): PCM WAV by ``wave``, the rest by ``soundfile``."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        try:
            return _decode_wav(data, index)
        except (wave.Error, EOFError):  # float or extensible WAV: not the stdlib's; libsndfile reads it
            pass
    return _decode_soundfile(data, index)


def _check_header(index: int, frames: int, channels: int, rate: int) -> None:
    """Refuse, before decoding, a clip whose header promises absurd audio (a bomb, or a broken file)."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise _undecodable(index, f"its sample rate {rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise _undecodable(index, f"it has {channels} channels (at most {MAX_CHANNELS})")
    if frames > MAX_SECONDS * rate:
        raise validation(f"media item {index}: the audio is {frames / rate:.1f} s long; "
                         f"the limit is {MAX_SECONDS} s")
    if frames * channels > MAX_VALUES:
        raise validation(f"media item {index}: the audio has {frames * channels} samples over all channels; "
                         f"the limit is {MAX_VALUES}")


def _decode_wav(data: bytes, index: int) -> tuple[np.ndarray, int]:
    """An integer PCM WAV through the standard library (it raises wave.Error for other encodings)."""
    with wave.open(io.BytesIO(data), "rb") as clip:
        channels, width, rate, frames = clip.getnchannels(), clip.getsampwidth(), clip.getframerate(), clip.getnframes()
        _check_header(index, frames, channels, rate)
        raw = clip.readframes(frames)
    if len(raw) != frames * width * channels:  # cut off in transit: refused rather than half heard
        raise _undecodable(index, f"the file is truncated ({len(raw) // (width * channels)} of {frames} frames)")
    return pcm_to_float(raw, width, index).reshape(-1, channels), rate


def pcm_to_float(raw: bytes, width: int, index: int) -> np.ndarray:
    """Little-endian PCM samples of ``width`` bytes as float32 in [-1, 1), scaled by 2^(bits-1) as
    libsndfile does (8-bit WAV is unsigned, centred on 128; 24-bit is sign-extended through int32)."""
    if width == 1:
        return ((np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128).astype(np.float32)
    if width == 2:
        return (np.frombuffer(raw, "<i2").astype(np.float32) / 2**15).astype(np.float32)
    if width == 3:
        padded = np.zeros((len(raw) // 3, 4), np.uint8)
        padded[:, 1:] = np.frombuffer(raw, np.uint8).reshape(-1, 3)  # the 24 bits in the top of an int32
        return (padded.view("<i4")[:, 0] / 2**31).astype(np.float32)
    if width == 4:
        return (np.frombuffer(raw, "<i4") / 2**31).astype(np.float32)
    raise _undecodable(index, f"{8 * width}-bit PCM is not supported")


def _decode_soundfile(data: bytes, index: int) -> tuple[np.ndarray, int]:
    """FLAC, MP3, OGG and non-integer WAV through libsndfile, reading no more frames than the limits allow."""
    try:
        import soundfile
    except ImportError:  # a deployment without it still takes PCM WAV
        raise _undecodable(index, "not a PCM WAV file, and soundfile is not installed") from None
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as clip:
            channels, rate = clip.channels, clip.samplerate
            _check_header(index, max(clip.frames, 0), channels, rate)
            limit = min(MAX_SECONDS * rate, MAX_VALUES // channels)
            samples = clip.read(frames=limit + 1, dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as exc:  # its str() names the BytesIO object; the reason is enough
        raise _undecodable(index, exc.error_string) from None
    except (RuntimeError, TypeError, ValueError) as exc:  # soundfile's other refusals of bad data
        raise _undecodable(index, exc) from None
    _check_header(index, len(samples), channels, rate)  # a header that understated the length
    return samples, rate


def to_mono(samples: np.ndarray) -> np.ndarray:
    """The channels' mean (float32); a mono clip's one channel as it is."""
    if samples.shape[1] == 1:
        return np.ascontiguousarray(samples[:, 0], dtype=np.float32)
    return samples.mean(axis=1, dtype=np.float64).astype(np.float32)


def resample(samples: np.ndarray, source: int, target: int) -> np.ndarray:
    """``samples`` at ``source`` Hz resampled to ``target`` Hz by band-limited (windowed-sinc) interpolation.

    Deterministic, numpy only, and exact in its timing: output sample m lies at input position
    m * source / target, computed in integers (the ratio reduced to up/down, ``up`` filter phases), so
    no drift accumulates over a long clip. Each output is the sum of 2 * 16 / cutoff neighbouring
    inputs weighted by a Kaiser-windowed sinc whose cut-off is the lower Nyquist frequency (no
    aliasing when downsampling); each phase's weights are normalised to sum to 1, so a constant stays
    constant. Samples beyond the ends count as zeros. The output has ceil(n * target / source) samples,
    as scipy's resample_poly gives.
    """
    g = math.gcd(source, target)
    up, down = target // g, source // g
    cutoff = min(1.0, target / source)  # in units of the input's Nyquist frequency
    half = math.ceil(ZERO_CROSSINGS / cutoff)  # taps each side of the output position
    offsets = np.arange(-half + 1, half + 1)  # input samples floor(t) + offsets feed output t
    phases = np.arange(up) / up  # the fractional input position of each output phase
    distance = offsets[None, :] - phases[:, None]  # (up, taps), in input samples
    bank = cutoff * np.sinc(cutoff * distance) * _kaiser_window(distance, half)
    bank /= bank.sum(axis=1, keepdims=True)
    count = -(-len(samples) * up // down)
    padded = np.concatenate([np.zeros(half), samples.astype(np.float64), np.zeros(half + 1)])
    out = np.empty(count, np.float32)
    for start in range(0, count, BLOCK):
        m = np.arange(start, min(start + BLOCK, count))
        base, phase = np.divmod(m * down, up)  # integer part and phase of m * source / target
        taps = padded[(base + half)[:, None] + offsets[None, :]]
        out[start:start + len(m)] = np.einsum("ij,ij->i", taps, bank[phase])
    return out


def _kaiser_window(distance: np.ndarray, half: int) -> np.ndarray:
    """The Kaiser window (beta ``KAISER_BETA``) at ``distance`` (|distance| <= ``half``) from the centre."""
    x = np.clip(distance / half, -1.0, 1.0)
    return np.i0(KAISER_BETA * np.sqrt(1.0 - x * x)) / np.i0(KAISER_BETA)

