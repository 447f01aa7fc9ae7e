"""One identity for every multimodal item: what the model's processor receives, nothing else.

Every path that names an item goes through `item_identity`: prompt
annotation (`omnicache.annotate_prompt`), the ``omnicache hash`` command,
`multi_modal_uuids` and the front end's rule in the vLLM integration, the demo
and its traces. An item's identity is a `hashing` digest over what vLLM 0.32
and 0.33 hand the model's processor for it, so two items the model computes
differently never share an identity, and one item has one identity whichever
form it arrives in (a PIL object, a file's bytes, a data URL, a file, or what
the server's media loaders decoded from an upload).

What an identity covers, by modality (`split_items` says how vLLM cuts a
prompt's ``multi_modal_data`` into items, and so which form each item has):

- image, a picture (a PIL image; the bytes, data URL or file of one, decoded
  as vLLM's server decodes an upload, `omnicache.media.decode_image`): the
  picture the processor receives. A PIL object is made upright and RGB over
  white first, as vLLM's parser makes it (`omnicache.media.model_image`); a
  picture the server's loader decoded (vLLM's ``MediaWithBytes``) is taken as
  decoded, since the parser leaves it as it is. Then `hashing.hash_image`:
  mode, size, palette, transparency key, pixels. A PNG and a lossless
  re-encode of its pixels share one identity; EXIF data other than the
  orientation does not enter (vLLM's parser drops it too).
- image, an array (numpy or torch, any dtype): its dtype, shape and values.
- video, frames (an array ``(frames, ...)``, or a list of PIL images or of
  arrays) and, when given as vLLM's ``(frames, metadata)``, every field of
  the metadata whatever the loader put in it (fps, frame indices, duration,
  total frames, sampling flags, backend, ...): M-RoPE models place frames in
  time by it. A list of PIL frames is digested frame by frame as pictures
  (mode and palette included); a list of arrays as the array they stack to.
- audio, samples (an array, a torch tensor or a list of floats; a
  ``(samples, sampling_rate)`` tuple; the bytes, data URL or file of a clip,
  decoded as vLLM's server decodes one, `omnicache.media.decode_audio`):
  the samples' dtype, shape and values, and the sampling rate (as a float;
  None where vLLM is given none and resamples nothing). vLLM resamples to
  the model's rate and mixes channels from these alone.
- any modality, embeddings (a 2-d torch tensor where vLLM takes embeddings):
  dtype, shape and values, under a form of their own.

A numpy array and a torch tensor of equal dtype, shape and values have one
identity (`hashing.hash_array`). A form that cannot be identified exactly (an
unknown type, a metadata value of a type without a canonical encoding, a
video file, whose frames depend on the server's loader settings) raises
`UnidentifiableItemError` naming what was expected and what was found: never
a partial identity. The request-level processor and media settings
(``mm_processor_kwargs``, ``media_io_kwargs``) are not part of an identity:
vLLM folds them into the identifier it derives from it (docs/vllm.md,
"Identifiers and tenants").

`tenant_identifier` scopes an identifier to a ``cache_salt``: the identifier
vLLM receives for a tenant's item, so that none of the caches vLLM keys by it
(processor cache, encoder cache, encoder-cache connectors, prefix keys) is
shared across salts. The byte layout (``IDENTITY_SCHEME``) is pinned by
``tests/vectors/identity_v1.json``.
"""

from __future__ import annotations

import base64
import binascii
import math
import numbers
import os
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from hashing import (
    DEFAULT_ALGORITHM,
    Algorithm,
    ContentHash,
    Encoder,
    canonical_context,
    hash_array,
    hash_image,
    hash_video,
)
from omnicache.checks import check_str, type_name
from omnicache.media import (
    DEFAULT_SERIES,
    VLLM_RULES,
    MediaRules,
    decode_audio,
    decode_image,
    model_image,
    read_file,
)

__all__ = [
    "IDENTITY_SCHEME",
    "Item",
    "UnidentifiableItemError",
    "item_identity",
    "split_items",
    "tenant_identifier",
]

IDENTITY_SCHEME = "omnicache.identity/v1"
MODALITIES = ("image", "audio", "video")
# How the processor receives an item, by modality; "embeddings" in each.
FORMS: dict[str, tuple[str, ...]] = {
    "image": ("picture", "array", "embeddings"),
    "video": ("frames", "embeddings"),
    "audio": ("samples", "embeddings"),
}


class UnidentifiableItemError(TypeError):
    """An item in a form that cannot be identified exactly (the message says why)."""


class Item(NamedTuple):
    """One item of a prompt's ``multi_modal_data``, as vLLM's parser cuts it.

    Attributes:
        form: how the processor receives it, one of ``FORMS[modality]``.
        value: the item as given (None: sent without data, by uuid only).
    """

    form: str
    value: object


