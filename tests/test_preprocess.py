"""annotate_prompt: item classification, placeholder runs and ranges, dedup, errors."""

from __future__ import annotations

import copy
import io
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import soundfile
from PIL import Image

import omnicache.preprocess as preprocess
from hashing import ContentHash, hash_identifier
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.identity import item_identity
from omnicache.media import MediaError
from omnicache.preprocess import annotate_prompt

T = TokenRangeAnnotation
IMG, AUD = 32000, 32001
SUPPORTED = (
    "expected a hashing.ContentHash (used as is), a PIL.Image.Image, a uint8 numpy.ndarray or "
    "torch.Tensor (an image, or a video shaped (frames, height, width, channels)), a "
    "(waveform, sample_rate) tuple (audio), a (frames, metadata) tuple (a video), bytes, "
    "bytearray or an os.PathLike (an encoded image or audio file) or a str (a caller's id)"
)


def hash_image(image: Any, **kwargs: Any) -> ContentHash:
    return item_identity(image, modality="image", **kwargs)


def hash_audio(wave: Any, rate: int, **kwargs: Any) -> ContentHash:
    return item_identity((wave, rate), modality="audio", **kwargs)


@dataclass
class PlaceholderRange:
    """Shaped like vLLM's PlaceholderRange."""

    offset: int
    length: int


def _image(color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (4, 3), color)


def _wave(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(160).astype(np.float32)


def test_runs_of_one_placeholder_id_pair_with_items_in_order() -> None:
    red, blue = _image((255, 0, 0)), _image((0, 0, 255))
    ids = [1, 2, IMG, IMG, IMG, 3, IMG, IMG, 4]
    tokens = annotate_prompt(ids, [red, blue], placeholder_token_id=IMG)
    assert tokens.tolist() == ids
    assert tokens.annotations == (
        T(2, 3, hash_image(red), 0, 3),
        T(6, 2, hash_image(blue), 0, 2),
    )


def test_every_item_kind() -> None:
    image = _image((1, 2, 3))
    pixels = np.zeros((2, 3, 3), dtype=np.uint8)
    wave = _wave(0)
    png = io.BytesIO()
    image.save(png, "PNG")
    wav = io.BytesIO()
    soundfile.write(wav, wave, 16000, format="WAV", subtype="FLOAT")
    frames = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    metadata = {"fps": 2.0, "frames_indices": [0, 1]}
    precomputed = ContentHash(bytes(range(32)))
    items = [
        image,
        pixels,
        (wave, 16000),
        png.getvalue(),
        bytearray(wav.getvalue()),
        frames,
        (frames, metadata),
        "request-7",
        precomputed,
    ]
    ids = []
    for _ in items:
        ids += [5, IMG, IMG]
    tokens = annotate_prompt(ids, items, placeholder_token_id=IMG)
    expected_hashes = [
        hash_image(image),
        hash_image(pixels),
        hash_audio(wave, 16000),
        hash_image(image),  # the PNG of the same picture: one identity
        hash_audio(wave, 16000),  # the WAV of the same samples
        item_identity(frames, modality="video"),
        item_identity((frames, metadata), modality="video"),
        hash_identifier("request-7", namespace="default"),
        precomputed,
    ]
    assert tokens.annotations == tuple(
        T(3 * i + 1, 2, digest, 0, 2) for i, digest in enumerate(expected_hashes)
    )
    assert tokens.annotations[-1].content_hash is precomputed
    assert len(set(expected_hashes)) == len(expected_hashes) - 2


def test_bytes_that_hold_neither_an_image_nor_audio_are_refused() -> None:
    for data in (b"fake file bytes", b"\x89PNG\r\n\x1a\n broken"):
        with pytest.raises(ValueError) as info:
            annotate_prompt([IMG], [data], placeholder_token_id=IMG)
        assert str(info.value) == (
            "items[0]: expected an encoded image or audio file, found neither (as an image: no "
            "format the server accepts identifies it; as audio: cannot decode the audio: Format "
            "not recognised.)"
        )
    # A picture Pillow identifies but refuses to open is refused as a picture, with the reason.
    bomb = io.BytesIO()
    Image.new("1", (20_000, 10_000)).save(bomb, "PNG")
    with pytest.raises(MediaError, match=r"^<bytes>: expected at most 178,956,970 pixels"):
        annotate_prompt([IMG], [bomb.getvalue()], placeholder_token_id=IMG)


def test_uint8_tensor_is_an_image() -> None:
    import torch

    pixels = torch.zeros((2, 3, 3), dtype=torch.uint8)
    tokens = annotate_prompt([IMG, IMG], [pixels], placeholder_token_id=IMG)
    assert tokens.annotations == (T(0, 2, hash_image(pixels.numpy()), 0, 2),)


def test_a_set_of_placeholder_ids_forms_mixed_runs() -> None:
    image, wave = _image((9, 9, 9)), _wave(1)
    ids = [1, IMG, IMG, 2, AUD, AUD, AUD, 3]
    for placeholder in ({IMG, AUD}, frozenset({IMG, AUD})):
        tokens = annotate_prompt(ids, [image, (wave, 8000)], placeholder_token_id=placeholder)
        assert tokens.annotations == (
            T(1, 2, hash_image(image), 0, 2),
            T(4, 3, hash_audio(wave, 8000), 0, 3),
        )


def test_adjacent_items_need_ranges() -> None:
    a, b = _image((1, 1, 1)), _image((2, 2, 2))
    ids = [7, IMG, IMG, IMG, IMG, 8]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "placeholder runs of 32000: expected 2 (one per item), found 1 at (offset, length) "
            "[(1, 4)]; adjacent items form one run: pass placeholder_ranges for them"
        ),
    ):
        annotate_prompt(ids, [a, b], placeholder_token_id=IMG)
    tokens = annotate_prompt(ids, [a, b], placeholder_ranges=[(1, 2), (3, 2)])
    assert tokens.annotations == (T(1, 2, hash_image(a), 0, 2), T(3, 2, hash_image(b), 0, 2))


