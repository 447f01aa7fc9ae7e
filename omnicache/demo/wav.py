"""PCM WAV files, read and written with the standard library's `wave` module.

The demo's traces name audio clips as WAV paths (`load_trace`), and
``omnicache hash`` digests a ``.wav`` file's samples, not its bytes.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["read_wav", "write_wav"]


def read_wav(path: str | Path) -> tuple[npt.NDArray[np.float32], int]:
    """Reads a PCM WAV file with the standard library.

    Returns:
        ``(waveform, sample_rate)``: float32 samples in [-1, 1], shaped
        ``(samples,)`` for mono and ``(channels, samples)`` otherwise.

    Raises:
        ValueError: Not a PCM WAV file, an unsupported sample width, or no samples.
        OSError: The file cannot be read.
    """
    try:
        with wave.open(str(path), "rb") as wav:
            num_channels = wav.getnchannels()
            width = wav.getsampwidth()
            sample_rate = wav.getframerate()
            raw = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"expected a PCM WAV file, found an unreadable one ({exc})") from None
    if width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        samples = ints.astype(np.float32) / float(1 << 23)
    elif width == 4:
        samples = (np.frombuffer(raw, "<i4").astype(np.float64) / 2.0**31).astype(np.float32)
    else:
        raise ValueError(f"expected 1, 2, 3 or 4 bytes per sample, found {width}")
    num_frames = samples.size // num_channels
    if num_frames == 0:
        raise ValueError("expected at least one sample, found none")
    frames = samples[: num_frames * num_channels].reshape(num_frames, num_channels)
    waveform = frames[:, 0].copy() if num_channels == 1 else np.ascontiguousarray(frames.T)
    return waveform, sample_rate


def write_wav(path: str | Path, waveform: npt.ArrayLike, sample_rate: int) -> None:
    """Writes float samples in [-1, 1] as a 16-bit PCM WAV file.

    Args:
        path: Output file.
        waveform: ``(samples,)`` or ``(channels, samples)``; values are clipped.
        sample_rate: Samples per second.
    """
    data = np.asarray(waveform, dtype=np.float64)
    if data.ndim == 1:
        data = data[None, :]
    if data.ndim != 2 or data.shape[1] == 0:
        raise ValueError(
            f"waveform: expected (samples,) or (channels, samples), found shape {data.shape}"
        )
    ints = np.round(np.clip(data, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(data.shape[0])
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(np.ascontiguousarray(ints.T).tobytes())