# -- vLLM's cut of a modality's data into items -----------------------------------------


def _torch_tensor(value: object) -> bool:
    # NOTE: torch is looked up, never imported: a tensor's caller has imported it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _array(value: object) -> bool:
    return isinstance(value, np.ndarray) or _torch_tensor(value)


def _media_with_bytes(value: object) -> bool:
    """vLLM's ``MediaWithBytes``: a decoded upload beside its bytes (no vLLM import here)."""
    return type(value).__name__ == "MediaWithBytes" and hasattr(value, "original_bytes")


def _first_is(data: object, test: Any) -> bool:
    """vLLM's ``is_list_of(data, ...) and len(data) > 0``: a list whose first item passes."""
    return isinstance(data, list) and len(data) > 0 and bool(test(data[0]))


def _embeddings(data: object) -> bool:
    """vLLM's test for embeddings (``MultiModalDataParser.is_embeddings``)."""
    if _torch_tensor(data):
        return data.ndim == 3  # type: ignore[attr-defined, no-any-return]
    return _first_is(data, _torch_tensor) and data[0].ndim == 2  # type: ignore[index]


def split_items(data: object, /, *, modality: str) -> list[Item]:
    """A modality's ``multi_modal_data`` cut into items as vLLM 0.32 and 0.33 cut it.

    vLLM's parser (``vllm/multimodal/parse.py``) decides by the data's shape
    what is one item and what is several: a list of PIL images is two images
    but one video; a 3-d torch tensor is a batch of embeddings, a 3-d numpy
    array one picture; a list of floats is one clip, a 2-d array several.
    Anything else is taken as one item (a file's bytes, a data URL).

    Raises:
        UnidentifiableItemError: data vLLM cuts by the model's own rules (a
            mapping of embedding fields).
    """
    _check_modality(modality)
    if isinstance(data, Mapping):
        raise UnidentifiableItemError(
            f"multi_modal_data[{modality!r}]: expected items, found a mapping of "
            f"{sorted(map(str, data))} (embedding fields, cut into items by the model)"
        )
    if _embeddings(data):
        return [Item("embeddings", data[index]) for index in range(len(data))]  # type: ignore[index, arg-type]
    if _one_item(data, modality):
        return [Item(_plain_form(modality, data), data)]
    if _array(data):
        return [Item(_plain_form(modality, row), row) for row in data]  # type: ignore[attr-defined]
    if isinstance(data, (list, tuple)):
        return [Item(_plain_form(modality, item), item) for item in data]
    return [Item(_plain_form(modality, data), data)]


def _one_item(data: object, modality: str) -> bool:
    """Whether vLLM's parser takes a modality's whole data as one item."""
    if modality == "image":
        return (
            isinstance(data, Image.Image)
            or _media_with_bytes(data)
            or (_array(data) and data.ndim == 3)  # type: ignore[attr-defined]
        )
    if modality == "audio":
        return (
            _first_is(data, lambda sample: isinstance(sample, float))
            or (_array(data) and data.ndim == 1)  # type: ignore[attr-defined]
            or isinstance(data, tuple)
        )
    return (
        _first_is(data, lambda frame: isinstance(frame, Image.Image))
        or (
            isinstance(data, list)
            and len(data) > 0
            and all(_array(frame) and frame.ndim == 3 for frame in data)
        )
        or (_array(data) and data.ndim == 4)  # type: ignore[attr-defined]
        or (isinstance(data, tuple) and len(data) == 2)
    )


def _plain_form(modality: str, value: object) -> str:
    """The form of an item of data vLLM did not take as embeddings."""
    if modality == "image":
        return "array" if _array(value) else "picture"
    return "frames" if modality == "video" else "samples"


def _single_form(modality: str, value: object) -> str:
    """The form of ``value`` as the one item of a list (``multi_modal_data[m] = [value]``)."""
    return "embeddings" if _embeddings([value]) else _plain_form(modality, value)


def _check_modality(modality: object) -> str:
    check_str("modality", modality)
    if modality not in MODALITIES:
        raise ValueError(f"modality: expected one of {MODALITIES}, found {modality!r}")
    return modality


# -- identities ----------------------------------------------------------------------


