"""The value a tier keeps for one block of one entry: a checked header, then the rows.

Layout (integers little-endian)::

    offset  size  field
    0       4     magic: b"OCTB" (checksum) or b"OCTK" (keyed MAC)
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
    ..      16    check: of every byte above, then of the rows: xxh3_128
                  (b"OCTB"), or the first 16 bytes of keyed BLAKE3 (b"OCTK")
    ..      p     the rows, C order

A value is served only when every field matches what the reader expects (the
key it asked for, the entry's dtype and shape, this machine's byte order), its
length is exact and the checksum holds; anything else is a miss. The stamp and
entry name make a value that sits under the wrong key (a copy, a truncated
write, another format) useless rather than wrong.

NOTE: the checksum finds damage, not forgery: anyone who can write to the tier
can write a value that passes. Keep the tier's server as trusted as the
engine's memory (see SECURITY.md), or give writers and readers a shared
32-byte ``auth_key``: values then carry a keyed BLAKE3 MAC instead, which no
one without the key can forge, and a reader with a key accepts no value
without one (and the reverse).

`encode` builds a value in one copy of the rows (the checksum is computed over
them in place); `decode` checks a value against a `Layout` that a reader builds
once per entry.
"""

from __future__ import annotations

import functools
import hmac
import math
import struct
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

import blake3
import numpy as np
import numpy.typing as npt
import torch
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAGIC_KEYED",
    "Decoded",
    "Layout",
    "Rejection",
    "decode",
    "encode",
    "layout",
]

MAGIC = b"OCTB"
MAGIC_KEYED = b"OCTK"
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


class Layout(NamedTuple):
    """What a reader expects of one entry's values, all but the block key (see `layout`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    # Bytes of the rows.
    nbytes: int
    # The header's fields after the fixed part, split around the key.
    before_key: bytes
    after_key: bytes


def layout(name: str, dtype: torch.dtype, shape: Sequence[int]) -> Layout:
    """The layout of entry ``name``'s values: rows of ``dtype`` and ``shape``."""
    return _layout(name, dtype, tuple(int(size) for size in shape))


# NOTE: every value of an entry has the same layout; building it was a third
# of the Python time of encoding a 128 KiB block.
@functools.lru_cache(maxsize=1024)
def _layout(name: str, dtype: torch.dtype, dims: tuple[int, ...]) -> Layout:
    dname = dtype_name(dtype).encode("ascii")
    ename = name.encode("utf-8")
    if len(ename) > 65535:
        raise ValueError(f"entry name: expected at most 65535 UTF-8 bytes, found {len(ename)}")
    if len(dims) > 255:
        raise ValueError(f"shape: expected at most 255 dims, found {len(dims)}")
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    return Layout(name, dtype, dims, nbytes, dname + struct.pack(f"<{len(dims)}Q", *dims), ename)


def check_auth_key(auth_key: object) -> bytes | None:
    """An ``auth_key``: None, or 32 bytes (a secret's SHA-256, say)."""
    if auth_key is None:
        return None
    if not isinstance(auth_key, bytes):
        raise TypeError(f"auth_key: expected bytes or None, found {type(auth_key).__name__}")
    if len(auth_key) != 32:
        raise ValueError(
            f"auth_key: expected 32 bytes (e.g. hashlib.sha256(secret).digest()), "
            f"found {len(auth_key)}"
        )
    return auth_key


def _check(auth_key: bytes | None, *parts: bytes | memoryview) -> bytes:
    """The 16-byte check of a value's parts: xxh3_128, or keyed BLAKE3 with a key."""
    if auth_key is None:
        h = xxhash.xxh3_128()
        for part in parts:
            h.update(part)
        return h.digest()
    mac = blake3.blake3(key=auth_key)
    for part in parts:
        mac.update(part)
    return mac.digest(length=_CHECKSUM_SIZE)


def _header(key: bytes, lay: Layout, nbytes: int, auth_key: bytes | None) -> bytes:
    if len(key) > 255:
        raise ValueError(f"key: expected at most 255 bytes, found {len(key)}")
    fixed = _FIXED.pack(
        MAGIC if auth_key is None else MAGIC_KEYED,
        FORMAT_VERSION,
        _NATIVE_ORDER,
        len(lay.before_key) - 8 * len(lay.shape),
        len(lay.shape),
        len(key),
        len(lay.after_key),
        nbytes,
    )
    return b"".join((fixed, lay.before_key, key, lay.after_key))


def encode(key: bytes, name: str, rows: torch.Tensor, *, auth_key: bytes | None = None) -> bytes:
    """The value of ``rows`` stored for entry ``name`` of block ``key``.

    The rows are copied once, into the value; later changes to ``rows`` do
    not reach it. With ``auth_key`` the value carries a keyed MAC.
    """
    header, data = _parts(key, name, rows, auth_key)
    # NOTE: the check reads the rows in place and the join copies them once.
    view = data.data
    return b"".join((header, _check(auth_key, header, view), view))


