"""omnicache.identity: what an item's identity covers, in every form, and its tenant scope.

Three properties, over items and their variations (hypothesis):
- two items the model computes differently never share an identity (each
  picture change the processor sees, each video metadata field, sampling
  rates, sample types, alpha over the background, EXIF orientation, forms);
- one item has one identity in every form it is accepted in (a PIL object,
  its PNG bytes, a data URL, a file, a file:// URL, a lossless re-encode, the
  server's decoded upload; an int or a float rate; numpy or torch);
- one identifier under two salts is never one identifier.
The byte layout is pinned by ``tests/vectors/identity_v1.json``.
"""

from __future__ import annotations

import base64
import io
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from identity_inputs import CASES
from PIL import ExifTags, Image

from hashing import ALGORITHMS, hash_array, hash_image
from omnicache.identity import (
    IDENTITY_SCHEME,
    Item,
    UnidentifiableItemError,
    item_identity,
    split_items,
    tenant_identifier,
)
from omnicache.media import VLLM_RULES, MediaError

VECTORS = json.loads((Path(__file__).parent / "vectors" / "identity_v1.json").read_text())
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Decoded:
    """Shaped like vLLM's ``MediaWithBytes``: what its loaders make of an upload."""

    def __init__(self, media: object, original_bytes: bytes) -> None:
        self.media = media
        self.original_bytes = original_bytes


Decoded.__name__ = "MediaWithBytes"


def image_id(item: object, **kwargs: Any) -> bytes:
    return item_identity(item, modality="image", **kwargs)


def audio_id(item: object, **kwargs: Any) -> bytes:
    return item_identity(item, modality="audio", **kwargs)


def video_id(item: object, **kwargs: Any) -> bytes:
    return item_identity(item, modality="video", **kwargs)


def encoded(image: Image.Image, fmt: str = "PNG", **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


pixels = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1)).map(
    lambda spec: np.random.default_rng(spec[2]).integers(
        0, 256, (spec[0], spec[1], 3), dtype=np.uint8
    )
)
clips = st.tuples(st.integers(1, 64), st.integers(0, 2**32 - 1)).map(
    lambda spec: np.random.default_rng(spec[1]).standard_normal(spec[0]).astype(np.float32)
)
rates = st.sampled_from([8_000, 16_000, 22_050, 24_000, 44_100, 48_000])


# -- two items the model computes differently: two identities ----------------------------


@PROPERTY
@given(pixels, st.data())
def test_every_change_the_processor_sees_in_a_picture_changes_its_identity(
    array: np.ndarray[Any, Any], data: st.DataObject
) -> None:
    changed = array.copy()
    y = data.draw(st.integers(0, array.shape[0] - 1))
    x = data.draw(st.integers(0, array.shape[1] - 1))
    c = data.draw(st.integers(0, 2))
    changed[y, x, c] ^= data.draw(st.integers(1, 255))
    base = image_id(Image.fromarray(array))
    assert image_id(Image.fromarray(changed)) != base
    # The same bytes in another shape are another picture.
    if array.shape[0] != array.shape[1]:
        reshaped = array.reshape(array.shape[1], array.shape[0], 3)
        assert image_id(Image.fromarray(reshaped)) != base
    # A picture and an array of its pixels reach the processor differently.
    assert image_id(array) != base


@PROPERTY
@given(pixels, st.integers(0, 2**32 - 1), st.tuples(*[st.integers(0, 255)] * 3))
def test_alpha_is_what_it_makes_of_the_picture_over_the_background(
    array: np.ndarray[Any, Any], seed: int, background: tuple[int, int, int]
) -> None:
    alpha = np.random.default_rng(seed).integers(0, 256, array.shape[:2], dtype=np.uint8)
    rgba = Image.fromarray(np.dstack([array, alpha]), "RGBA")
    rules = VLLM_RULES["0.32"]
    # vLLM composites through the alpha mask over white (a request's colour for uploads).
    for colour in ((255, 255, 255), background):
        flat = Image.new("RGB", rgba.size, colour)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        from dataclasses import replace

        assert image_id(rgba, rules=replace(rules, background=colour)) == image_id(flat)
    opaque = Image.fromarray(np.dstack([array, np.full_like(alpha, 255)]), "RGBA")
    assert image_id(opaque) == image_id(Image.fromarray(array))
    if (alpha != 255).any():
        assert image_id(rgba) != image_id(Image.fromarray(array))


# EXIF orientation -> the array operation that turns the stored pixels upright.
UPRIGHT = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),
}