def item_identity(
    item: object,
    /,
    *,
    modality: str,
    form: str | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    rules: MediaRules = VLLM_RULES[DEFAULT_SERIES],
    context: Mapping[str, object] | None = None,
) -> ContentHash:
    """The identity of one item: a digest of what the model's processor receives for it.

    Args:
        item: one item of ``modality`` in any form the module lists: a PIL
            image, an array or tensor, ``(frames, metadata)``, ``(samples,
            sampling_rate)``, a list of frames or of floats, vLLM's
            ``MediaWithBytes``, a file's bytes, a ``data:`` URL, a
            ``file://`` URL or a `os.PathLike` path.
        modality: one of `MODALITIES`.
        form: how the processor receives it (`split_items` tells); None:
            as the one item of a list.
        algorithm: the digest's algorithm ("blake3" by default).
        rules: the vLLM series' rules pictures are made RGB and files are
            decoded by (`omnicache.media.VLLM_RULES`).
        context: processing parameters of the caller's that change what the
            model computes (they enter the digest).

    Raises:
        UnidentifiableItemError: a form that cannot be identified exactly.
        ValueError: an item that is malformed for its form (an empty array,
            a sampling rate that is not a positive number, a file that
            cannot be decoded: `omnicache.media.MediaError`).
    """
    _check_modality(modality)
    encoded_context = canonical_context(context)
    value = _decoded_source(item, modality, rules)
    if form is None:
        form = _single_form(modality, value)
    if form not in FORMS[modality]:
        raise ValueError(f"form: expected one of {FORMS[modality]} for {modality}, found {form!r}")
    encoder = Encoder(algorithm, "identity")
    encoder.field("scheme", IDENTITY_SCHEME)
    encoder.field("modality", modality)
    encoder.field("form", form)
    fields = _FIELDS[form](value, modality, algorithm, rules)
    for name, field in fields:
        encoder.field(name, field)
    encoder.context(encoded_context)
    return ContentHash(encoder.digest())


def tenant_identifier(
    identifier: str, /, *, cache_salt: str | None, algorithm: Algorithm = DEFAULT_ALGORITHM
) -> str:
    """The identifier vLLM receives for a tenant's item: ``identifier`` scoped to ``cache_salt``.

    vLLM keys its processor cache, its encoder cache, encoder-cache
    connectors and (through omnicache's block keys) its prefix cache by an
    item's identifier. Scoped to the salt, none of them is shared across
    tenants: a tenant cannot tell by timing which items another sent.
    Without a salt an identifier is returned as it is (items are shared).

    Args:
        identifier: the item's identifier (an identity in hex, or the one
            vLLM made itself for an item omnicache does not identify).
        cache_salt: the request's ``cache_salt`` (None or "": no tenant).

    Returns:
        A digest in lowercase hex, which the engine core takes as content.
    """
    check_str("identifier", identifier, nonempty=True)
    if cache_salt is None or cache_salt == "":
        return identifier
    check_str("cache_salt", cache_salt)
    encoder = Encoder(algorithm, "tenant identifier")
    encoder.field("scheme", IDENTITY_SCHEME)
    encoder.field("cache_salt", cache_salt)
    encoder.field("identifier", identifier)
    return encoder.digest().hex()


# -- what each form covers --------------------------------------------------------------

Fields = list[tuple[str, object]]


def _decoded_source(item: object, modality: str, rules: MediaRules) -> object:
    """An encoded item (bytes, a data URL, a file) decoded as the server decodes an upload."""
    if isinstance(item, ContentHash):
        raise UnidentifiableItemError(
            f"item: expected the {modality} itself, found a ContentHash (a digest names an "
            "item already identified; pass it where digests are taken)"
        )
    source: str | os.PathLike[str]
    if isinstance(item, (bytes, bytearray, memoryview)):
        data, source = bytes(item), "<bytes>"
    elif isinstance(item, os.PathLike):
        data, source = read_file(item), item
    elif isinstance(item, str):
        data, source = _read_url(item, modality), f"{item[:40]}..." if len(item) > 40 else item
    else:
        return item
    if modality == "image":
        return decode_image(data, rules=rules, source=source)
    if modality == "audio":
        clip = decode_audio(data, rules=rules, source=source)
        return (clip.waveform, float(clip.sample_rate))
    raise UnidentifiableItemError(
        f"{source}: expected a video's frames and metadata, found an encoded video; its "
        "frames depend on the server's video loader and its settings (backend, num_frames, "
        "fps): pass the (frames, metadata) that loader makes of it"
    )


def _read_url(url: str, modality: str) -> bytes:
    if url.startswith("data:"):
        header, comma, payload = url[5:].partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError(
                f"item: expected a data URL 'data:<type>;base64,<data>', found {url[:40]!r}"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"item: expected base64 data in the data URL, found {exc}") from None
    if url.startswith("file://"):
        return read_file(url[len("file://") :])
    raise UnidentifiableItemError(
        f"item: expected a {modality} (or the bytes, a data: or a file:// URL of one), found "
        f"the str {url[:40]!r}; an identity reads no network: fetch the URL's bytes first"
    )


