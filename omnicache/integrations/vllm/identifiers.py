"""vLLM's multimodal inputs -> identifiers: each item's `hashing` digest in hex.

`content_identifier`, `multi_modal_uuids` and `make_mm_features` turn vLLM's
multimodal inputs (PIL images, ``(waveform, sampling_rate)`` audio, video
arrays) into identifiers through `hashing`, so that the keys the engine
computes equal the keys omnicache computes for the same prompt. A PIL image
is digested as vLLM's processor receives it (`omnicache.media.model_image`:
upright, RGB over white), so one picture has one digest whichever way it
reaches vLLM. `checked_multi_modal_uuids` is a front end's rule for the
uuids clients send (docs/architecture.md, "Identifiers and tenants").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from PIL import Image

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
from omnicache.integrations.vllm.common import require_vllm, vllm_series
from omnicache.media import DEFAULT_SERIES, VLLM_RULES, MediaRules, model_image

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = [
    "HEX_DIGEST",
    "SUPPORTED_MODALITIES",
    "UUID_NAMESPACE",
    "DataLessItemError",
    "IdentifierMismatchError",
    "checked_multi_modal_uuids",
    "content_identifier",
    "make_mm_features",
    "multi_modal_uuids",
]

HEX_DIGEST = re.compile(r"(?:[0-9a-f]{32}){1,2}")
"""A content digest as `hashing` writes it: 16 (xxh3_128) or 32 bytes, lowercase hex.
An identifier of this shape is what `RequestBlockHasher` takes as a digest."""

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
    rules: MediaRules | None = None,
) -> str:
    """The identifier of one vLLM multimodal item: its `hashing` digest in hex.

    Args:
        item: for "image" a PIL image (digested as vLLM's processor receives
            it: `omnicache.media.model_image`) or a uint8 array/tensor; for
            "audio" a ``(waveform, sampling_rate)`` tuple as vLLM takes it;
            for "video" an array/tensor ``(frames, height, width[, channels])``
            or a list of frames; for any modality the encoded file's bytes or
            a precomputed `hashing.ContentHash`.
        modality: one of `SUPPORTED_MODALITIES`.
        algorithm: the content digest's algorithm ("blake3" by default).
        context: processing parameters that change what the model sees (model
            id, resize settings); they enter the digest.
        rules: the vLLM series' rules a PIL image is made RGB by; None: those
            of the installed vLLM (of `omnicache.media.DEFAULT_SERIES` where
            none is importable).

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
        if isinstance(item, Image.Image):
            item = model_image(item, rules=installed_rules() if rules is None else rules)
        return hash_image(item, algorithm=algorithm, context=context).hex()
    return hash_video(item, algorithm=algorithm, context=context).hex()


def installed_rules() -> MediaRules:
    """The media rules of the installed vLLM's series (`DEFAULT_SERIES`'s without one)."""
    try:
        series = vllm_series()
    except ImportError:
        series = DEFAULT_SERIES
    return VLLM_RULES[series.rstrip(".")]


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


class IdentifierMismatchError(ValueError):
    """A uuid shaped as a content digest that is not the digest of the item it came with."""


class DataLessItemError(ValueError):
    """An item sent without its data, referred to by a uuid alone."""


def _uuid_items(
    mm_uuids: Mapping[str, object] | None, counts: Mapping[str, int]
) -> dict[str, list[str | None]]:
    """The given uuids per modality as lists as long as the items (None where absent)."""
    uuids: dict[str, list[str | None]] = {modality: [None] * n for modality, n in counts.items()}
    if mm_uuids is None:
        return uuids
    if not isinstance(mm_uuids, Mapping):
        raise TypeError(
            f"multi_modal_uuids: expected a mapping modality -> uuids, found {type_name(mm_uuids)}"
        )
    for modality, given in mm_uuids.items():
        if modality not in uuids:
            raise ValueError(
                f"multi_modal_uuids: expected modalities among those of multi_modal_data "
                f"{sorted(uuids)}, found {modality!r}"
            )
        values = list(given) if isinstance(given, list) else [given]
        if len(values) != len(uuids[modality]):
            raise ValueError(
                f"multi_modal_uuids[{modality!r}]: expected {len(uuids[modality])} uuids (one "
                f"per item), found {len(values)}"
            )
        for index, value in enumerate(values):
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"multi_modal_uuids[{modality!r}][{index}]: expected str or None, found "
                    f"{type_name(value)}"
                )
            uuids[modality][index] = value
    return uuids


