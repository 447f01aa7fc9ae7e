"""Annotate a prompt: find each item's placeholder run and attach the item's digest.

`annotate_prompt` is the bridge from what a serving front end has (token ids
with runs of placeholder tokens, and the images, audio clips, encoded files
or caller ids they stand for) to `AnnotatedTokens`, whose block keys cover
the content behind every placeholder.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence, Set
from functools import partial
from itertools import pairwise
from typing import Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError

from hashing import DEFAULT_ALGORITHM, Algorithm, ContentHash, digest_size, hash_identifier
from omnicache.annotations import MAX_TOKEN_ID, AnnotatedTokens, TokenRangeAnnotation
from omnicache.identity import item_identity
from omnicache.media import IMAGE_FORMATS, MediaError, read_file

__all__ = ["annotate_prompt"]

DEFAULT_IDENTIFIER_NAMESPACE = "default"

_SUPPORTED_ITEMS = (
    "a hashing.ContentHash (used as is), a PIL.Image.Image, a uint8 numpy.ndarray or "
    "torch.Tensor (an image, or a video shaped (frames, height, width, channels)), a "
    "(waveform, sample_rate) tuple (audio), a (frames, metadata) tuple (a video), bytes, "
    "bytearray or an os.PathLike (an encoded image or audio file) or a str (a caller's id)"
)


class PlaceholderRangeLike(Protocol):
    """Anything with ``offset`` and ``length``, such as vLLM's ``PlaceholderRange``."""

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_array(value: object) -> bool:
    if isinstance(value, np.ndarray):
        return True
    # NOTE: torch is looked up, never imported: a tensor's caller has imported it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _item_hasher(
    item: object,
    index: int,
    algorithm: Algorithm,
    context: Mapping[str, object] | None,
    identifier_namespace: str,
) -> tuple[Hashable, Callable[[], ContentHash]]:
    """(dedup key, identity thunk) for one item; TypeError for an unsupported one."""
    where = f"items[{index}]"
    if isinstance(item, ContentHash):
        expected = digest_size(algorithm)
        if len(item) != expected:
            raise ValueError(
                f"{where}: expected a {expected}-byte {algorithm} ContentHash, "
                f"found {len(item)} bytes"
            )
        return ("hash", id(item)), partial(_identity, item)
    if isinstance(item, str):
        # Ids are compared by value: equal strings are one item.
        return ("id", item), partial(
            hash_identifier, item, namespace=identifier_namespace, algorithm=algorithm
        )
    identity = partial(item_identity, algorithm=algorithm, context=context)
    if isinstance(item, (bytes, bytearray, os.PathLike)):
        return ("encoded", id(item)), partial(_encoded_identity, item, where, identity)
    if isinstance(item, Image.Image):
        return ("image", id(item)), partial(identity, item, modality="image")
    if isinstance(item, tuple) and len(item) == 2:
        if isinstance(item[1], Mapping):
            return ("video", id(item[0]), id(item[1])), partial(identity, item, modality="video")
        if _is_array(item[0]):
            return ("audio", id(item[0]), id(item[1])), partial(identity, item, modality="audio")
    if _is_array(item):
        dtype = str(getattr(item, "dtype", ""))
        if dtype in ("uint8", "torch.uint8"):
            modality = "video" if item.ndim == 4 else "image"  # type: ignore[attr-defined]
            return (modality, id(item)), partial(identity, item, modality=modality)
        raise TypeError(
            f"{where}: expected {_SUPPORTED_ITEMS}, found a {type(item).__name__} of dtype "
            f"{dtype} (only uint8 arrays are images; pass audio as (waveform, sample_rate) "
            "and any other array as a precomputed ContentHash)"
        )
    raise TypeError(f"{where}: expected {_SUPPORTED_ITEMS}, found {type(item).__name__}")


def _encoded_identity(
    item: bytes | bytearray | os.PathLike[str], where: str, identity: Callable[..., ContentHash]
) -> ContentHash:
    """The identity of an encoded file: an image if Pillow identifies one, else audio.

    A file Pillow identifies but cannot open (a decompression bomb, a broken
    header) is an image: decoding it gives the reason.
    """
    data = read_file(item) if isinstance(item, os.PathLike) else bytes(item)
    try:
        Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        try:
            return identity(data, modality="audio")
        except MediaError as exc:
            raise ValueError(
                f"{where}: expected an encoded image or audio file, found neither (as an "
                f"image: no format the server accepts identifies it; as audio: {exc.reason})"
            ) from None
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError):
        pass  # NOTE: Pillow's plugins fail on a malformed header in these ways
    return identity(data, modality="image")