@PROPERTY
@given(pixels, st.integers(1, 8))
def test_a_picture_is_identified_upright_as_its_exif_orientation_says(
    array: np.ndarray[Any, Any], orientation: int
) -> None:
    stored = Image.fromarray(array)
    exif = stored.getexif()
    exif[ExifTags.Base.Orientation] = orientation
    tagged = Image.open(io.BytesIO(encoded(stored, exif=exif.tobytes())))
    upright = UPRIGHT.get(orientation, lambda a: a)(array)
    assert image_id(tagged) == image_id(Image.fromarray(np.ascontiguousarray(upright)))
    if orientation > 1 and not np.array_equal(upright, array):
        assert image_id(tagged) != image_id(Image.fromarray(array))  # the pixels as stored


METADATA = {
    "total_num_frames": 8,
    "fps": 2.0,
    "duration": 4.0,
    "video_backend": "opencv",
    "frames_indices": [0, 1, 2, 3, 4, 5, 6, 7],
    "do_sample_frames": False,
}
metadata_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)


@PROPERTY
@given(st.sampled_from([*METADATA, "frame_sample_mode"]), metadata_values)
def test_every_metadata_field_of_a_video_enters_its_identity(field: str, value: object) -> None:
    frames = np.zeros((8, 4, 4, 3), dtype=np.uint8)
    base = video_id((frames, METADATA))
    changed = {**METADATA, field: value}
    if changed == METADATA and type(value) is type(METADATA.get(field)):
        assert video_id((frames, changed)) == base
    else:
        assert video_id((frames, changed)) != base
    # Without metadata the frames are another item again.
    assert video_id(frames) not in (base, video_id((frames, changed)))


def test_metadata_is_read_by_its_fields_not_their_order_or_numpy_types() -> None:
    frames = np.zeros((8, 4, 4, 3), dtype=np.uint8)
    shuffled = dict(reversed(list(METADATA.items())))
    numpy_typed = {
        **METADATA,
        "total_num_frames": np.int64(8),
        "fps": np.float64(2.0),
        "do_sample_frames": np.bool_(False),
        "frames_indices": [np.int32(i) for i in range(8)],
    }
    base = video_id((frames, METADATA))
    assert video_id((frames, shuffled)) == base
    assert video_id((frames, numpy_typed)) == base
    # 2 and 2.0 and True are kept apart: a processor may compute with their types.
    assert video_id((frames, {**METADATA, "fps": 2})) != base
    assert len({video_id((frames, {"x": v})) for v in (1, 1.0, True, "1", [1], b"1")}) == 6


@PROPERTY
@given(clips, rates, rates)
def test_a_clip_is_its_samples_and_rate(wave: np.ndarray[Any, Any], rate: int, other: int) -> None:
    base = audio_id((wave, rate))
    assert (audio_id((wave, other)) == base) == (rate == other)
    assert audio_id((wave, float(rate))) == base  # 16000 and 16000.0: one rate
    assert audio_id(wave) != base  # no rate: vLLM resamples nothing
    assert audio_id((wave.astype(np.float64), rate)) != base  # other samples' type
    assert audio_id((torch.from_numpy(wave), rate)) == base  # numpy or torch
    flipped = wave.copy()
    flipped[0] = -flipped[0] if flipped[0] != 0 else 1.0
    assert audio_id((flipped, rate)) != base


def test_embeddings_are_a_form_of_their_own() -> None:
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    (embeddings,) = split_items([values], modality="image")
    assert embeddings == Item("embeddings", values)
    as_embeddings = image_id(values, form="embeddings")
    assert as_embeddings == image_id(values)  # alone in a list: embeddings
    assert as_embeddings != image_id(values, form="array")
    assert as_embeddings != item_identity(values, modality="video", form="embeddings")
    assert as_embeddings != image_id(values + 1, form="embeddings")


# -- one item, every form: one identity ------------------------------------------------


@PROPERTY
@given(pixels, st.sampled_from(["PNG", "BMP", "TIFF", "WEBP"]))
def test_a_picture_has_one_identity_in_every_form(array: np.ndarray[Any, Any], fmt: str) -> None:
    picture = Image.fromarray(array)
    base = image_id(picture)
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encoded(picture, fmt, **options)
    assert image_id(data) == base
    assert image_id(bytearray(data)) == base
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"
    assert image_id(url) == base
    assert image_id(Decoded(picture, data)) == base  # the server's decoded upload
    assert image_id(picture.convert("RGBA")) == base  # opaque alpha
    assert image_id(picture.convert("RGBA").convert("RGB")) == base


def test_a_picture_in_a_file_and_a_file_url_has_the_pictures_identity(tmp_path: Path) -> None:
    picture = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    path = tmp_path / "picture.png"
    picture.save(path)
    assert image_id(path) == image_id(f"file://{path}") == image_id(picture)