def test_ranges_accept_placeholder_range_objects_in_any_order() -> None:
    a, b = _image((1, 1, 1)), _image((2, 2, 2))
    ids = [0, 1, 2, 3, 4, 5, 6, 7]
    tokens = annotate_prompt(
        ids, [a, b], placeholder_ranges=[PlaceholderRange(5, 3), PlaceholderRange(0, 2)]
    )
    assert tokens.annotations == (T(0, 2, hash_image(b), 0, 2), T(5, 3, hash_image(a), 0, 3))


def test_too_many_runs() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "placeholder runs of 32000: expected 1 (one per item), found 2 at (offset, length) "
            "[(0, 1), (2, 1)]"
        ),
    ):
        annotate_prompt([IMG, 1, IMG], [_image((0, 0, 0))], placeholder_token_id=IMG)


def test_range_count_mismatch() -> None:
    with pytest.raises(
        ValueError, match=re.escape("placeholder_ranges: expected 2 ranges (one per item), found 1")
    ):
        annotate_prompt([1, 2, 3], ["a", "b"], placeholder_ranges=[(0, 1)])


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        (
            [(0, 3), (2, 2)],
            "placeholder_ranges[1]: expected offset >= 3 (end of placeholder_ranges[0]; "
            "ranges must not overlap), found 2",
        ),
        (
            [(4, 2), (1, 4)],
            "placeholder_ranges[0]: expected offset >= 5 (end of placeholder_ranges[1]; "
            "ranges must not overlap), found 4",
        ),
        (
            [(0, 1), (5, 2)],
            "placeholder_ranges[1]: expected offset + length <= 6 (tokens in the prompt), "
            "found 5 + 2 = 7",
        ),
        ([(0, 1), (-1, 1)], "placeholder_ranges[1].offset: expected an int >= 0, found -1"),
        ([(0, 1), (2, 0)], "placeholder_ranges[1].length: expected an int >= 1, found 0"),
        ([(0, 1), (2.0, 1)], "placeholder_ranges[1].offset: expected an int >= 0, found 2.0"),
    ],
)
def test_bad_ranges(ranges: list[tuple[Any, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        annotate_prompt([0, 1, 2, 3, 4, 5], ["a", "b"], placeholder_ranges=ranges)


def test_range_of_wrong_shape_is_a_type_error() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape(
            "placeholder_ranges[0]: expected an (offset, length) pair or an object with .offset "
            "and .length, found int"
        ),
    ):
        annotate_prompt([0, 1], ["a"], placeholder_ranges=[3])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, -2, IMG], "token_ids[1]: expected an int in [0, 4294967295], found -2 (int)"),
        ([1, "2", IMG], "token_ids[1]: expected an int in [0, 4294967295], found '2' (str)"),
        ([1.0, IMG], "token_ids[0]: expected an int in [0, 4294967295], found 1.0 (float)"),
    ],
)
def test_bad_token_ids(ids: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        annotate_prompt(ids, ["x"], placeholder_token_id=IMG)


@pytest.mark.parametrize(
    ("item", "found"),
    [
        (3.5, "found float"),
        ({"image": 1}, "found dict"),
        ((np.zeros(4), 16000, "extra"), "found tuple"),
        (
            np.zeros(4, dtype=np.float32),
            "found a ndarray of dtype float32 (only uint8 arrays are images; pass audio as "
            "(waveform, sample_rate) and any other array as a precomputed ContentHash)",
        ),
    ],
)
def test_unsupported_items_list_the_supported_types(item: object, found: str) -> None:
    with pytest.raises(TypeError, match=re.escape(f"items[1]: {SUPPORTED}, {found}")):
        annotate_prompt([IMG, 0, IMG], ["ok", item], placeholder_token_id=IMG)


def test_each_distinct_item_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_identity, real_id = item_identity, hash_identifier

    def count(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(preprocess, "item_identity", count("identity", real_identity))
    monkeypatch.setattr(preprocess, "hash_identifier", count("id", real_id))
    image, other, wave = _image((5, 5, 5)), _image((5, 5, 5)), _wave(2)
    rate = 16000
    items = [image, (wave, rate), image, "u-1", (wave, rate), "u-1", other]
    ids = [IMG, 0] * len(items)
    tokens = annotate_prompt(ids, items, placeholder_token_id=IMG)
    # ``other`` is a different object with the same pixels: hashed, and equal.
    assert sorted(calls) == ["id", "identity", "identity", "identity"]
    digests = [a.content_hash for a in tokens.annotations]
    assert digests[0] == digests[2] == digests[6] == hash_image(image)
    assert digests[1] == digests[4] == hash_audio(wave, rate)
    assert digests[3] == digests[5] == hash_identifier("u-1", namespace="default")


def test_inputs_are_not_modified() -> None:
    image, wave = _image((3, 4, 5)), _wave(3)
    ids = [1, IMG, IMG, 2, AUD, 3]
    items = [image, (wave, 16000)]
    ranges = [(1, 2), (4, 1)]
    before = (list(ids), list(items), copy.deepcopy(ranges), wave.copy(), image.tobytes())
    annotate_prompt(ids, items, placeholder_ranges=ranges)
    annotate_prompt(ids, items, placeholder_token_id={IMG, AUD})
    assert ids == before[0]
    assert items == before[1]
    assert ranges == before[2]
    assert np.array_equal(wave, before[3])
    assert image.tobytes() == before[4]


def test_algorithm_context_and_namespace_pass_through() -> None:
    image = _image((6, 6, 6))
    context = {"model": "llava", "resize": [336, 336]}
    tokens = annotate_prompt(
        [IMG, IMG, 0, IMG],
        [image, "req"],
        placeholder_token_id=IMG,
        algorithm="sha256",
        context=context,
        identifier_namespace="tenant-a",
    )
    assert tokens.annotations == (
        T(0, 2, hash_image(image, algorithm="sha256", context=context), 0, 2),
        T(3, 1, hash_identifier("req", namespace="tenant-a", algorithm="sha256"), 0, 1),
    )
    assert tokens.annotations[0].content_hash != hash_image(image, algorithm="sha256")


def test_a_precomputed_hash_must_match_the_algorithm() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("items[0]: expected a 16-byte xxh3_128 ContentHash, found 32 bytes"),
    ):
        annotate_prompt(
            [IMG], [ContentHash(bytes(32))], placeholder_token_id=IMG, algorithm="xxh3_128"
        )


def test_no_items_no_placeholders() -> None:
    tokens = annotate_prompt([1, 2, 3], [])
    assert tokens == AnnotatedTokens([1, 2, 3])
    assert annotate_prompt([1, IMG], [], placeholder_ranges=[]) == AnnotatedTokens([1, IMG])


def test_placeholder_options() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("expected placeholder_token_id or placeholder_ranges, found both"),
    ):
        annotate_prompt([IMG], ["a"], placeholder_token_id=IMG, placeholder_ranges=[(0, 1)])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "expected placeholder_token_id or placeholder_ranges to place 1 items, found neither"
        ),
    ):
        annotate_prompt([IMG], ["a"])
    with pytest.raises(
        ValueError,
        match=re.escape("placeholder_token_id: expected ints in [0, 4294967295], found -1"),
    ):
        annotate_prompt([IMG], ["a"], placeholder_token_id=-1)
    with pytest.raises(
        ValueError,
        match=re.escape("placeholder_token_id: expected a non-empty set of ids, found set()"),
    ):
        annotate_prompt([IMG], ["a"], placeholder_token_id=set())
    with pytest.raises(
        TypeError,
        match=re.escape(
            "placeholder_token_id: expected an int or a set or frozenset of ints, found list"
        ),
    ):
        annotate_prompt([IMG], ["a"], placeholder_token_id=[IMG])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=re.escape("items: expected a list or tuple of items, found str")
    ):
        annotate_prompt([IMG], "a")
    with pytest.raises(
        ValueError,
        match=re.escape("algorithm: expected one of blake3, sha256, xxh3_128, found 'md4'"),
    ):
        annotate_prompt([IMG], ["a"], placeholder_token_id=IMG, algorithm="md4")  # type: ignore[arg-type]


def test_annotated_prompt_keys_differ_by_image() -> None:
    from omnicache.block_hash import BlockHasher

    ids = [1, 2, 3, 4] + [IMG] * 12
    hasher = BlockHasher(8)
    red = annotate_prompt(ids, [_image((255, 0, 0))], placeholder_token_id=IMG)
    blue = annotate_prompt(ids, [_image((0, 0, 255))], placeholder_token_id=IMG)
    red_keys, blue_keys = hasher.hash_blocks(red), hasher.hash_blocks(blue)
    assert red_keys[0] != blue_keys[0]
    assert red_keys[1] != blue_keys[1]
    assert (
        hasher.hash_blocks(annotate_prompt(ids, [_image((255, 0, 0))], placeholder_token_id=IMG))
        == red_keys
    )
