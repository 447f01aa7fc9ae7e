"""Content digests: determinism, sensitivity, injectivity, equivalences, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

import hashing
from hashing import (
    ALGORITHMS,
    ContentHash,
    hash_array,
    hash_array_rows,
    hash_audio,
    hash_bytes,
    hash_content,
    hash_identifier,
    hash_image,
    hash_video,
)
from hashing._pil import SUPPORTED_MODES, pixel_payload, reference_pixel_bytes

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(1234)


def rgb_array(height: int = 6, width: int = 5) -> np.ndarray[Any, Any]:
    return RNG.integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(params=ALGORITHMS)
def algorithm(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# --- sizes, types, determinism -----------------------------------------------------


def test_digest_sizes_and_type(algorithm: str) -> None:
    digest = hash_identifier("x", namespace="n", algorithm=algorithm)  # type: ignore[arg-type]
    assert type(digest) is ContentHash
    assert len(digest) == {"blake3": 32, "sha256": 32, "xxh3_128": 16}[algorithm]
    assert hashing.digest_size(algorithm) == len(digest)  # type: ignore[arg-type]
    assert repr(digest) == f"ContentHash('{digest.hex()}')"


def test_every_kind_is_deterministic(algorithm: str) -> None:
    image = Image.fromarray(rgb_array())
    clip = RNG.standard_normal(100).astype(np.float32)
    for fn in (
        lambda: hash_image(image, algorithm=algorithm),
        lambda: hash_image(np.asarray(image), algorithm=algorithm),
        lambda: hash_audio(clip, 16000, algorithm=algorithm),
        lambda: hash_video([image, image], fps=2.0, algorithm=algorithm),
        lambda: hash_array(clip, algorithm=algorithm),
        lambda: hash_bytes(b"\xff\xd8", modality="image", algorithm=algorithm),
        lambda: hash_identifier("id", namespace="n", algorithm=algorithm),
    ):
        assert fn() == fn()  # type: ignore[no-untyped-call]


def test_algorithms_give_different_digests() -> None:
    digests = {hash_identifier("x", namespace="n", algorithm=a) for a in ALGORITHMS}
    assert len(digests) == 3


_SEED_SCRIPT = """
import numpy as np, hashing
from PIL import Image
a = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)
print(hashing.hash_image(Image.fromarray(a)).hex(), hashing.hash_image(a).hex(),
      hashing.hash_audio(np.arange(8, dtype=np.float32), 8000).hex(),
      hashing.hash_identifier("u", namespace="t", algorithm="xxh3_128").hex(),
      hashing.hash_array(np.ones(3), context={"b": 1, "a": [1.5, None]}).hex())
