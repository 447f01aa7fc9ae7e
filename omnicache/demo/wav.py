"""16-bit PCM WAV files, written with the standard library's `wave` module.

For the sample trace's clips and the tests; files are read by `omnicache.media`,
as vLLM's server reads them.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["write_wav"]


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