def _picture(value: object, modality: str, algorithm: Algorithm, rules: MediaRules) -> Fields:
    if _media_with_bytes(value):
        value = value.media  # type: ignore[attr-defined]
    elif isinstance(value, Image.Image):
        value = model_image(value, rules=rules)
    if not isinstance(value, Image.Image):
        raise UnidentifiableItemError(
            f"item: expected a picture (a PIL image, or the bytes, data URL or file of one), "
            f"found {type_name(value)}"
        )
    return [("content", bytes(hash_image(value, algorithm=algorithm)))]


def _array_fields(value: object, modality: str, algorithm: Algorithm, rules: MediaRules) -> Fields:
    if not _array(value):
        raise UnidentifiableItemError(
            f"item: expected a numpy array or torch tensor, found {type_name(value)}"
        )
    return [("content", bytes(hash_array(value, algorithm=algorithm)))]


def _samples(value: object, modality: str, algorithm: Algorithm, rules: MediaRules) -> Fields:
    rate: object = None
    if isinstance(value, tuple):
        if len(value) != 2:
            raise UnidentifiableItemError(
                f"item: expected (samples, sampling_rate), found a tuple of {len(value)}"
            )
        value, rate = value
        if rate is not None:
            if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
                raise ValueError(
                    f"sampling_rate: expected a positive number or None, found {type_name(rate)}"
                )
            rate = float(rate)
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"sampling_rate: expected a positive number, found {rate}")
    if isinstance(value, list):
        if not all(isinstance(sample, numbers.Real) for sample in value):
            raise UnidentifiableItemError("item: expected a list of numbers as samples")
        value = np.array(value)  # what vLLM makes of a list of samples
    if not _array(value):
        raise UnidentifiableItemError(
            "item: expected audio as samples (an array, a tensor or a list of floats), a "
            f"(samples, sampling_rate) tuple, or the bytes, data URL or file of a clip, found "
            f"{type_name(value)}"
        )
    if value.size == 0:  # type: ignore[attr-defined]
        raise ValueError("samples: expected at least one sample, found none")
    return [("content", bytes(hash_array(value, algorithm=algorithm))), ("sampling_rate", rate)]


def _frames(value: object, modality: str, algorithm: Algorithm, rules: MediaRules) -> Fields:
    if _media_with_bytes(value):
        value = value.media  # type: ignore[attr-defined]
    metadata: object = None
    if isinstance(value, tuple):
        if len(value) != 2:
            raise UnidentifiableItemError(
                f"item: expected (frames, metadata), found a tuple of {len(value)}"
            )
        value, metadata = value
        if _media_with_bytes(value):
            value = value.media  # type: ignore[attr-defined]
        if not isinstance(metadata, Mapping):
            raise UnidentifiableItemError(
                f"item: expected (frames, metadata) with a dict of metadata, found "
                f"{type_name(metadata)} as metadata"
            )
        metadata = _canonical(metadata, "metadata")
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(frame, Image.Image) for frame in value):
            content = hash_video(list(value), algorithm=algorithm)
            return [("content", bytes(content)), ("frames_as", "pictures"), ("metadata", metadata)]
        if all(_array(frame) for frame in value):
            try:
                value = np.stack([np.asarray(frame) for frame in value])
            except ValueError as exc:
                raise ValueError(f"frames: expected frames of one shape, found {exc}") from None
    if not _array(value):
        raise UnidentifiableItemError(
            "item: expected a video as frames (an array, or a list of PIL images or of "
            f"arrays), or (frames, metadata), found {type_name(value)}"
        )
    if value.size == 0:  # type: ignore[attr-defined]
        raise ValueError("frames: expected at least one frame, found none")
    content = hash_array(value, algorithm=algorithm)
    return [("content", bytes(content)), ("frames_as", "array"), ("metadata", metadata)]


_FIELDS = {
    "picture": _picture,
    "array": _array_fields,
    "embeddings": _array_fields,
    "samples": _samples,
    "frames": _frames,
}


def _canonical(value: object, path: str) -> object:
    """A metadata value in the canonical encoding's types, or UnidentifiableItemError.

    numpy's bools, integers and 64-bit floats are the Python values they
    equal (arithmetic on them gives the same results); anything without an
    exact canonical form is refused rather than approximated.
    """
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float):  # np.float64 included
        return float(value)
    if isinstance(value, Mapping):
        result: dict[str, object] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise UnidentifiableItemError(
                    f"{path}: expected str keys, found the {type_name(key)} key {key!r}"
                )
            result[key] = _canonical(item, f"{path}[{key!r}]")
        return result
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{path}[{index}]") for index, item in enumerate(value)]
    raise UnidentifiableItemError(
        f"{path}: expected None, bool, int, float, str, bytes, a list or a dict, found "
        f"{type_name(value)} (no exact canonical form)"
    )