def checked_multi_modal_uuids(
    mm_data: Mapping[str, object],
    mm_uuids: Mapping[str, object] | None,
    /,
    *,
    unwrap: Callable[[str, object], object] | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    rules: MediaRules | None = None,
) -> dict[str, list[str | None]]:
    """A front end's identifiers: each item's content digest, never a client's name.

    vLLM keys its multimodal processor cache, its encoder cache and its
    prefix cache by an item's identifier, and only the last is salted per
    tenant: an identifier a client chooses would let one tenant's request
    read what another tenant sent under the same name. So the engine is
    given identifiers that name content only. For each item (in the order of
    ``mm_data``), with ``given`` its uuid in ``mm_uuids`` (None when absent):

    - an item sent without data (None: a reference to an item vLLM cached
      under ``given``) is refused, whatever ``given`` is;
    - an item with data gets its `content_identifier`; ``given`` is not
      passed on. One shaped as a digest (`HEX_DIGEST`, which the engine takes
      as content) must be the item's own digest: anything else would name
      another item's blocks with this item's content, and is refused;
    - an item that cannot be digested here (a modality or a type
      `content_identifier` does not take, such as precomputed embeddings)
      gets None: vLLM identifies it by its own content hash. A digest-shaped
      ``given`` cannot be checked for it, and is refused.

    Args:
        mm_data: modality -> one item or a list of items (None for an item
            referred to by uuid only).
        mm_uuids: modality -> one uuid or a list of uuids (None for an item
            with none), or None.
        unwrap: maps ``(modality, item)`` to what `content_identifier` takes
            (a front end's own wrappers around decoded media); identity if None.
        rules: see `content_identifier`.

    Returns:
        modality -> identifiers in the order of the items: digests in hex,
        or None where vLLM hashes the item itself.

    Raises:
        DataLessItemError: an item without data.
        IdentifierMismatchError: a digest-shaped uuid that is not the item's
            digest, or that comes with an item that cannot be digested here.
        TypeError, ValueError: ``mm_uuids`` does not match the items.
    """
    if not isinstance(mm_data, Mapping):
        raise TypeError(
            f"multi_modal_data: expected a mapping modality -> items, found {type_name(mm_data)}"
        )
    items = {
        modality: list(data) if isinstance(data, list) else [data]
        for modality, data in mm_data.items()
    }
    uuids = _uuid_items(mm_uuids, {modality: len(values) for modality, values in items.items()})
    for modality, values in items.items():
        for index, item in enumerate(values):
            if item is None:
                given = uuids[modality][index]
                raise DataLessItemError(
                    f"multi_modal_data[{modality!r}][{index}]: expected the item's data, found "
                    f"None (uuid {given!r}); an item referred to by its uuid alone is refused, "
                    "since vLLM's processor and encoder caches would answer it with whatever "
                    "any tenant sent under that uuid"
                )
    for modality, values in items.items():
        for index, item in enumerate(values):
            given = uuids[modality][index]
            where = f"multi_modal_uuids[{modality!r}][{index}]"
            shaped = given is not None and HEX_DIGEST.fullmatch(given) is not None
            try:
                media = item if unwrap is None else unwrap(modality, item)
                digest = content_identifier(
                    media, modality=modality, algorithm=algorithm, rules=rules
                )
            except (TypeError, ValueError) as exc:
                if shaped:
                    raise IdentifierMismatchError(
                        f"{where}: expected a uuid that is not shaped as a digest for an item "
                        f"whose digest cannot be checked ({exc}), found {given}"
                    ) from exc
                uuids[modality][index] = None  # not digestable here: vLLM hashes its content
                continue
            if shaped and given != digest:
                raise IdentifierMismatchError(
                    f"{where}: expected the item's content digest {digest} or a uuid that is "
                    f"not shaped as a digest, found {given}"
                )
            uuids[modality][index] = digest
    return uuids
