"""omnicache.media against vLLM's own loaders, in the series installed (0.32 or 0.33).

vLLM's OpenAI server turns an upload into what the model sees with
``ImageMediaIO().load_bytes`` and ``AudioMediaIO().load_bytes``; omnicache's
front end digests their output. Each case here is a file both open: the
pixels and samples must be equal bit for bit, under the rules of the series
that is installed (``./dev test`` runs these on 0.33, ``./dev live`` on
0.32). Files both refuse are refused by both; the one deliberate difference
(a WAV cut short of its header) is pinned, so a change in vLLM shows here.

Skipped without vLLM, failed instead under ``CI=true``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from media_files import (
    AUDIO_CASES,
    IMAGE_CASES,
    bomb_png,
    noise,
    save,
    truncated,
    wav_declaring,
)
from test_vllm_integration import VLLM_MISSING

from hashing import hash_audio, hash_image
from omnicache.media import VLLM_RULES, MediaError, MediaRules, load_audio, load_image

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
]


@pytest.fixture(scope="module")
def rules() -> MediaRules:
    from omnicache.integrations.vllm.common import vllm_series

    return VLLM_RULES[vllm_series().rstrip(".")]


def vllm_image(path: Path) -> object:
    from vllm.multimodal.media.image import ImageMediaIO

    return ImageMediaIO().load_bytes(path.read_bytes()).media


def vllm_audio(path: Path) -> tuple[np.ndarray, int]:
    from vllm.multimodal.media.audio import AudioMediaIO

    waveform, rate = AudioMediaIO().load_bytes(path.read_bytes())
    return waveform, rate


@pytest.mark.parametrize("name", sorted(IMAGE_CASES))
def test_images_open_to_the_pixels_vllm_gives_the_model(
    tmp_path: Path, name: str, rules: MediaRules
) -> None:
    path = IMAGE_CASES[name](tmp_path)
    ours = load_image(path, rules=rules)
    theirs = vllm_image(path)
    assert (ours.mode, ours.size) == (theirs.mode, theirs.size)  # type: ignore[attr-defined]
    assert ours.tobytes() == theirs.tobytes()  # type: ignore[attr-defined]
    assert hash_image(ours) == hash_image(theirs)


@pytest.mark.parametrize("name", sorted(AUDIO_CASES))
def test_audio_decodes_to_the_samples_vllm_gives_the_model(
    tmp_path: Path, name: str, rules: MediaRules
) -> None:
    path = AUDIO_CASES[name](tmp_path)
    waveform, rate = load_audio(path, rules=rules)
    their_waveform, their_rate = vllm_audio(path)
    assert (waveform.dtype, waveform.shape, rate) == (
        their_waveform.dtype,
        their_waveform.shape,
        their_rate,
    )
    assert waveform.tobytes() == their_waveform.tobytes()
    assert hash_audio(waveform, rate) == hash_audio(their_waveform, their_rate)


def _refused_by_vllm(load: object, path: Path) -> bool:
    assert callable(load)
    try:
        load(path)
    except (ValueError, OSError):  # DecompressionBombError is neither: it escapes
        return True
    return False


@pytest.mark.parametrize("name", ["half.png", "half.jpg", "noise.png", "vector.eps"])
def test_images_vllm_refuses_are_refused(tmp_path: Path, name: str, rules: MediaRules) -> None:
    path = tmp_path / name
    if name.startswith("half."):
        truncated(path, save(noise(3), tmp_path / f"whole{path.suffix}"))
    elif name == "noise.png":
        path.write_bytes(b"\x89PNG\r\n")
    else:
        path.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    assert _refused_by_vllm(vllm_image, path)
    with pytest.raises(MediaError):
        load_image(path, rules=rules)


def test_a_bomb_is_refused_by_both(tmp_path: Path, rules: MediaRules) -> None:
    from PIL import Image

    path = bomb_png(tmp_path / "bomb.png")
    with pytest.raises(Image.DecompressionBombError):
        vllm_image(path)
    with pytest.raises(MediaError, match=r"found 900,000,000 \(a decompression bomb\?\)$"):
        load_image(path, rules=rules)


def test_the_pixel_limit_is_vllms(
    tmp_path: Path, rules: MediaRules, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.envs

    assert rules.max_image_pixels == vllm.envs.VLLM_MAX_IMAGE_PIXELS
    path = save(noise(4), tmp_path / "small.png")  # 48 x 32 = 1,536 pixels
    assert not _refused_by_vllm(vllm_image, path)
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", "1535")
    assert vllm.envs.VLLM_MAX_IMAGE_PIXELS == 1_535
    assert _refused_by_vllm(vllm_image, path)
    smaller = dataclasses.replace(rules, max_image_pixels=1_535)
    with pytest.raises(MediaError, match=r"expected at most 1,535 pixels, found 48x32 \(1,536\)$"):
        load_image(path, rules=smaller)


def test_the_audio_limits_are_vllms(rules: MediaRules) -> None:
    import vllm.envs

    assert rules.max_audio_file_bytes == vllm.envs.VLLM_MAX_AUDIO_CLIP_FILESIZE_MB * 2**20
    assert rules.max_audio_seconds == vllm.envs.VLLM_MAX_AUDIO_DECODE_DURATION_S
    assert rules.max_audio_decode_bytes == vllm.envs.VLLM_MAX_AUDIO_DECODE_BYTES


def test_a_wav_cut_short_is_read_by_vllm_and_refused_here(
    tmp_path: Path, rules: MediaRules
) -> None:
    # The deliberate difference (omnicache.media, README): libsndfile reads
    # the 8 frames the file holds of the 1,600 its header declares.
    path = wav_declaring(tmp_path / "cut.wav", 8, 1_600, 16_000)
    waveform, rate = vllm_audio(path)
    assert (waveform.shape, rate) == ((8,), 16_000)
    with pytest.raises(MediaError, match=r"data chunk: expected 3,200 bytes \(1,600 frames\)"):
        load_audio(path, rules=rules)