def _identity(digest: ContentHash) -> ContentHash:
    return digest


def _placeholder_ids(placeholder_token_id: int | Set[int]) -> list[int]:
    candidates: list[object]
    if _is_int(placeholder_token_id):
        candidates = [placeholder_token_id]
    elif isinstance(placeholder_token_id, (set, frozenset)):
        if not placeholder_token_id:
            raise ValueError("placeholder_token_id: expected a non-empty set of ids, found set()")
        candidates = list(placeholder_token_id)
    else:
        raise TypeError(
            "placeholder_token_id: expected an int or a set or frozenset of ints, "
            f"found {type(placeholder_token_id).__name__}"
        )
    ids: list[int] = []
    for token_id in candidates:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise ValueError(
                f"placeholder_token_id: expected ints in [0, {MAX_TOKEN_ID}], "
                f"found {token_id!r} ({type(token_id).__name__})"
            )
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise ValueError(
                f"placeholder_token_id: expected ints in [0, {MAX_TOKEN_ID}], found {token_id}"
            )
        ids.append(token_id)
    return sorted(ids)


def _find_runs(tokens: AnnotatedTokens, ids: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of every maximal run of tokens in ``ids``, in order."""
    array = np.frombuffer(tokens.packed(), dtype="<u4")
    mask = array == ids[0] if len(ids) == 1 else np.isin(array, np.asarray(ids, dtype=np.uint32))
    edges = np.flatnonzero(np.diff(mask, prepend=False, append=False))
    starts = edges[0::2].tolist()
    stops = edges[1::2].tolist()
    return [(start, stop - start) for start, stop in zip(starts, stops, strict=True)]


def _check_ranges(
    placeholder_ranges: Iterable[PlaceholderRangeLike | tuple[int, int]], num_tokens: int
) -> list[tuple[int, int]]:
    """Validate explicit ranges; return them as (offset, length) in the given order."""
    if isinstance(placeholder_ranges, (str, bytes)) or not isinstance(placeholder_ranges, Iterable):
        raise TypeError(
            "placeholder_ranges: expected a sequence of (offset, length) pairs or "
            f"PlaceholderRange objects, found {type(placeholder_ranges).__name__}"
        )
    ranges: list[tuple[int, int]] = []
    for i, rng in enumerate(placeholder_ranges):
        where = f"placeholder_ranges[{i}]"
        offset: object
        length: object
        if isinstance(rng, (tuple, list)) and len(rng) == 2:
            offset, length = rng
        elif hasattr(rng, "offset") and hasattr(rng, "length"):
            offset, length = rng.offset, rng.length
        else:
            raise TypeError(
                f"{where}: expected an (offset, length) pair or an object with .offset and "
                f".length, found {type(rng).__name__}"
            )
        if not _is_int(offset) or offset < 0:
            raise ValueError(f"{where}.offset: expected an int >= 0, found {offset!r}")
        if not _is_int(length) or length < 1:
            raise ValueError(f"{where}.length: expected an int >= 1, found {length!r}")
        if offset + length > num_tokens:
            raise ValueError(
                f"{where}: expected offset + length <= {num_tokens} (tokens in the prompt), "
                f"found {offset} + {length} = {offset + length}"
            )
        ranges.append((offset, length))
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    for prev, cur in pairwise(order):
        prev_end = ranges[prev][0] + ranges[prev][1]
        if ranges[cur][0] < prev_end:
            raise ValueError(
                f"placeholder_ranges[{cur}]: expected offset >= {prev_end} (end of "
                f"placeholder_ranges[{prev}]; ranges must not overlap), found {ranges[cur][0]}"
            )
    return ranges


def annotate_prompt(
    token_ids: Iterable[int],
    items: Sequence[object],
    /,
    *,
    placeholder_token_id: int | Set[int] | None = None,
    placeholder_ranges: Iterable[PlaceholderRangeLike | tuple[int, int]] | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
    identifier_namespace: str = DEFAULT_IDENTIFIER_NAMESPACE,
) -> AnnotatedTokens:
    """Pair each item with its placeholder run and annotate the run with the item's identity.

    Items, classified by type, each named by `omnicache.identity.item_identity`
    (what the model's processor receives for it) unless given as a digest:

    ======================================  =======================================
    item                                    digest
    ======================================  =======================================
    ``hashing.ContentHash``                 used as is (must be ``algorithm``'s size)
    ``PIL.Image.Image``                     an image's identity
    uint8 ``numpy.ndarray``/``Tensor``      an image's (2 or 3 dims) or a video's (4)
    ``(waveform, sample_rate)`` tuple       an audio clip's identity
    ``(frames, metadata)`` tuple            a video's identity (metadata: a dict)
    ``bytes``, ``bytearray``, ``PathLike``  the identity of the image or audio clip
                                            the file holds, decoded as vLLM's
                                            server decodes an upload
    ``str``                                 ``hash_identifier`` in ``identifier_namespace``
    ======================================  =======================================

    Each distinct item is hashed once: the same object (or equal id string)
    given twice is hashed once and both runs share the digest.

    Placeholders are found in one of two ways:

    - ``placeholder_token_id`` (an id, or a set of ids): every maximal run of
      those ids is one item's run, in order. Two items whose runs touch form
      one run: pass ``placeholder_ranges`` for adjacent items.
    - ``placeholder_ranges``: one ``(offset, length)`` pair (or vLLM
      ``PlaceholderRange``) per item, in the order of ``items``; the run may
      hold any token ids (a range may include start/end marker tokens).

    Args:
        token_ids: the prompt's token ids, ints in ``[0, 2**32 - 1]``.
        items: one item per placeholder run, in prompt order (ranges: in
            ``placeholder_ranges`` order).
        placeholder_token_id: the placeholder id(s); exclusive with ranges.
        placeholder_ranges: explicit runs; exclusive with placeholder ids.
        algorithm: the content digest algorithm (default blake3).
        context: processing parameters that change what the model sees
            (model id, resize settings); they enter every item's identity.
        identifier_namespace: the namespace caller ids are hashed in, so two
            tenants' equal ids differ.

    Returns:
        The tokens with one annotation per item, covering its whole run
        (``content_offset`` 0, ``content_length`` the run's length).

    Raises:
        ValueError: a token id is negative, too large or not an int
            (``token_ids[i]``); the number of runs differs from the number
            of items; a range overlaps another or falls outside the prompt
            (``placeholder_ranges[i]``); both or neither placeholder option
            given for a non-empty ``items``.
        TypeError: an item of an unsupported type (``items[i]``, listing the
            supported types).

    The inputs are never modified.
    """
    tokens = AnnotatedTokens(token_ids)
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"items: expected a list or tuple of items, found {type(items).__name__}")
    digest_size(algorithm)  # ValueError for an unknown algorithm
    if not isinstance(identifier_namespace, str):
        raise TypeError(
            f"identifier_namespace: expected a str, found {type(identifier_namespace).__name__}"
        )
    if placeholder_token_id is not None and placeholder_ranges is not None:
        raise ValueError(
            "expected placeholder_token_id or placeholder_ranges, found both: give one"
        )
    if placeholder_ranges is not None:
        ranges = _check_ranges(placeholder_ranges, len(tokens))
        if len(ranges) != len(items):
            raise ValueError(
                f"placeholder_ranges: expected {len(items)} ranges (one per item), "
                f"found {len(ranges)}"
            )
    elif placeholder_token_id is not None:
        ids = _placeholder_ids(placeholder_token_id)
        ranges = _find_runs(tokens, ids)
        if len(ranges) != len(items):
            shown = ", ".join(f"({o}, {n})" for o, n in ranges[:8])
            more = ", ..." if len(ranges) > 8 else ""
            raise ValueError(
                f"placeholder runs of {placeholder_token_id!r}: expected {len(items)} (one per "
                f"item), found {len(ranges)} at (offset, length) [{shown}{more}]; "
                "adjacent items form one run: pass placeholder_ranges for them"
            )
    elif items:
        raise ValueError(
            f"expected placeholder_token_id or placeholder_ranges to place {len(items)} "
            "items, found neither"
        )
    else:
        return tokens

    # NOTE: classify every item before hashing any, so a bad item costs nothing.
    hashers = [
        _item_hasher(item, i, algorithm, context, identifier_namespace)
        for i, item in enumerate(items)
    ]
    key_to_digest: dict[Hashable, ContentHash] = {}
    annotations = []
    for (offset, length), (key, digest_fn) in zip(ranges, hashers, strict=True):
        digest = key_to_digest.get(key)
        if digest is None:
            digest = key_to_digest[key] = digest_fn()
        annotations.append(TokenRangeAnnotation(offset, length, digest, 0, length))
    annotations.sort(key=lambda ann: ann.token_index)
    return AnnotatedTokens(tokens, annotations)
