"""omnicache.media: files opened as vLLM's server opens uploads, and every refusal's message.

Expectations here are computed without the loader (Pillow and numpy on the
pixels and samples as written); test_vllm_media.py checks the loader against
vLLM's own loaders.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile
from media_files import (
    AUDIO_CASES,
    IMAGE_CASES,
    bomb_png,
    jpeg_with_orientation,
    long_wav,
    noise,
    palette_image,
    rgb_with_trns,
    save,
    tone,
    truncated,
    wav_declaring,
    write_audio,
)
from PIL import Image

from omnicache.demo.wav import write_wav
from omnicache.media import (
    AUDIO_EXTENSIONS,
    DEFAULT_SERIES,
    IMAGE_FORMATS,
    VLLM_RULES,
    MediaError,
    image_extensions,
    load_audio,
    load_image,
)

WHITE = np.array([255, 255, 255], np.uint8)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


def refusal(path: Path, reason: str) -> str:
    return re.escape(f"{path}: {reason}") + "$"


# -- images ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(IMAGE_CASES))
def test_every_image_case_opens_as_rgb_of_its_size(tmp_path: Path, name: str) -> None:
    path = IMAGE_CASES[name](tmp_path)
    image = load_image(path)
    turned = name in {f"exif-{k}.jpg" for k in (5, 6, 7, 8)}
    assert (image.mode, image.size) == ("RGB", (32, 48) if turned else (48, 32))


@pytest.mark.parametrize(
    ("orientation", "transpose"),
    [
        (2, Image.Transpose.FLIP_LEFT_RIGHT),
        (3, Image.Transpose.ROTATE_180),
        (4, Image.Transpose.FLIP_TOP_BOTTOM),
        (5, Image.Transpose.TRANSPOSE),
        (6, Image.Transpose.ROTATE_270),
        (7, Image.Transpose.TRANSVERSE),
        (8, Image.Transpose.ROTATE_90),
    ],
)
def test_exif_orientation_turns_the_pixels_as_a_viewer_shows_them(
    tmp_path: Path, orientation: int, transpose: Image.Transpose
) -> None:
    # The same picture stored with orientation 1 and with another: the same
    # JPEG data, so the stored pixels are equal before the turn.
    upright = jpeg_with_orientation(tmp_path / "upright.jpg", noise(5), 1)
    turned = jpeg_with_orientation(tmp_path / "turned.jpg", noise(5), orientation)
    with Image.open(upright) as stored:
        expected = stored.convert("RGB").transpose(transpose)
    assert pixels(load_image(turned)).tolist() == pixels(expected).tolist()
    assert pixels(load_image(upright)).tolist() != pixels(load_image(turned)).tolist()


def test_an_orientation_outside_exif_leaves_the_image_as_stored(tmp_path: Path) -> None:
    path = jpeg_with_orientation(tmp_path / "bogus.jpg", noise(6), 9)
    with Image.open(path) as stored:
        expected = stored.convert("RGB")
    assert pixels(load_image(path)).tolist() == pixels(expected).tolist()


def test_rgba_is_composited_over_white(tmp_path: Path) -> None:
    rgb = pixels(noise(7))
    alpha = np.where(np.arange(48)[None, :] % 3 == 0, 0, 255).repeat(32, axis=0).astype(np.uint8)
    path = save(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), tmp_path / "cut-out.png")
    expected = np.where(alpha[..., None] == 0, WHITE, rgb)
    assert pixels(load_image(path)).tolist() == expected.tolist()
    # The background is a rule: a server configured with another gets it.
    black = dataclasses.replace(VLLM_RULES[DEFAULT_SERIES], background=(0, 0, 0))
    expected_black = np.where(alpha[..., None] == 0, 0, rgb)
    assert pixels(load_image(path, rules=black)).tolist() == expected_black.tolist()


def test_a_palette_with_a_transparent_index_is_composited_over_white(tmp_path: Path) -> None:
    palette = palette_image(8)
    plain = save(palette, tmp_path / "plain.png")
    keyed = save(palette, tmp_path / "keyed.png", transparency=3)
    expected = pixels(palette.convert("RGB"))
    assert pixels(load_image(plain)).tolist() == expected.tolist()
    hidden = pixels(palette) == 3
    assert hidden.any()
    assert (
        pixels(load_image(keyed)).tolist() == np.where(hidden[..., None], WHITE, expected).tolist()
    )


def test_series_differ_on_an_rgb_image_with_a_trns_colour(tmp_path: Path) -> None:
    path = rgb_with_trns(tmp_path / "keyed.png", 9)
    with Image.open(path) as stored:
        colour = stored.info["transparency"]
        stored_pixels = pixels(stored.convert("RGB"))
    keyed = (stored_pixels == np.array(colour, np.uint8)).all(axis=-1)
    assert keyed.any() and not keyed.all()
    # 0.32 leaves an image already RGB as it is; 0.33 composites its tRNS colour.
    assert pixels(load_image(path, rules=VLLM_RULES["0.32"])).tolist() == stored_pixels.tolist()
    assert (
        pixels(load_image(path, rules=VLLM_RULES["0.33"])).tolist()
        == np.where(keyed[..., None], WHITE, stored_pixels).tolist()
    )


def test_an_animated_image_is_its_first_frame(tmp_path: Path) -> None:
    first, later = palette_image(10), palette_image(11)
    animated = save(first, tmp_path / "a.gif", save_all=True, append_images=[later], duration=50)
    still = save(first, tmp_path / "still.gif")
    with Image.open(animated) as opened:
        assert opened.n_frames == 2
    assert pixels(load_image(animated)).tolist() == pixels(load_image(still)).tolist()
    assert pixels(load_image(still)).tolist() == pixels(first.convert("RGB")).tolist()


def test_image_extensions_are_those_of_the_allowed_formats() -> None:
    suffixes = image_extensions()
    assert {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif"} <= suffixes
    assert ".eps" not in suffixes and ".pdf" not in suffixes
    assert "EPS" not in IMAGE_FORMATS and "WMF" not in IMAGE_FORMATS


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path: Path) -> None:
    path = bomb_png(tmp_path / "bomb.png")
    assert path.stat().st_size < 120_000
    reason = "expected at most 178,956,970 pixels, found 900,000,000 (a decompression bomb?)"
    with pytest.raises(MediaError, match=refusal(path, reason)) as caught:
        load_image(path)
    assert (caught.value.path, caught.value.reason) == (path, reason)


def test_an_image_over_the_pixel_limit_is_refused(tmp_path: Path) -> None:
    path = save(noise(12), tmp_path / "big.png")
    small = dataclasses.replace(VLLM_RULES[DEFAULT_SERIES], max_image_pixels=1_535)
    with pytest.raises(
        MediaError, match=refusal(path, "expected at most 1,535 pixels, found 48x32 (1,536)")
    ):
        load_image(path, rules=small)
    exact = dataclasses.replace(small, max_image_pixels=1_536)
    assert load_image(path, rules=exact).size == (48, 32)


def _bad_image(folder: Path, name: str) -> Path:
    """Writes the bad image file ``name`` (see the cases below) and returns its path."""
    path = folder / name
    if name.startswith("half."):
        truncated(path, save(noise(13), folder / f"whole{path.suffix}"))
    elif name == "noise.png":
        path.write_bytes(b"\x89PNG\r\n")
    elif name == "vector.eps":
        path.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    elif name == "folder.png":
        path.mkdir()
    return path


UNIDENTIFIED = (
    "expected an image in a format the server accepts (PNG, JPEG, WEBP, GIF and 33 more), "
    "found none that Pillow identifies (another format, or a corrupt file)"
)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("half.png", "cannot decode the image: image file is truncated"),
        ("half.jpg", "cannot decode the image: image file is truncated (146 bytes not processed)"),
        ("noise.png", UNIDENTIFIED),
        # EPS may run Ghostscript: vLLM's server does not let Pillow open it.
        ("vector.eps", UNIDENTIFIED),
        ("absent.png", "no such file"),
        ("folder.png", "expected a file, found a folder"),
    ],
)
def test_a_bad_image_file_is_one_error_naming_the_file_and_the_reason(
    tmp_path: Path, name: str, reason: str
) -> None:
    path = _bad_image(tmp_path, name)
    with pytest.raises(MediaError, match=refusal(path, reason)):
        load_image(path)


# -- audio ---------------------------------------------------------------------------------


def quantized_16(samples: np.ndarray) -> np.ndarray:
    """What a 16-bit PCM file holds, as float32 in [-1, 1) (libsndfile's scale: 1/32768)."""
    ints = np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
    return (ints.astype(np.float32) / np.float32(32768.0)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(AUDIO_CASES))
def test_every_audio_case_decodes_to_float32_mono_at_its_own_rate(
    tmp_path: Path, name: str
) -> None:
    path = AUDIO_CASES[name](tmp_path)
    info = soundfile.info(str(path))
    waveform, rate = load_audio(path)
    assert (waveform.dtype, waveform.shape, rate) == (np.float32, (info.frames,), info.samplerate)
    assert waveform.flags.c_contiguous


def test_pcm16_mono_and_stereo_read_as_written_channels_averaged(tmp_path: Path) -> None:
    mono = tone(300)[:, 0]
    write_wav(tmp_path / "mono.wav", mono, 8_000)
    waveform, rate = load_audio(tmp_path / "mono.wav")
    assert rate == 8_000
    assert waveform.tolist() == quantized_16(mono).tolist()

    stereo = tone(300, 2, seed=1).T
    write_wav(tmp_path / "stereo.wav", stereo, 44_100)
    waveform, rate = load_audio(tmp_path / "stereo.wav")
    left, right = quantized_16(stereo[0]), quantized_16(stereo[1])
    assert rate == 44_100
    assert waveform.tolist() == ((left + right) / np.float32(2)).tolist()


def test_float_wavs_are_read_exactly(tmp_path: Path) -> None:
    samples = tone(500, 2, seed=2).astype(np.float32)
    path = write_audio(tmp_path / "float.wav", samples, 24_000, "FLOAT")
    assert path.read_bytes()[20:22] == (3).to_bytes(2, "little")  # WAVE_FORMAT_IEEE_FLOAT
    waveform, rate = load_audio(path)
    assert rate == 24_000
    assert waveform.tolist() == ((samples[:, 0] + samples[:, 1]) / np.float32(2)).tolist()


@pytest.mark.parametrize(
    ("width", "raw", "expected"),
    [
        (1, bytes([128, 255, 0]), [0.0, 127 / 128, -1.0]),
        (3, b"\x00\x00\x40" + b"\xff\xff\xff", [0.5, -1 / 2**23]),
        (4, (2**30).to_bytes(4, "little") + (-(2**31)).to_bytes(4, "little", signed=True),
         [0.5, -1.0]),
    ],
)  # fmt: skip
def test_8_24_and_32_bit_pcm_are_scaled_to_one(
    tmp_path: Path, width: int, raw: bytes, expected: list[float]
) -> None:
    path = tmp_path / "x.wav"
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(width)
        wav.setframerate(16_000)
        wav.writeframes(raw)
    waveform, rate = load_audio(path)
    assert rate == 16_000
    assert waveform.tolist() == np.array(expected, np.float32).tolist()


def test_a_wav_cut_short_of_its_header_is_refused(tmp_path: Path) -> None:
    path = wav_declaring(tmp_path / "cut.wav", 8, 1_600, 16_000)
    reason = (
        "data chunk: expected 3,200 bytes (1,600 frames) as the header declares, "
        "found 16 (8 frames)"
    )
    with pytest.raises(MediaError, match=refusal(path, reason)):
        load_audio(path)
    # Exactly as declared, or a streaming writer's "length unknown": read to the end.
    whole = wav_declaring(tmp_path / "whole.wav", 8, 8, 16_000)
    streamed = wav_declaring(tmp_path / "streamed.wav", 8, -1, 16_000)
    expected = (np.arange(8, dtype=np.float32) * 300 / 32768).tolist()
    assert load_audio(whole).waveform.tolist() == expected
    assert load_audio(streamed).waveform.tolist() == expected


def test_audio_over_the_limits_is_refused(tmp_path: Path) -> None:
    long = long_wav(tmp_path / "long.wav", 601)
    with pytest.raises(
        MediaError,
        match=refusal(long, "expected at most 600 s of audio, found 601.0 s (601,000 frames at "
                            "1,000 Hz)"),
    ):  # fmt: skip
        load_audio(long)
    assert load_audio(long_wav(tmp_path / "ten-minutes.wav", 600)).waveform.shape == (600_000,)

    clip = write_audio(tmp_path / "clip.wav", tone(100, 2), 8_000, "PCM_16")
    rules = VLLM_RULES[DEFAULT_SERIES]
    with pytest.raises(
        MediaError,
        match=refusal(clip, "expected at most 799 bytes of float32 samples, found 800 (100 "
                            "frames x 2 channels)"),
    ):  # fmt: skip
        load_audio(clip, rules=dataclasses.replace(rules, max_audio_decode_bytes=799))
    size = clip.stat().st_size
    with pytest.raises(
        MediaError, match=refusal(clip, f"expected at most {size - 1:,} bytes, found {size:,}")
    ):
        load_audio(clip, rules=dataclasses.replace(rules, max_audio_file_bytes=size - 1))
    assert (rules.max_audio_file_bytes, rules.max_audio_seconds) == (25 * 2**20, 600.0)
    assert rules.max_audio_decode_bytes == 268_435_456


def wav_format_tag(tag: int) -> bytes:
    """A WAV of 2 frames whose ``fmt`` chunk names the encoding ``tag``."""
    fmt = struct.pack("<HHIIHH", tag, 1, 8_000, 16_000, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", 4) + bytes(4)
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("noise.wav", b"not a wave file at all", "cannot decode the audio: Format not recognised."),
        ("empty.wav", None, "expected at least one sample, found none"),
        ("codec.wav", wav_format_tag(0x1234),
         "cannot decode the audio: Error in WAV/W64/RF64 file. Malformed 'fmt ' chunk."),
    ],
)  # fmt: skip
def test_a_bad_audio_file_is_one_error_naming_the_file_and_the_reason(
    tmp_path: Path, name: str, content: bytes | None, reason: str
) -> None:
    path = tmp_path / name
    if content is None:
        wav_declaring(path, 0, 0, 16_000)
    else:
        path.write_bytes(content)
    with pytest.raises(MediaError, match=refusal(path, reason)):
        load_audio(path)


def test_audio_extensions_cover_what_libsndfile_reads() -> None:
    assert {".wav", ".flac", ".ogg", ".mp3", ".opus"} <= AUDIO_EXTENSIONS
    assert not {".m4a", ".aac", ".mp4"} & AUDIO_EXTENSIONS


def test_riff_chunks_before_the_data_are_skipped_with_their_padding(tmp_path: Path) -> None:
    # A LIST chunk of odd size (padded to even) before "data".
    path = wav_declaring(tmp_path / "plain.wav", 4, 4, 8_000)
    data = path.read_bytes()
    at = data.index(b"data")
    extra = b"LIST" + struct.pack("<I", 3) + b"abc" + b"\x00"
    body = data[12:at] + extra + data[at:]
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body)
    assert load_audio(path).waveform.tolist() == [0.0, 300 / 32768, 600 / 32768, 900 / 32768]
    cut = tmp_path / "cut.wav"
    cut.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(MediaError, match=r"data chunk: expected 8 bytes \(4 frames\)"):
        load_audio(cut)