@PROPERTY
@given(clips, rates)
def test_a_clip_has_one_identity_in_every_form(wave: np.ndarray[Any, Any], rate: int) -> None:
    base = audio_id((wave, rate))
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format="WAV", subtype="FLOAT")
    data = buffer.getvalue()
    assert audio_id(data) == base
    assert audio_id(f"data:audio/wav;base64,{base64.b64encode(data).decode()}") == base
    # A list of floats is what vLLM makes an array of.
    as_list = [float(sample) for sample in wave]
    assert audio_id(as_list) == audio_id(np.array(as_list)) == audio_id((np.array(as_list), None))


@PROPERTY
@given(st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_a_video_has_one_identity_in_every_form(num_frames: int, seed: int) -> None:
    frames = np.random.default_rng(seed).integers(0, 256, (num_frames, 3, 4, 3), dtype=np.uint8)
    base = video_id((frames, METADATA))
    assert video_id((list(frames), METADATA)) == base
    assert video_id((torch.from_numpy(frames), METADATA)) == base
    assert video_id(Decoded((frames, METADATA), b"video file")) == base  # the server's
    assert video_id(list(frames)) == video_id(frames)
    # PIL frames are pictures: mode and palette included.
    pictures = [Image.fromarray(frame) for frame in frames]
    assert video_id((pictures, METADATA)) != base
    assert video_id(([p.convert("P") for p in pictures], METADATA)) != video_id(
        (pictures, METADATA)
    )


# -- tenants ----------------------------------------------------------------------------


@PROPERTY
@given(st.text(min_size=1), st.text(min_size=1), st.sampled_from(ALGORITHMS))
def test_one_item_under_two_salts_is_two_identifiers(a: str, b: str, algorithm: Any) -> None:
    identity = image_id(Image.new("RGB", (2, 2), (1, 2, 3)), algorithm=algorithm).hex()
    scoped = tenant_identifier(identity, cache_salt=a, algorithm=algorithm)
    assert re.fullmatch(r"[0-9a-f]+", scoped)
    assert scoped != identity
    assert (tenant_identifier(identity, cache_salt=b, algorithm=algorithm) == scoped) == (a == b)
    other = image_id(Image.new("RGB", (2, 2), (3, 2, 1)), algorithm=algorithm).hex()
    assert tenant_identifier(other, cache_salt=a, algorithm=algorithm) != scoped


def test_without_a_salt_items_are_shared() -> None:
    assert tenant_identifier("ab" * 32, cache_salt=None) == "ab" * 32
    assert tenant_identifier("ab" * 32, cache_salt="") == "ab" * 32  # vLLM's "no salt" too


# -- vLLM's cut of multi_modal_data into items -----------------------------------------


def test_items_are_cut_as_vllms_parser_cuts_them() -> None:
    picture = Image.new("RGB", (2, 2))
    frames = np.zeros((2, 2, 2, 3), dtype=np.uint8)
    wave = np.zeros(8, dtype=np.float32)
    embeds = torch.zeros(2, 3, 4)
    assert split_items(picture, modality="image") == [Item("picture", picture)]
    assert len(split_items([picture, picture], modality="image")) == 2
    assert [item.form for item in split_items(np.zeros((2, 2, 2, 3)), modality="image")] == [
        "array",
        "array",
    ]
    assert [item.form for item in split_items(embeds, modality="image")] == ["embeddings"] * 2
    # A list of pictures is two images, but one video of two frames.
    assert split_items([picture, picture], modality="video") == [Item("frames", [picture, picture])]
    assert len(split_items([frames, frames], modality="video")) == 2
    assert split_items((frames, METADATA), modality="video") == [Item("frames", (frames, METADATA))]
    assert len(split_items([(frames, METADATA)] * 3, modality="video")) == 3
    # A list of floats is one clip; a 2-d array, a clip a row.
    assert len(split_items([0.5, 0.25], modality="audio")) == 1
    assert len(split_items(np.zeros((3, 8)), modality="audio")) == 3
    assert split_items((wave, 16_000), modality="audio") == [Item("samples", (wave, 16_000))]
    with pytest.raises(
        UnidentifiableItemError,
        match=r"^multi_modal_data\['image'\]: expected items, found a mapping of "
        r"\['image_embeds'\] \(embedding fields, cut into items by the model\)$",
    ):
        split_items({"image_embeds": embeds}, modality="image")


# -- refused, never a partial identity ---------------------------------------------------


@pytest.mark.parametrize(
    ("item", "modality", "error", "message"),
    [
        (
            (np.zeros((2, 2, 2, 3), np.uint8), {"fps": np.float32(2.0)}),
            "video",
            UnidentifiableItemError,
            "metadata['fps']: expected None, bool, int, float, str, bytes, a list or a dict, "
            "found float32 (no exact canonical form)",
        ),
        (
            (np.zeros((2, 2, 2, 3), np.uint8), {1: 2.0}),
            "video",
            UnidentifiableItemError,
            "metadata: expected str keys, found the int key 1",
        ),
        (
            (np.zeros((2, 2, 2, 3), np.uint8), [1, 2]),
            "video",
            UnidentifiableItemError,
            "item: expected (frames, metadata) with a dict of metadata, found list as metadata",
        ),
        (
            b"\x00\x00\x00\x18ftypmp42",
            "video",
            UnidentifiableItemError,
            "<bytes>: expected a video's frames and metadata, found an encoded video; its frames "
            "depend on the server's video loader and its settings (backend, num_frames, fps): "
            "pass the (frames, metadata) that loader makes of it",
        ),
        (
            "https://example.com/cat.png",
            "image",
            UnidentifiableItemError,
            "item: expected a image (or the bytes, a data: or a file:// URL of one), found the "
            "str 'https://example.com/cat.png'; an identity reads no network: fetch the URL's "
            "bytes first",
        ),
        (
            "data:image/png,abc",
            "image",
            ValueError,
            "item: expected a data URL 'data:<type>;base64,<data>', found 'data:image/png,abc'",
        ),
        ((np.zeros(4, np.float32), -1), "audio", ValueError, "sampling_rate: expected a "
         "positive number, found -1.0"),
        ((np.zeros(4, np.float32), "16k"), "audio", ValueError, "sampling_rate: expected a "
         "positive number or None, found str"),
        ((np.zeros(0, np.float32), 16_000), "audio", ValueError, "samples: expected at least "
         "one sample, found none"),
        ({"pixels": 1}, "image", UnidentifiableItemError, "item: expected a picture (a PIL "
         "image, or the bytes, data URL or file of one), found dict"),
        (object(), "audio", UnidentifiableItemError, "item: expected audio as samples (an "
         "array, a tensor or a list of floats), a (samples, sampling_rate) tuple, or the "
         "bytes, data URL or file of a clip, found object"),
    ],
)  # fmt: skip
def test_what_cannot_be_identified_exactly_is_refused_with_the_reason(
    item: object, modality: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        item_identity(item, modality=modality)
    assert str(info.value) == message


def test_a_file_that_does_not_decode_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match=r"^<bytes>: expected an image in a format"):
        image_id(b"not a picture")
    with pytest.raises(MediaError, match=rf"^{re.escape(str(tmp_path / 'absent.png'))}: no such"):
        image_id(tmp_path / "absent.png")
    with pytest.raises(ValueError, match=r"^form: expected one of \('frames', 'embeddings'\) for "
                       r"video, found 'picture'$"):  # fmt: skip
        video_id(np.zeros((1, 2, 2, 3), np.uint8), form="picture")


# -- the byte layout ---------------------------------------------------------------------


def test_vectors_cover_every_form_for_every_algorithm() -> None:
    assert VECTORS["scheme"] == IDENTITY_SCHEME == "omnicache.identity/v1"
    names = {case["name"] for case in VECTORS["cases"]}
    assert names == set(CASES)
    assert {(c["name"], c["algorithm"]) for c in VECTORS["cases"]} == {
        (name, algorithm) for name in CASES for algorithm in ALGORITHMS
    }


@pytest.mark.parametrize(
    "case", VECTORS["cases"], ids=[f"{c['name']}-{c['algorithm']}" for c in VECTORS["cases"]]
)
def test_golden_vector(case: dict[str, str]) -> None:
    assert CASES[case["name"]](case["algorithm"]) == case["digest"]


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x01" + struct.pack("<Q", len(data)) + data


def test_the_layout_is_the_documented_bytes() -> None:
    import hashlib

    wave = np.array([0.5, -0.25], dtype=np.float32)
    content = hash_array(wave, algorithm="sha256")
    expected = hashlib.sha256(
        _str("omnicache.content/v1") + _str("identity")
        + _str("scheme") + _str("omnicache.identity/v1")
        + _str("modality") + _str("audio")
        + _str("form") + _str("samples")
        + _str("content") + b"\x04" + struct.pack("<Q", 32) + content
        + _str("sampling_rate") + b"\x03" + struct.pack("<d", 16000.0)
        + _str("context") + b"\x07" + struct.pack("<Q", 0)
    ).digest()  # fmt: skip
    assert audio_id((wave, 16_000), algorithm="sha256") == expected
    scoped = hashlib.sha256(
        _str("omnicache.content/v1") + _str("tenant identifier")
        + _str("scheme") + _str("omnicache.identity/v1")
        + _str("cache_salt") + _str("tenant-a")
        + _str("identifier") + _str(expected.hex())
    ).hexdigest()  # fmt: skip
    assert tenant_identifier(expected.hex(), cache_salt="tenant-a", algorithm="sha256") == scoped
    picture = Image.new("RGB", (1, 1), (1, 2, 3))
    assert image_id(picture) != hash_image(picture)  # an identity is not a content digest
