"""Canonical framing, version 1: the exact bytes every content digest covers.

A digest is ``H(frame(SCHEME) ‖ frame(kind) ‖ fields…)``; every field is a name
frame followed by a value frame, in a fixed order per kind, ending with the
``context`` field. Every frame starts with a one-byte type tag; every variable
length payload carries its length, so no two different inputs share an
encoding::

    str     0x01 ‖ u64le(len) ‖ utf-8 bytes
    int     0x02 ‖ u64le(len) ‖ two's-complement big-endian, minimal length
    float   0x03 ‖ f64le            (every NaN is written as one quiet NaN)
    bytes   0x04 ‖ u64le(len) ‖ raw bytes   (pixel and sample buffers too)
    bool    0x05 ‖ 0x00 | 0x01
    None    0x06
    map     0x07 ‖ u64le(count) ‖ (str key ‖ value)…   keys sorted by utf-8 bytes
    seq     0x08 ‖ u64le(count) ‖ value…
    blob    0x09 ‖ u64le(len) ‖ H(raw bytes)     pixel, sample and data buffers

A blob (the item's bulk: pixels, samples, array data) is hashed on its own,
from the caller's memory and starting at offset 0, with the same algorithm H,
and only its digest enters the outer hash. Starting at offset 0 is what lets
blake3 split the buffer over all cores at full speed (an unaligned start makes
its tree ramp up from 1 KiB subtrees); nothing here copies the buffer.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Union

from hashing._algorithms import Algorithm, Hasher, new_hasher

SCHEME = "omnicache.content/v1"

ContextValue = Union[
    str,
    int,
    float,
    bool,
    bytes,
    None,
    "Mapping[str, ContextValue]",
    "list[ContextValue]",
    "tuple[ContextValue, ...]",
]

_STR, _INT, _FLOAT, _BYTES, _BOOL, _NONE, _MAP, _SEQ, _BLOB = (bytes([t]) for t in range(1, 10))
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_NAN = _F64.pack(math.nan)
_TRUE, _FALSE = _BOOL + b"\x01", _BOOL + b"\x00"


def _frame_str(text: str) -> bytes:
    data = text.encode("utf-8")
    return _STR + _U64.pack(len(data)) + data


def _frame_value(value: object, path: str) -> bytes:
    """Encode one context/field value; ``path`` names it in error messages."""
    # NOTE: bool is tested before int: True must not encode as the integer 1.
    if value is None:
        return _NONE
    if value is True:
        return _TRUE
    if value is False:
        return _FALSE
    if isinstance(value, str):
        return _frame_str(value)
    if isinstance(value, numbers.Integral):
        value = int(value)
        data = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        return _INT + _U64.pack(len(data)) + data
    if isinstance(value, float):
        return _FLOAT + (_NAN if math.isnan(value) else _F64.pack(value))
    if isinstance(value, (bytes, bytearray)):
        return _BYTES + _U64.pack(len(value)) + bytes(value)
    if isinstance(value, Mapping):
        return _frame_map(value, path)
    if isinstance(value, (list, tuple)):
        parts = [_frame_value(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return _SEQ + _U64.pack(len(parts)) + b"".join(parts)
    raise TypeError(
        f"{path}: expected str, int, float, bool, bytes, None, a mapping or a list, "
        f"found {type(value).__name__}"
    )


def _frame_map(mapping: Mapping[Any, object], path: str) -> bytes:
    entries = []
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise TypeError(f"{path}: expected str keys, found {type(key).__name__} key {key!r}")
        entries.append((key.encode("utf-8"), key, value))
    entries.sort(key=lambda entry: entry[0])
    parts = [_frame_str(key) + _frame_value(value, f"{path}[{key!r}]") for _, key, value in entries]
    return _MAP + _U64.pack(len(parts)) + b"".join(parts)


def canonical_context(context: Mapping[str, object] | None) -> bytes:
    """The canonical encoding of a processing context; ``None`` encodes as ``{}``.

    Raises:
        TypeError: a key is not a str, or a value is of an unsupported type.
    """
    if context is None:
        return _MAP + _U64.pack(0)
    if not isinstance(context, Mapping):
        raise TypeError(f"context: expected a mapping or None, found {type(context).__name__}")
    return _frame_map(context, "context")


class Encoder:
    """Streams one canonical encoding into a hasher.

    The caller validates its input first, then writes every field; an encoder
    that raised half-way is simply dropped (it holds no shared state).
    """

    __slots__ = ("_algorithm", "_hasher")

    def __init__(self, algorithm: Algorithm, kind: str) -> None:
        self._algorithm = algorithm
        self._hasher: Hasher = new_hasher(algorithm)
        self._hasher.update(_frame_str(SCHEME) + _frame_str(kind))

    def field(self, name: str, value: object) -> None:
        """Write a small typed field (str, int, float, bool, bytes, None, seq, map)."""
        self._hasher.update(_frame_str(name) + _frame_value(value, name))

    def blob(self, name: str, size: int, chunks: Iterable[memoryview | bytes]) -> None:
        """Write a blob field of ``size`` bytes whose payload comes in ``chunks``.

        Raises:
            RuntimeError: the chunks did not add up to ``size`` bytes.
        """
        inner: Hasher | None = None
        written = 0
        for chunk in chunks:
            nbytes = memoryview(chunk).nbytes
            if inner is None:
                # Chunks are equal but for the last: the first one's size
                # tells whether threads pay for themselves.
                inner = new_hasher(self._algorithm, nbytes)
            inner.update(chunk)
            written += nbytes
        if inner is None:
            inner = new_hasher(self._algorithm)
        if written != size:
            raise RuntimeError(f"{name}: framed {size} bytes but wrote {written}")
        self._hasher.update(_frame_str(name) + _BLOB + _U64.pack(size) + inner.digest())

    def context(self, encoded_context: bytes) -> None:
        """Write the trailing ``context`` field from :func:`canonical_context`."""
        self._hasher.update(_frame_str("context") + encoded_context)

    def digest(self) -> bytes:
        return self._hasher.digest()
