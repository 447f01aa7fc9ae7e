"""Media files for the loader's tests, written on demand: every mode, orientation and format
the rules treat apart, and files that are broken in each way a loader must refuse.

Pictures are seeded noise (`noise`), so no two cases share pixels unless a case says so.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image

EXIF_ORIENTATION = 0x0112


def noise(seed: int, size: tuple[int, int] = (48, 32), mode: str = "RGB") -> Image.Image:
    """Seeded random pixels: ``size`` is (width, height)."""
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    shape = (size[1], size[0], bands) if bands > 1 else (size[1], size[0])
    return Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8), mode)


def save(image: Image.Image, path: Path, **params: object) -> Path:
    image.save(path, **params)  # type: ignore[arg-type]
    return path


def jpeg_with_orientation(path: Path, image: Image.Image, orientation: int) -> Path:
    """A JPEG whose EXIF says how to turn it (1: as stored, 6: 90 degrees clockwise, ...)."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return save(image, path, format="JPEG", quality=95, exif=exif.tobytes())


def palette_image(seed: int, size: tuple[int, int] = (48, 32)) -> Image.Image:
    return noise(seed, size).quantize(colors=16)


def rgb_with_trns(path: Path, seed: int) -> Path:
    """An RGB PNG with a tRNS colour that its first pixel has (8 colours: many pixels share it)."""
    image = palette_image(seed).quantize(colors=8).convert("RGB")
    pixel = image.getpixel((0, 0))
    assert isinstance(pixel, tuple)
    return save(image, path, transparency=pixel)


def bomb_png(path: Path, side: int = 30_000) -> Path:
    """A 1-bit ``side`` x ``side`` PNG of zeros: about 109 KB on disk, 900 M pixels decoded."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte, then packed bits
    compressor = zlib.compressobj(9)
    chunks = [compressor.compress(row) for _ in range(side)]
    idat = b"".join(chunks) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )
    return path


def truncated(path: Path, source: Path, keep: float = 0.5) -> Path:
    """The first ``keep`` of ``source``'s bytes."""
    data = source.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


# -- audio ---------------------------------------------------------------------------------