def _parts(
    key: bytes, name: str, rows: torch.Tensor, auth_key: bytes | None
) -> tuple[bytes, npt.NDArray[np.uint8]]:
    """A value's header, and its rows as bytes viewing the CPU rows' own memory."""
    src = rows.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    lay = layout(name, src.dtype, tuple(src.shape))
    # NOTE: a uint8 view, since bf16 has no numpy dtype.
    return _header(key, lay, lay.nbytes, auth_key), src.reshape(-1).view(torch.uint8).numpy()


def encode_into(
    key: bytes,
    name: str,
    rows: torch.Tensor,
    buffer_for: Callable[[int], bytearray],
    *,
    sealed: bool = True,
    auth_key: bytes | None = None,
) -> bytearray:
    """`encode` into a buffer of the value's size that ``buffer_for(size)`` gives.

    For writers that reuse their buffers: a fresh 128 KiB allocation costs a
    page fault per 4 KiB, which made building values cost more than sending
    them on loopback.

    Args:
        sealed: Compute the check now; with False it stays zero until
            `seal` (a writer thread does it, off the caller's path).
        auth_key: Make the check a keyed MAC (`seal` needs the same key).
    """
    header, data = _parts(key, name, rows, auth_key)
    rows_at = len(header) + _CHECKSUM_SIZE
    size = rows_at + len(data)
    buf = buffer_for(size)
    if len(buf) != size:
        raise ValueError(f"buffer: expected {size} bytes, found {len(buf)}")
    view = memoryview(buf)
    view[: len(header)] = header
    np.frombuffer(buf, dtype=np.uint8, count=len(data), offset=rows_at)[:] = data
    if sealed:
        seal(buf, auth_key=auth_key)
    else:
        view[len(header) : rows_at] = bytes(_CHECKSUM_SIZE)
    return buf


def seal(buf: bytearray, *, auth_key: bytes | None = None) -> None:
    """Writes the check of a value built by `encode_into` with ``sealed=False``."""
    view = memoryview(buf)
    magic, _, _, dlen, ndim, slen, elen, _ = _FIXED.unpack_from(view)
    if magic != (MAGIC if auth_key is None else MAGIC_KEYED):
        raise ValueError(
            f"auth_key: expected {'none' if magic == MAGIC else 'the key'} for a value "
            f"built with magic {magic!r}"
        )
    checksum_at = _FIXED.size + dlen + 8 * ndim + slen + elen
    rows_at = checksum_at + _CHECKSUM_SIZE
    view[checksum_at:rows_at] = _check(auth_key, view[:checksum_at], view[rows_at:])


def decode(
    value: bytes | bytearray | memoryview,
    key: bytes,
    name: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    *,
    auth_key: bytes | None = None,
) -> Decoded:
    """The rows of ``value`` if it holds entry ``name`` of block ``key`` as expected.

    With ``auth_key`` only a value whose MAC holds under that key is served;
    without, only a value with a plain checksum.

    Returns:
        The rows (a CPU tensor viewing ``value``: copy it before ``value``
        goes), or the `Rejection`.
    """
    return decode_as(value, key, layout(name, dtype, shape), auth_key=auth_key)


def decode_as(
    value: bytes | bytearray | memoryview,
    key: bytes,
    lay: Layout,
    *,
    auth_key: bytes | None = None,
) -> Decoded:
    """`decode` against a prepared `Layout` (readers build one per entry)."""
    view = memoryview(value)
    if len(view) < _FIXED.size:
        return Decoded(None, Rejection.FORMAT)
    magic, version, order, dlen, ndim, slen, elen, nbytes = _FIXED.unpack_from(view)
    if magic not in (MAGIC, MAGIC_KEYED) or version != FORMAT_VERSION:
        return Decoded(None, Rejection.FORMAT)
    if magic != (MAGIC if auth_key is None else MAGIC_KEYED):
        # NOTE: a keyed reader never falls back to a plain checksum, which
        # anyone can compute.
        return Decoded(None, Rejection.MISMATCH)
    checksum_at = _FIXED.size + dlen + 8 * ndim + slen + elen
    if len(view) != checksum_at + _CHECKSUM_SIZE + nbytes:
        return Decoded(None, Rejection.FORMAT)
    if len(key) > 255:
        return Decoded(None, Rejection.MISMATCH)
    expected = _header(key, lay, lay.nbytes, auth_key)
    if (
        order != _NATIVE_ORDER
        or nbytes != lay.nbytes
        or checksum_at != len(expected)
        or view[_FIXED.size : checksum_at] != expected[_FIXED.size :]
    ):
        return Decoded(None, Rejection.MISMATCH)
    rows_at = checksum_at + _CHECKSUM_SIZE
    check = _check(auth_key, view[:checksum_at], view[rows_at:])
    # NOTE: compared in constant time: with a key the check is a MAC.
    if not hmac.compare_digest(check, view[checksum_at:rows_at]):
        return Decoded(None, Rejection.CHECKSUM)
    if nbytes == 0:
        return Decoded(torch.empty(lay.shape, dtype=lay.dtype), None)
    rows = torch.frombuffer(view, dtype=torch.uint8, offset=rows_at, count=nbytes)
    return Decoded(rows.view(lay.dtype).view(lay.shape), None)
