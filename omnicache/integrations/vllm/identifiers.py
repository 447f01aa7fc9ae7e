"""vLLM's multimodal inputs -> identifiers: each item's `hashing` digest in hex.

`content_identifier`, `multi_modal_uuids` and `make_mm_features` turn vLLM's
multimodal inputs (PIL images, ``(waveform, sampling_rate)`` audio, video
arrays) into identifiers through `hashing`, so that the keys the engine
computes equal the keys omnicache computes for the same prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hashing import (
    DEFAULT_ALGORITHM,
    Algorithm,
    ContentHash,
    digest_size,
    hash_audio,
    hash_bytes,
    hash_image,
    hash_video,
)
from omnicache.checks import check_str, type_name
from omnicache.integrations.vllm.common import require_vllm

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = [
    "SUPPORTED_MODALITIES",
    "UUID_NAMESPACE",
    "content_identifier",
    "make_mm_features",
    "multi_modal_uuids",
]

UUID_NAMESPACE = "omnicache.vllm.mm_uuid"
"""Namespace (``UUID_NAMESPACE/<modality>``) under which an identifier that is
not a hex digest (a client's uuid) is hashed before it enters a key."""

SUPPORTED_MODALITIES = ("image", "audio", "video")


def content_identifier(
    item: object,
    /,
    *,
    modality: str,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> str:
    """The identifier of one vLLM multimodal item: its `hashing` digest in hex.

    Args:
        item: for "image" a PIL image or a uint8 array/tensor; for "audio" a
            ``(waveform, sampling_rate)`` tuple as vLLM takes it; for "video"
            an array/tensor ``(frames, height, width[, channels])`` or a list
            of frames; for any modality the encoded file's bytes or a
            precomputed `hashing.ContentHash`.
        modality: one of `SUPPORTED_MODALITIES`.
        algorithm: the content digest's algorithm ("blake3" by default).
        context: processing parameters that change what the model sees (model
            id, resize settings); they enter the digest.

    Returns:
        The digest as lowercase hex: what `RequestBlockHasher` reads back from
        ``MultiModalFeatureSpec.identifier``.
    """
    check_str("modality", modality)
    if modality not in SUPPORTED_MODALITIES:
        raise ValueError(f"modality: expected one of {SUPPORTED_MODALITIES}, found {modality!r}")
    if isinstance(item, ContentHash):
        if len(item) != digest_size(algorithm):
            raise ValueError(
                f"item: expected a {digest_size(algorithm)}-byte {algorithm} ContentHash, "
                f"found {len(item)} bytes"
            )
        return item.hex()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return hash_bytes(item, modality=modality, algorithm=algorithm, context=context).hex()
    if modality == "audio":
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                "item: expected for audio a (waveform, sampling_rate) tuple, encoded bytes or "
                f"a ContentHash, found {type_name(item)}"
            )
        waveform, sampling_rate = item
        return hash_audio(waveform, sampling_rate, algorithm=algorithm, context=context).hex()
    if modality == "image":
        return hash_image(item, algorithm=algorithm, context=context).hex()
    return hash_video(item, algorithm=algorithm, context=context).hex()


def _modality_items(mm_data: Mapping[str, object], what: str) -> dict[str, list[object]]:
    """vLLM's per-modality data as lists: a list holds several items, anything else is one."""
    if not isinstance(mm_data, Mapping):
        raise TypeError(f"{what}: expected a mapping modality -> items, found {type_name(mm_data)}")
    items: dict[str, list[object]] = {}
    for modality, data in mm_data.items():
        if modality not in SUPPORTED_MODALITIES:
            raise ValueError(
                f"{what}: expected modalities among {SUPPORTED_MODALITIES}, found {modality!r}"
            )
        items[modality] = list(data) if isinstance(data, list) else [data]
    return items


def multi_modal_uuids(
    mm_data: Mapping[str, object],
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> dict[str, list[str]]:
    """The ``multi_modal_uuids`` of a vLLM prompt: each item's `content_identifier`.

    Pass the result as the prompt's ``"multi_modal_uuids"`` next to its
    ``"multi_modal_data"``: vLLM then uses these identifiers for every cache,
    prefix caching included, instead of hashing the items itself.

    NOTE: vLLM re-hashes a provided uuid together with ``mm_processor_kwargs``
    or ``media_io_kwargs`` when a prompt has them; put such parameters in
    ``context`` instead, or the engine's identifiers are vLLM's digests (still
    content keys, but not the ones omnicache computes).

    Args:
        mm_data: modality -> one item or a list of items, as in
            ``multi_modal_data`` (see `content_identifier` for the item types).

    Returns:
        modality -> identifiers, in the order of the items.
    """
    return {
        modality: [
            content_identifier(item, modality=modality, algorithm=algorithm, context=context)
            for item in items
        ]
        for modality, items in _modality_items(mm_data, "mm_data").items()
    }


def make_mm_features(
    mm_data: Mapping[str, object],
    mm_placeholders: Mapping[str, Sequence[PlaceholderRange]],
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> list[MultiModalFeatureSpec]:
    """``MultiModalFeatureSpec``s whose identifiers are omnicache content digests.

    Args:
        mm_data: modality -> one item or a list of items.
        mm_placeholders: modality -> one ``PlaceholderRange`` per item, in
            the same order (what vLLM's processor returns).

    Returns:
        One feature per item, sorted by placeholder offset as vLLM sorts
        them, with ``identifier == mm_hash ==`` the item's digest in hex and
        no processed data.
    """
    require_vllm()
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    items = _modality_items(mm_data, "mm_data")
    if not isinstance(mm_placeholders, Mapping):
        raise TypeError(
            "mm_placeholders: expected a mapping modality -> PlaceholderRanges, found "
            f"{type_name(mm_placeholders)}"
        )
    if set(mm_placeholders) != set(items):
        raise ValueError(
            f"mm_placeholders: expected the modalities of mm_data {sorted(items)}, "
            f"found {sorted(mm_placeholders)}"
        )
    features: list[MultiModalFeatureSpec] = []
    for modality, modality_items in items.items():
        ranges = list(mm_placeholders[modality])
        if len(ranges) != len(modality_items):
            raise ValueError(
                f"mm_placeholders[{modality!r}]: expected {len(modality_items)} ranges (one per "
                f"item), found {len(ranges)}"
            )
        for index, (item, position) in enumerate(zip(modality_items, ranges, strict=True)):
            if not isinstance(position, PlaceholderRange):
                raise TypeError(
                    f"mm_placeholders[{modality!r}][{index}]: expected a PlaceholderRange, "
                    f"found {type_name(position)}"
                )
            identifier = content_identifier(
                item, modality=modality, algorithm=algorithm, context=context
            )
            features.append(
                MultiModalFeatureSpec(
                    data=None,
                    modality=modality,
                    identifier=identifier,
                    mm_position=position,
                    mm_hash=identifier,
                )
            )
    features.sort(key=lambda feature: feature.mm_position.offset)
    return features