def tone(num_frames: int, num_channels: int = 1, seed: int = 0) -> np.ndarray:
    """``(frames, channels)`` float64 samples in [-0.9, 0.9]: a tone plus seeded noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_frames)[:, None] / 50.0
    phases = np.arange(num_channels)[None, :]
    return 0.6 * np.sin(t + phases) + 0.3 * rng.uniform(-1, 1, (num_frames, num_channels))


def write_audio(
    path: Path,
    samples: np.ndarray,
    sample_rate: int,
    subtype: str,
    fmt: str = "WAV",
) -> Path:
    soundfile.write(path, samples, sample_rate, subtype=subtype, format=fmt)
    return path


def wav_declaring(path: Path, num_frames: int, declared_frames: int, sample_rate: int) -> Path:
    """A 16-bit mono WAV holding ``num_frames`` whose header declares ``declared_frames``.

    ``declared_frames`` of -1 writes 0xFFFFFFFF: a streaming writer's "length unknown".
    """
    data = (np.arange(num_frames, dtype="<i2") * 300).tobytes()
    declared = 0xFFFFFFFF if declared_frames == -1 else 2 * declared_frames
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", declared) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(body) - 4) + body)
    return path


def long_wav(path: Path, seconds: int, sample_rate: int = 1_000) -> Path:
    """An 8-bit mono WAV of ``seconds`` (small on disk: one byte a frame)."""
    samples = np.zeros(seconds * sample_rate)
    return write_audio(path, samples, sample_rate, "PCM_U8")


# name -> writer(folder) -> path: images that every rule set opens.
ImageCase = Callable[[Path], Path]
IMAGE_CASES: dict[str, ImageCase] = {
    "rgb.png": lambda d: save(noise(11), d / "rgb.png"),
    "rgba.png": lambda d: save(noise(12, mode="RGBA"), d / "rgba.png"),
    "la.png": lambda d: save(noise(13, mode="LA"), d / "la.png"),
    "l.png": lambda d: save(noise(14, mode="L"), d / "l.png"),
    "l-trns.png": lambda d: save(noise(15, mode="L"), d / "l-trns.png", transparency=90),
    "1.png": lambda d: save(noise(16, mode="L").convert("1"), d / "1.png"),
    "i16.png": lambda d: save(
        Image.fromarray(np.random.default_rng(17).integers(0, 65536, (32, 48), dtype="<u2")),
        d / "i16.png",
    ),
    "palette.png": lambda d: save(palette_image(18), d / "palette.png"),
    "palette-trns.png": lambda d: save(palette_image(19), d / "palette-trns.png", transparency=3),
    "rgb-trns.png": lambda d: rgb_with_trns(d / "rgb-trns.png", 20),
    "cmyk.jpg": lambda d: save(noise(21).convert("CMYK"), d / "cmyk.jpg", quality=95),
    "grey.jpg": lambda d: save(noise(22, mode="L"), d / "grey.jpg", quality=95),
    **{
        f"exif-{k}.jpg": (lambda d, k=k: jpeg_with_orientation(d / f"exif-{k}.jpg", noise(30), k))
        for k in range(1, 9)
    },
    "exif-bogus.jpg": lambda d: jpeg_with_orientation(d / "exif-bogus.jpg", noise(31), 9),
    "animated.gif": lambda d: save(
        palette_image(40),
        d / "animated.gif",
        save_all=True,
        append_images=[palette_image(41), palette_image(42)],
        duration=100,
        loop=0,
        transparency=2,
    ),
    "animated.png": lambda d: save(
        noise(43, mode="RGBA"),
        d / "animated.png",
        save_all=True,
        append_images=[noise(44, mode="RGBA")],
        duration=100,
    ),
    "rgba.webp": lambda d: save(noise(45, mode="RGBA"), d / "rgba.webp", lossless=True),
    "rgb.bmp": lambda d: save(noise(46), d / "rgb.bmp"),
    "rgba.tiff": lambda d: save(noise(47, mode="RGBA"), d / "rgba.tiff"),
}

# name -> writer(folder) -> path: audio files libsndfile decodes.
AudioCase = Callable[[Path], Path]
AUDIO_CASES: dict[str, AudioCase] = {
    "pcm16-mono.wav": lambda d: write_audio(d / "pcm16-mono.wav", tone(800), 16_000, "PCM_16"),
    "pcm16-stereo.wav": lambda d: write_audio(
        d / "pcm16-stereo.wav", tone(700, 2, seed=1), 44_100, "PCM_16"
    ),
    "pcm8.wav": lambda d: write_audio(d / "pcm8.wav", tone(500, seed=2), 8_000, "PCM_U8"),
    "pcm24-3ch.wav": lambda d: write_audio(
        d / "pcm24-3ch.wav", tone(600, 3, seed=3), 48_000, "PCM_24"
    ),
    "pcm32.wav": lambda d: write_audio(d / "pcm32.wav", tone(400, seed=4), 22_050, "PCM_32"),
    "float-stereo.wav": lambda d: write_audio(
        d / "float-stereo.wav", tone(900, 2, seed=5), 24_000, "FLOAT"
    ),
    "double.wav": lambda d: write_audio(d / "double.wav", tone(300, seed=6), 16_000, "DOUBLE"),
    "six-channels.wav": lambda d: write_audio(
        d / "six-channels.wav", tone(256, 6, seed=7), 48_000, "FLOAT"
    ),
    "clip.flac": lambda d: write_audio(
        d / "clip.flac", tone(1_000, 2, seed=8), 16_000, "PCM_16", "FLAC"
    ),
    "clip.ogg": lambda d: write_audio(d / "clip.ogg", tone(4_000, seed=9), 16_000, "VORBIS", "OGG"),
}