"""


def test_digests_are_equal_across_pythonhashseed_values() -> None:
    outputs = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _SEED_SCRIPT], env=env, cwd=ROOT, check=True,
            capture_output=True, text=True,
        )  # fmt: skip
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert len(outputs.pop().split()) == 5


# --- every single-field change changes the digest ----------------------------------


def test_image_single_field_changes() -> None:
    base = rgb_array()
    image = Image.fromarray(base)
    digest = hash_image(image)
    changed_pixel = base.copy()
    changed_pixel[5, 4, 2] ^= 1
    variants = {
        "pixel": hash_image(Image.fromarray(changed_pixel)),
        "size": hash_image(image.resize((5, 5))),
        "mode": hash_image(image.convert("RGBA")),
        "context": hash_image(image, context={"model": "m"}),
        "algorithm": hash_image(image, algorithm="sha256"),
    }
    assert len(set(variants.values()) | {digest}) == len(variants) + 1


def test_palette_change_is_seen() -> None:
    indices = np.array([[0, 1], [1, 0]], dtype=np.uint8)
    first = Image.fromarray(indices, mode="P")
    first.putpalette([0, 0, 0, 255, 255, 255])
    second = Image.fromarray(indices, mode="P")
    second.putpalette([0, 0, 0, 255, 255, 254])
    assert first.tobytes() == second.tobytes()
    assert hash_image(first) != hash_image(second)


def test_transparency_is_seen() -> None:
    indices = np.array([[0, 1]], dtype=np.uint8)
    plain = Image.fromarray(indices, mode="P")
    plain.putpalette([0, 0, 0, 255, 255, 255])
    transparent = plain.copy()
    transparent.info["transparency"] = 0
    assert hash_image(plain) != hash_image(transparent)


def test_audio_single_field_changes() -> None:
    clip = RNG.standard_normal((2, 50)).astype(np.float32)
    digest = hash_audio(clip, 16000)
    changed = clip.copy()
    changed[1, 49] = np.nextafter(changed[1, 49], np.float32(10))
    variants = {
        "sample": hash_audio(changed, 16000),
        "rate": hash_audio(clip, 16001),
        "dtype": hash_audio(clip.astype(np.float64), 16000),
        "channel layout": hash_audio(np.ascontiguousarray(clip.T).reshape(2, 50), 16000),
        "channels": hash_audio(clip.reshape(1, 100), 16000),
        "mono": hash_audio(clip.reshape(100), 16000),
        "context": hash_audio(clip, 16000, context={"normalize": False}),
    }
    assert len(set(variants.values()) | {digest}) == len(variants) + 1


def test_video_single_field_changes() -> None:
    frames = RNG.integers(0, 256, (3, 4, 4, 3), dtype=np.uint8)
    digest = hash_video(frames, fps=30.0)
    changed = frames.copy()
    changed[2, 3, 3, 0] ^= 0x80
    variants = {
        "frame": hash_video(changed, fps=30.0),
        "fps": hash_video(frames, fps=29.97),
        "no fps": hash_video(frames),
        "order": hash_video(frames[::-1].copy(), fps=30.0),
        "count": hash_video(frames[:2], fps=30.0),
        "as image": hash_image(frames[0]),
    }
    assert len(set(variants.values()) | {digest}) == len(variants) + 1


def test_context_values_are_typed_and_keys_canonical() -> None:
    digests = [
        hash_array(np.zeros(1)),
        *(
            hash_array(np.zeros(1), context=context)
            for context in (
                {"k": 1}, {"k": "1"}, {"k": 1.0}, {"k": True}, {"k": None}, {"k": b"1"},
                {"k": [1]}, {"k": {"1": 1}}, {"a": "b=c"}, {"a=b": "c"}, {"k": (1, 2)},
                {"k": [[1], 2]}, {"k": [1, [2]]},
            )
        ),
    ]  # fmt: skip
    assert len(set(digests)) == len(digests)
    # A tuple and a list are the same sequence; dict order never matters; None is {}.
    assert hash_array(np.zeros(1), context={"k": (1, 2)}) == hash_array(
        np.zeros(1), context={"k": [1, 2]}
    )
    assert hash_array(np.zeros(1), context={"a": 1, "b": 2}) == hash_array(
        np.zeros(1), context={"b": 2, "a": 1}
    )
    assert hash_array(np.zeros(1), context=None) == hash_array(np.zeros(1), context={})


# --- injectivity of the framing -----------------------------------------------------


def test_same_bytes_in_different_shapes_differ() -> None:
    data = np.arange(36, dtype=np.uint8)
    assert hash_image(data.reshape(2, 6, 3)) != hash_image(data.reshape(3, 4, 3))
    wide = Image.frombytes("RGB", (6, 2), data.tobytes())
    tall = Image.frombytes("RGB", (4, 3), data.tobytes())
    assert hash_image(wide) != hash_image(tall)


def test_image_and_audio_with_the_same_bytes_differ() -> None:
    data = np.arange(16, dtype=np.uint8)
    assert hash_image(data.reshape(4, 4)) != hash_audio(data, 16000)
    assert hash_array(data) != hash_audio(data, 16000)
    assert hash_bytes(data.tobytes(), modality="image") != hash_bytes(
        data.tobytes(), modality="audio"
    )


def test_rgb_and_rgba_of_the_same_picture_differ() -> None:
    image = Image.fromarray(rgb_array())
    assert hash_image(image) != hash_image(image.convert("RGBA"))
    assert hash_image(np.asarray(image)) != hash_image(np.asarray(image.convert("RGBA")))


def test_int16_and_float32_with_the_same_bytes_differ() -> None:
    as_int = np.arange(8, dtype=np.int16)
    as_float = as_int.view(np.float32)
    assert as_int.tobytes() == as_float.tobytes()
    assert hash_array(as_int) != hash_array(as_float)
    assert hash_audio(as_int, 8000) != hash_audio(as_float, 8000)


def test_identifier_namespaces_and_kinds_never_collide() -> None:
    assert hash_identifier("a", namespace="t1") != hash_identifier("a", namespace="t2")
    assert hash_identifier("ab", namespace="c") != hash_identifier("b", namespace="ca")
    assert hash_identifier("abc", namespace="") != hash_bytes(b"abc", modality="identifier")


# --- equivalent representations give equal digests ----------------------------------


def test_strided_view_equals_contiguous_copy() -> None:
    base = RNG.integers(0, 256, (8, 10, 4), dtype=np.uint8)
    view = base[::2, 1:8, :3]
    assert not view.flags.c_contiguous
    assert hash_image(view) == hash_image(np.ascontiguousarray(view))
    clip = RNG.standard_normal((2, 400)).astype(np.float32)
    assert hash_audio(clip[:, ::2], 8000) == hash_audio(clip[:, ::2].copy(), 8000)
    matrix = RNG.standard_normal((300, 5000))
    assert hash_array(matrix.T) == hash_array(np.ascontiguousarray(matrix.T))


def test_torch_tensor_equals_numpy_array() -> None:
    image = rgb_array()
    clip = RNG.standard_normal(64).astype(np.float32)
    assert hash_image(torch.from_numpy(image)) == hash_image(image)
    assert hash_audio(torch.from_numpy(clip), 16000) == hash_audio(clip, 16000)
    transposed = torch.arange(12, dtype=torch.int32).reshape(3, 4).T
    assert hash_array(transposed) == hash_array(transposed.numpy().copy())
    assert hash_array(torch.ones(2, requires_grad=True)) == hash_array(np.ones(2, np.float32))


def test_bfloat16_tensors_hash_by_value_and_dtype() -> None:
    values = torch.tensor([1.0, -2.5, 3.25], dtype=torch.bfloat16)
    assert hash_array(values) == hash_array(values.clone())
    assert hash_array(values) != hash_array(values.view(torch.int16))
    assert hash_array(values) != hash_array(values.to(torch.float16))
    assert hash_array(values[::2]) == hash_array(values[::2].contiguous())


def test_row_range_digests_equal_the_digests_of_the_slices() -> None:
    bounds = [(0, 4), (4, 5), (5, 5), (2, 9)]
    context = {"scheme": "rows", "item": b"\x01"}
    for rows in (
        torch.arange(72, dtype=torch.float32).reshape(9, 8),
        torch.arange(72, dtype=torch.float32).reshape(9, 8).to(torch.bfloat16),
        np.arange(144, dtype=np.int16).reshape(9, 16)[:, ::2],  # strided
    ):
        expected = [hash_array(rows[lo:hi], context=context) for lo, hi in bounds]
        assert hash_array_rows(rows, bounds, context=context) == expected
        assert hash_array_rows(rows, bounds, algorithm="sha256") == [
            hash_array(rows[lo:hi], algorithm="sha256") for lo, hi in bounds
        ]
    with pytest.raises(
        ValueError, match=r"^bounds\[1\]: expected 0 <= lo <= hi <= 3, found \(2, 4\)$"
    ):
        hash_array_rows(np.zeros((3, 2)), [(0, 1), (2, 4)])
    with pytest.raises(ValueError, match=r"^array: expected an array with rows \(ndim >= 1\)"):
        hash_array_rows(np.ones(()), [(0, 0)])


def test_big_endian_input_equals_little_endian() -> None:
    little = np.arange(6, dtype="<f4")
    assert hash_array(little.astype(">f4")) == hash_array(little)
    assert hash_audio(little.astype(">f4"), 100) == hash_audio(little, 100)


def test_gray_image_with_or_without_channel_axis_is_one_image() -> None:
    gray = RNG.integers(0, 256, (3, 4), dtype=np.uint8)
    assert hash_image(gray) == hash_image(gray[:, :, None])


def test_video_array_equals_its_list_of_frames() -> None:
    frames = RNG.integers(0, 256, (3, 4, 5, 3), dtype=np.uint8)
    assert hash_video(frames, fps=10) == hash_video(list(frames), fps=10.0)
    assert hash_video(torch.from_numpy(frames), fps=10) == hash_video(frames, fps=10)


# --- the PIL fast path ----------------------------------------------------------------


def _image_in_mode(mode: str) -> Image.Image:
    rgba = Image.fromarray(RNG.integers(0, 256, (7, 5, 4), dtype=np.uint8), "RGBA")
    if mode in {"La", "PA", "RGBa", "LAB", "HSV", "YCbCr", "I;16B", "I;16L", "I;16N"}:
        size = 35 * len(Image.new(mode, (1, 1)).tobytes())
        return Image.frombytes(mode, (5, 7), RNG.integers(0, 256, size, np.uint8).tobytes())
    if mode in {"I;16"}:
        return Image.frombytes(mode, (5, 7), RNG.integers(0, 256, 70, np.uint8).tobytes())
    return rgba.convert(mode)


@pytest.mark.parametrize("mode", sorted(SUPPORTED_MODES))
def test_pil_fast_path_equals_the_reference_layout(mode: str) -> None:
    image = _image_in_mode(mode)
    size, chunks = pixel_payload(image)
    fast = b"".join(bytes(chunk) for chunk in chunks)
    assert len(fast) == size
    assert fast == reference_pixel_bytes(image)


def test_pil_pad_bytes_do_not_change_the_digest() -> None:
    image = Image.fromarray(rgb_array(16, 16))
    resized = image.resize((8, 8), Image.Resampling.BILINEAR)  # Pillow writes 0x00 pads
    decoded = Image.frombytes("RGB", (8, 8), resized.tobytes())  # Pillow writes 0xFF pads
    assert hash_image(resized) == hash_image(decoded)
    la = image.convert("LA")
    assert hash_image(la) == hash_image(Image.frombytes("LA", la.size, la.tobytes()))


def test_pil_image_too_large_for_one_export_hashes_in_strips() -> None:
    # 2100 x 2100 RGB needs 17.6 MB of 4-byte slots: more than one Pillow block.
    array = RNG.integers(0, 256, (2100, 2100, 3), dtype=np.uint8)
    image = Image.fromarray(array)
    size, chunks = pixel_payload(image)
    assert b"".join(bytes(chunk) for chunk in chunks) == reference_pixel_bytes(image)
    assert size == 2100 * 2100 * 4


def test_pil_image_from_a_file_is_loaded_and_hashed(tmp_path: Path) -> None:
    image = Image.fromarray(rgb_array())
    image.save(tmp_path / "x.png")
    with Image.open(tmp_path / "x.png") as opened:
        assert hash_image(opened) == hash_image(image)


# --- hypothesis properties -------------------------------------------------------------

_dtypes = st.sampled_from(["uint8", "int16", "int32", "float16", "float32", "float64", "bool"])


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(dtype=_dtypes, shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=6)))
def test_array_digest_ignores_layout_and_sees_every_value(array: np.ndarray[Any, Any]) -> None:
    digest = hash_array(array)
    assert hash_array(np.asfortranarray(array)) == digest
    assert hash_array(torch.from_numpy(array.copy())) == digest
    flipped = array.copy().reshape(-1).view(np.uint8)
    flipped[-1] ^= 1
    assert hash_array(flipped.view(array.dtype).reshape(array.shape)) != digest


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=4),
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=4),
                  st.lists(st.integers(), max_size=3)),
        max_size=5,
    )
)  # fmt: skip
def test_context_digest_is_independent_of_insertion_order(context: dict[str, Any]) -> None:
    reordered = dict(reversed(list(context.items())))
    assert hash_array(np.zeros(2), context=context) == hash_array(np.zeros(2), context=reordered)


# --- dispatch ----------------------------------------------------------------------------


def test_hash_content_dispatches_by_type_and_modality() -> None:
    image = Image.fromarray(rgb_array())
    clip = np.ones(10, np.float32)
    frames = RNG.integers(0, 256, (2, 3, 3, 3), dtype=np.uint8)
    assert hash_content(image) == hash_image(image)
    assert hash_content((clip, 8000)) == hash_audio(clip, 8000)
    assert hash_content(np.asarray(image), modality="image") == hash_image(np.asarray(image))
    assert hash_content(frames, modality="video") == hash_video(frames)
    assert hash_content(list(frames), modality="video") == hash_video(frames)
    assert hash_content(clip) == hash_array(clip)
    assert hash_content(b"abc", modality="audio") == hash_bytes(b"abc", modality="audio")
    assert hash_content("u1", namespace="t") == hash_identifier("u1", namespace="t")
    precomputed = hash_identifier("u1", namespace="t")
    assert hash_content(precomputed) is precomputed


# --- bad input -----------------------------------------------------------------------------

BAD_INPUTS = [
    (lambda: hash_image(Image.new("RGB", (0, 4))), ValueError, "non-empty image, found size 0x4"),
    (lambda: hash_image(np.zeros((0, 3, 3), np.uint8)), ValueError, "non-empty image"),
    (lambda: hash_image(np.zeros((2, 2), np.float32)), TypeError, "pixel values, found float32"),
    (lambda: hash_image(np.zeros((2, 2, 5), np.uint8)), ValueError, "found shape (2, 2, 5)"),
    (lambda: hash_image(np.zeros((3, 2, 2, 1), np.uint8)), ValueError, "1 to 4 channels last"),
    (lambda: hash_image(np.array([["a"]])), TypeError, "numeric dtype"),
    (lambda: hash_image([[0]]), TypeError, "PIL.Image.Image, a uint8 numpy.ndarray"),
    (lambda: hash_image(b"\xff\xd8"), TypeError, "found bytes"),
    (lambda: hash_audio(np.zeros(0, np.float32), 16000), ValueError, "non-empty clip"),
    (lambda: hash_audio(np.zeros((1, 2, 3)), 16000), ValueError, "(channels, samples)"),
    (lambda: hash_audio(np.array([object()]), 16000), TypeError, "numeric dtype"),
    (lambda: hash_audio(np.array(["a", "b"]), 16000), TypeError, "found <U1"),
    (lambda: hash_audio(np.ones(4), 0), ValueError, "positive int, found 0"),
    (lambda: hash_audio(np.ones(4), -8000), ValueError, "positive int, found -8000"),
    (lambda: hash_audio(np.ones(4), 16000.0), ValueError, "positive int, found float 16000.0"),
    (lambda: hash_audio(np.ones(4), True), ValueError, "positive int, found bool True"),
    (lambda: hash_audio(np.ones(4), "16000"), ValueError, "positive int, found str '16000'"),
    (lambda: hash_video(np.zeros((0, 2, 2, 3), np.uint8)), ValueError, "at least one frame"),
    (lambda: hash_video([np.zeros((2, 2), np.uint8)], fps=float("nan")), ValueError, "found nan"),
    (lambda: hash_video([np.zeros((2, 2), np.uint8)], fps=float("inf")), ValueError, "found inf"),
    (lambda: hash_video([np.zeros((2, 2), np.uint8)], fps=0), ValueError, "found 0"),
    (lambda: hash_video([np.zeros((2, 2), np.uint8), "f"]), TypeError, "frames[1]: expected"),
    (lambda: hash_video(np.zeros((2, 2), np.uint8)), ValueError, "found shape (2, 2)"),
    (lambda: hash_array([1, 2]), TypeError, "found list"),
    (lambda: hash_array(np.array([None])), TypeError, "found object"),
    (lambda: hash_bytes(b"", modality="image"), ValueError, "non-empty bytes, found 0 bytes"),
    (lambda: hash_bytes(b"x", modality=""), ValueError, "modality: expected a non-empty str"),
    (lambda: hash_bytes("x", modality="image"), TypeError, "found str"),  # type: ignore[arg-type]
    (lambda: hash_identifier("", namespace="n"), ValueError, "identifier: expected a non-empty"),
    (lambda: hash_identifier(5, namespace="n"), TypeError, "identifier: expected a str, found int"),  # type: ignore[arg-type]
    (lambda: hash_identifier("x", namespace=None), TypeError, "namespace: expected a str"),  # type: ignore[arg-type]
    (lambda: hash_array(np.ones(1), algorithm="md5"), ValueError, "found 'md5'"),  # type: ignore[arg-type]
    (lambda: hash_array(np.ones(1), context={1: 2}), TypeError, "expected str keys, found int"),  # type: ignore[dict-item]
    (lambda: hash_array(np.ones(1), context={"k": {1.5}}), TypeError, "context['k']: expected"),
    (lambda: hash_array(np.ones(1), context=[("k", 1)]), TypeError, "mapping or None"),  # type: ignore[arg-type]
    (lambda: hash_content(3.5), TypeError, "found float"),
    (lambda: hash_content(b"x"), ValueError, "modality for encoded bytes"),
    (lambda: hash_content("uuid"), ValueError, "namespace for a str identifier"),
    (lambda: hash_content(np.ones(2), modality="audio"), ValueError, "found 'audio'"),
    (lambda: hash_content(ContentHash(b"x" * 16)), ValueError, "32-byte blake3 ContentHash"),
    (lambda: hash_image(Image.new("L", (3, 0))), ValueError, "found size 3x0"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "fragment"), BAD_INPUTS)
def test_bad_input_raises_naming_expected_and_found(
    call: Any, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert fragment in str(info.value)
