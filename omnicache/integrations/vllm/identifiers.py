"""vLLM's multimodal inputs -> identifiers: each item's `omnicache.identity` in hex.

`multi_modal_uuids` and `make_mm_features` name vLLM's multimodal inputs by
`omnicache.identity.item_identity`, the one identity every path uses, so
that the keys the engine computes equal the keys omnicache computes for the
same prompt; `checked_multi_modal_uuids` is the front end's rule for the
uuids clients send (docs/architecture.md, "Identifiers and tenants").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hashing import DEFAULT_ALGORITHM, Algorithm, ContentHash, digest_size
from omnicache.checks import type_name
from omnicache.identity import (
    MODALITIES,
    Item,
    UnidentifiableItemError,
    item_identity,
    split_items,
    tenant_identifier,
)
from omnicache.integrations.vllm.common import require_vllm, vllm_series
from omnicache.media import DEFAULT_SERIES, VLLM_RULES, MediaRules

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = [
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


def content_identifier(
    item: object,
    /,
    *,
    modality: str,
    form: str | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
    rules: MediaRules | None = None,
) -> str:
    """The identifier of one vLLM multimodal item: its `item_identity` in hex.

    Args:
        item: one item in any form `omnicache.identity.item_identity` takes,
            or a precomputed `hashing.ContentHash` (returned in hex).
        modality, form, algorithm, context: see `item_identity`.
        rules: the vLLM series' rules (`omnicache.media.VLLM_RULES`); None:
            those of the installed vLLM (of `DEFAULT_SERIES` where none is
            importable).

    Returns:
        The identity as lowercase hex: what `RequestBlockHasher` reads back
        from ``MultiModalFeatureSpec.identifier``.
    """
    if isinstance(item, ContentHash):
        if len(item) != digest_size(algorithm):
            raise ValueError(
                f"item: expected a {digest_size(algorithm)}-byte {algorithm} ContentHash, "
                f"found {len(item)} bytes"
            )
        return item.hex()
    identity = item_identity(
        item,
        modality=modality,
        form=form,
        algorithm=algorithm,
        context=context,
        rules=installed_rules() if rules is None else rules,
    )
    return identity.hex()


def installed_rules() -> MediaRules:
    """The media rules of the installed vLLM's series (`DEFAULT_SERIES`'s without one)."""
    try:
        series = vllm_series()
    except ImportError:
        series = DEFAULT_SERIES
    return VLLM_RULES[series.rstrip(".")]


def _modalities(mm_data: object, what: str) -> Mapping[str, object]:
    if not isinstance(mm_data, Mapping):
        raise TypeError(f"{what}: expected a mapping modality -> items, found {type_name(mm_data)}")
    for modality in mm_data:
        if modality not in MODALITIES:
            raise ValueError(f"{what}: expected modalities among {MODALITIES}, found {modality!r}")
    return mm_data


def multi_modal_uuids(
    mm_data: Mapping[str, object],
    /,
    *,
    cache_salt: str | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
    rules: MediaRules | None = None,
) -> dict[str, list[str]]:
    """The ``multi_modal_uuids`` of a vLLM prompt: each item's identity, scoped to its tenant.

    Pass the result as the prompt's ``"multi_modal_uuids"`` next to its
    ``"multi_modal_data"`` and its ``"cache_salt"``: vLLM then uses these
    identifiers for every cache (processor, encoder, prefix) instead of
    hashing the items itself, and none of them is shared across salts
    (`omnicache.identity.tenant_identifier`). The front end
    (``OMNICACHE_MM_UUIDS=1``) computes the same identifiers itself.

    NOTE: vLLM re-hashes a provided uuid together with ``mm_processor_kwargs``
    or ``media_io_kwargs`` when a prompt has them (still a content key, and
    still scoped).

    Args:
        mm_data: modality -> items, as in ``multi_modal_data``, cut into
            items as vLLM cuts them (`omnicache.identity.split_items`).
        cache_salt: the prompt's ``cache_salt`` (None: items shared by all).

    Returns:
        modality -> identifiers, in the order of the items.

    Raises:
        UnidentifiableItemError: an item that cannot be identified exactly
            (leave it out of ``multi_modal_uuids``: vLLM hashes it itself).
    """
    checked = installed_rules() if rules is None else rules
    return {
        modality: [
            tenant_identifier(
                content_identifier(
                    item.value,
                    modality=modality,
                    form=item.form,
                    algorithm=algorithm,
                    context=context,
                    rules=checked,
                ),
                cache_salt=cache_salt,
                algorithm=algorithm,
            )
            for item in split_items(data, modality=modality)
        ]
        for modality, data in _modalities(mm_data, "mm_data").items()
    }


def make_mm_features(
    mm_data: Mapping[str, object],
    mm_placeholders: Mapping[str, Sequence[PlaceholderRange]],
    /,
    *,
    cache_salt: str | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> list[MultiModalFeatureSpec]:
    """``MultiModalFeatureSpec``s whose identifiers are `multi_modal_uuids`.

    Args:
        mm_data: modality -> items (see `multi_modal_uuids`).
        mm_placeholders: modality -> one ``PlaceholderRange`` per item, in
            the same order (what vLLM's processor returns).

    Returns:
        One feature per item, sorted by placeholder offset as vLLM sorts
        them, with ``identifier == mm_hash ==`` the item's identifier and no
        processed data.
    """
    require_vllm()
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    identifiers = multi_modal_uuids(
        mm_data, cache_salt=cache_salt, algorithm=algorithm, context=context
    )
    if not isinstance(mm_placeholders, Mapping):
        raise TypeError(
            "mm_placeholders: expected a mapping modality -> PlaceholderRanges, found "
            f"{type_name(mm_placeholders)}"
        )
    if set(mm_placeholders) != set(identifiers):
        raise ValueError(
            f"mm_placeholders: expected the modalities of mm_data {sorted(identifiers)}, "
            f"found {sorted(mm_placeholders)}"
        )
    features: list[MultiModalFeatureSpec] = []
    for modality, modality_identifiers in identifiers.items():
        ranges = list(mm_placeholders[modality])
        if len(ranges) != len(modality_identifiers):
            raise ValueError(
                f"mm_placeholders[{modality!r}]: expected {len(modality_identifiers)} ranges "
                f"(one per item), found {len(ranges)}"
            )
        for index, (identifier, position) in enumerate(
            zip(modality_identifiers, ranges, strict=True)
        ):
            if not isinstance(position, PlaceholderRange):
                raise TypeError(
                    f"mm_placeholders[{modality!r}][{index}]: expected a PlaceholderRange, "
                    f"found {type_name(position)}"
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
        values = _given_list(given)
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
    cache_salt: str | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    rules: MediaRules | None = None,
) -> dict[str, list[str | None]]:
    """A front end's identifiers: each item's identity, never a client's name.

    vLLM keys its multimodal processor cache, its encoder cache and its
    prefix cache by an item's identifier: an identifier a client chooses
    would let one request read what another sent under the same name. So the
    engine is given identifiers that name content only. For each item (in
    the order vLLM cuts ``mm_data`` into items, `omnicache.identity.
    split_items`), with ``given`` its uuid in ``mm_uuids`` (None when absent):

    - an item sent without data (None: a reference to an item vLLM cached
      under ``given``) is refused, whatever ``given`` is;
    - an item with data gets its identity; ``given`` is not passed on. One
      shaped as a digest (`HEX_DIGEST`, which the engine takes as content)
      must be the item's own identity, bare or scoped to ``cache_salt``
      (what `multi_modal_uuids` gives): anything else would name another
      item's blocks with this item's content, and is refused;
    - an item that cannot be identified exactly (a form `item_identity`
      refuses) gets None, and a modality cut into items by the model's own
      rules (embeddings given as a mapping of fields, a modality such as
      ``vision_chunk``) is left out: vLLM identifies those by its own
      content hash. A digest-shaped ``given``
      cannot be checked for them, and is refused.

    The identities returned are not scoped: the front end scopes whatever
    identifier vLLM derives from them (`omnicache.identity.tenant_identifier`).

    Args:
        mm_data: modality -> items (None for an item referred to by uuid only).
        mm_uuids: modality -> one uuid or a list of uuids (None for an item
            with none), or None.
        cache_salt: the request's ``cache_salt``.
        rules: see `content_identifier`.

    Returns:
        modality -> identifiers in the order of the items: identities in
        hex, or None where vLLM hashes the item itself.

    Raises:
        DataLessItemError: an item without data.
        IdentifierMismatchError: a digest-shaped uuid that is not the item's
            identity, or that comes with an item that cannot be identified.
        TypeError, ValueError: ``mm_uuids`` does not match the items.
    """
    checked_rules = installed_rules() if rules is None else rules
    if not isinstance(mm_data, Mapping):
        raise TypeError(
            f"multi_modal_data: expected a mapping modality -> items, found {type_name(mm_data)}"
        )
    cut = {modality: _cut(data, modality) for modality, data in mm_data.items()}
    counts = {modality: len(items) for modality, items in cut.items() if items is not None}
    uuids = _uuid_items(_split_given(mm_uuids, cut), counts)
    for modality, items in cut.items():
        for index, item in enumerate(items or ()):
            if item.value is None:
                given = uuids[modality][index]
                raise DataLessItemError(
                    f"multi_modal_data[{modality!r}][{index}]: expected the item's data, found "
                    f"None (uuid {given!r}); an item referred to by its uuid alone is refused, "
                    "since vLLM's processor and encoder caches would answer it with whatever "
                    "any tenant sent under that uuid"
                )
    for modality, items in cut.items():
        if items is None:
            continue
        for index, item in enumerate(items):
            given = uuids[modality][index]
            where = f"multi_modal_uuids[{modality!r}][{index}]"
            shaped = given is not None and HEX_DIGEST.fullmatch(given) is not None
            try:
                identity = content_identifier(
                    item.value,
                    modality=modality,
                    form=item.form,
                    algorithm=algorithm,
                    rules=checked_rules,
                )
            except UnidentifiableItemError as exc:
                if shaped:
                    raise IdentifierMismatchError(
                        f"{where}: expected a uuid that is not shaped as a digest for an item "
                        f"whose identity cannot be checked ({exc}), found {given}"
                    ) from exc
                uuids[modality][index] = None  # vLLM hashes its content
                continue
            if shaped and given != identity:
                scoped = tenant_identifier(identity, cache_salt=cache_salt)
                if given != scoped:
                    also = (
                        "" if scoped == identity else f" (or, scoped to its cache_salt, {scoped})"
                    )
                    raise IdentifierMismatchError(
                        f"{where}: expected the item's identity {identity}{also} or a uuid that "
                        f"is not shaped as a digest, found {given}"
                    )
            uuids[modality][index] = identity
    return uuids


def _given_list(given: object) -> list[object]:
    """A modality's given uuids as a list: a list or tuple of them, or one uuid."""
    return list(given) if isinstance(given, (list, tuple)) else [given]


def _cut(data: object, modality: str) -> list[Item] | None:
    """vLLM's items of a modality, or None where vLLM cuts them by the model's own rules
    (a mapping of embedding fields, a modality of the model's own such as ``vision_chunk``)."""
    if modality not in MODALITIES:
        return None
    try:
        return split_items(data, modality=modality)
    except UnidentifiableItemError:
        return None


def _split_given(
    mm_uuids: Mapping[str, object] | None, cut: Mapping[str, list[Item] | None]
) -> Mapping[str, object] | None:
    """The given uuids of the modalities cut here; a digest-shaped one of another is refused."""
    if mm_uuids is None or not isinstance(mm_uuids, Mapping):
        return mm_uuids
    for modality, given in mm_uuids.items():
        if modality in cut and cut[modality] is None:
            values = _given_list(given)
            for index, value in enumerate(values):
                if isinstance(value, str) and HEX_DIGEST.fullmatch(value):
                    raise IdentifierMismatchError(
                        f"multi_modal_uuids[{modality!r}][{index}]: expected a uuid that is not "
                        "shaped as a digest for an item whose identity cannot be checked (vLLM "
                        f"cuts {modality} data given as a mapping by the model's rules), found "
                        f"{value}"
                    )
    return {
        modality: given
        for modality, given in mm_uuids.items()
        if not (modality in cut and cut[modality] is None)
    }
