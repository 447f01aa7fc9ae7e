"""The value a tier keeps for one block of one entry: a checked header, then the rows.

Layout (integers little-endian)::

    offset  size  field
    0       4     magic b"OCTB"
    4       2     format version (1)
    6       1     byte order of the rows: 0 little, 1 big
    7       1     d: length of the dtype name
    8       1     r: number of dims
    9       1     s: length of the stamp
    10      2     e: length of the entry name (UTF-8)
    12      8     p: length of the rows in bytes
    20      d     dtype name, ASCII ("bfloat16", "float32", ...)
    ..      8*r   shape (block_size, *row_shape), u64 each
    ..      s     stamp: the block key the rows were stored under
    ..      e     entry name
    ..      16    checksum: xxh3_128 of every byte above, then of the rows
    ..      p     the rows, C order

A value is served only when every field matches what the reader expects (the
key it asked for, the entry's dtype and shape, this machine's byte order), its
length is exact and the checksum holds; anything else is a miss. The stamp and
entry name make a value that sits under the wrong key (a copy, a truncated
write, another format) useless rather than wrong.

NOTE: the checksum finds damage, not forgery: anyone who can write to the tier
can write a value that passes. Keep the tier's server as trusted as the
engine's memory (see SECURITY.md).

Encoding is split in two: `pack` copies the rows into a new buffer (on the
caller's thread, so the store's block can be reused at once) and `seal`
computes the checksum (on a writer thread, off the serving path).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

import torch
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Decoded",
    "Rejection",
    "decode",
    "dtype_name",
    "encode",
    "pack",
    "seal",
]

MAGIC = b"OCTB"
FORMAT_VERSION = 1

_FIXED = struct.Struct("<4sHBBBBHQ")
_CHECKSUM_SIZE = 16
_NATIVE_ORDER = 0 if sys.byteorder == "little" else 1


class Rejection(Enum):
    """Why a value was not served."""

    # Not a value of this format and version, or cut short or too long.
    FORMAT = "format"
    # A value of another key, entry, dtype, shape or byte order.
    MISMATCH = "mismatch"
    # The checksum does not hold: damaged rows or header.
    CHECKSUM = "checksum"


class Decoded(NamedTuple):
    """`decode`'s result: the rows, or why there are none."""

    rows: torch.Tensor | None
    rejection: Rejection | None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _header(key: bytes, name: str, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> bytes:
    dname = dtype_name(dtype).encode("ascii")
    ename = name.encode("utf-8")
    if len(key) > 255:
        raise ValueError(f"key: expected at most 255 bytes, found {len(key)}")
    if len(ename) > 65535:
        raise ValueError(f"entry name: expected at most 65535 UTF-8 bytes, found {len(ename)}")
    if len(shape) > 255:
        raise ValueError(f"shape: expected at most 255 dims, found {len(shape)}")
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        _NATIVE_ORDER,
        len(dname),
        len(shape),
        len(key),
        len(ename),
        nbytes,
    )
    return b"".join((fixed, dname, struct.pack(f"<{len(shape)}Q", *shape), key, ename))


def pack(key: bytes, name: str, rows: torch.Tensor) -> tuple[bytearray, int]:
    """Copies ``rows`` behind a header whose checksum is still zero.

    Returns:
        The buffer, and the offset of its checksum (for `seal`).
    """
    src = rows.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    nbytes = src.numel() * src.element_size()
    header = _header(key, name, src.dtype, tuple(src.shape), nbytes)
    at = len(header)
    buf = bytearray(at + _CHECKSUM_SIZE + nbytes)
    buf[:at] = header
    if nbytes:
        dst = torch.frombuffer(buf, dtype=torch.uint8, offset=at + _CHECKSUM_SIZE, count=nbytes)
        dst.copy_(src.reshape(-1).view(torch.uint8))
    return buf, at


def seal(buf: bytearray, checksum_at: int) -> None:
    """Writes the checksum of a `pack`ed buffer in place."""
    view = memoryview(buf)
    h = xxhash.xxh3_128(view[:checksum_at])
    h.update(view[checksum_at + _CHECKSUM_SIZE :])
    view[checksum_at : checksum_at + _CHECKSUM_SIZE] = h.digest()


def encode(key: bytes, name: str, rows: torch.Tensor) -> bytes:
    """`pack` then `seal`: the whole value."""
    buf, at = pack(key, name, rows)
    seal(buf, at)
    return bytes(buf)


def decode(
    value: bytes | bytearray | memoryview,
    key: bytes,
    name: str,
    dtype: torch.dtype,
    shape: Sequence[int],
) -> Decoded:
    """The rows of ``value`` if it holds entry ``name`` of block ``key`` as expected.

    Returns:
        The rows (a read-only-backed CPU tensor viewing ``value``: copy it
        before ``value`` goes), or the `Rejection`.
    """
    view = memoryview(value)
    if len(view) < _FIXED.size:
        return Decoded(None, Rejection.FORMAT)
    magic, version, order, dlen, ndim, slen, elen, nbytes = _FIXED.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION:
        return Decoded(None, Rejection.FORMAT)
    at = _FIXED.size
    checksum_at = at + dlen + 8 * ndim + slen + elen
    if len(view) != checksum_at + _CHECKSUM_SIZE + nbytes:
        return Decoded(None, Rejection.FORMAT)
    expected = _header(key, name, dtype, shape, nbytes)
    if (
        order != _NATIVE_ORDER
        or checksum_at != len(expected)
        or view[at:checksum_at] != expected[at:]
    ):
        return Decoded(None, Rejection.MISMATCH)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for size in shape:
        numel *= size
    if nbytes != numel * itemsize:
        return Decoded(None, Rejection.MISMATCH)
    h = xxhash.xxh3_128(view[:checksum_at])
    rows_at = checksum_at + _CHECKSUM_SIZE
    h.update(view[rows_at:])
    if h.digest() != view[checksum_at:rows_at]:
        return Decoded(None, Rejection.CHECKSUM)
    if nbytes == 0:
        return Decoded(torch.empty(tuple(shape), dtype=dtype), None)
    rows = torch.frombuffer(view, dtype=torch.uint8, offset=rows_at, count=nbytes)
    return Decoded(rows.view(dtype).view(tuple(shape)), None)
