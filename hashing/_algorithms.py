"""The digest algorithms behind every content hash and block key.

Each algorithm is reached through one incremental interface (``update`` with a
contiguous byte buffer, ``digest``), so the canonical encoder never branches on
the algorithm. Registry, not if/elif: adding an algorithm is one entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Literal, Protocol, get_args

import blake3
import xxhash

Algorithm = Literal["blake3", "sha256", "xxh3_128"]
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)
DEFAULT_ALGORITHM: Algorithm = "blake3"

# NOTE: blake3 can spread one large update over both cores of these machines,
# but waking its worker threads has a cost, and on a shared 2-core machine the
# second core is not always there. Timed between unrelated work (as hashing
# runs in a server, not back to back), threads lost at 1-2 MiB (0.7-0.8x) and
# won from 4 MiB (1.5x) when the second core was free; with it busy they
# cost 3-7% at 4-16 MiB. Callers pass the size of the update they are about
# to make.
BLAKE3_THREADS_MIN_BYTES = 4 << 20


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


def _blake3(size_hint: int) -> Hasher:
    if size_hint >= BLAKE3_THREADS_MIN_BYTES:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


def _sha256(size_hint: int) -> Hasher:
    return hashlib.sha256()


def _xxh3_128(size_hint: int) -> Hasher:
    return xxhash.xxh3_128()


_CONSTRUCTORS: dict[str, Callable[[int], Hasher]] = {
    "blake3": _blake3,
    "sha256": _sha256,
    "xxh3_128": _xxh3_128,
}
_DIGEST_SIZES: dict[str, int] = {"blake3": 32, "sha256": 32, "xxh3_128": 16}


def check_algorithm(algorithm: object) -> Algorithm:
    """Return ``algorithm`` if it names a supported algorithm, else raise ValueError."""
    if not isinstance(algorithm, str) or algorithm not in _CONSTRUCTORS:
        raise ValueError(f"algorithm: expected one of {', '.join(ALGORITHMS)}, found {algorithm!r}")
    return algorithm  # type: ignore[return-value]


def digest_size(algorithm: Algorithm) -> int:
    """Bytes in a digest of ``algorithm``: 32 for blake3 and sha256, 16 for xxh3_128."""
    return _DIGEST_SIZES[check_algorithm(algorithm)]


def new_hasher(algorithm: Algorithm, size_hint: int = 0) -> Hasher:
    """A fresh incremental hasher; ``size_hint`` is the number of bytes to come."""
    return _CONSTRUCTORS[check_algorithm(algorithm)](size_hint)
