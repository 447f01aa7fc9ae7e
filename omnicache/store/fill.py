"""The fill rule and the stamp rule: when a block's rows are complete, and when stamped.

Each rule is one function that every write path calls: the small-write path
on Python ints, one run or block at a time, and the general path on numpy
arrays of every run and block of a write at once (see `omnicache.store` for
what fill counts and stamps are).
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np
import numpy.typing as npt

from omnicache.block_hash import BlockHash

# Fill count of a block whose rows did not arrive in order from offset 0.
BROKEN = -1

BoolArray = npt.NDArray[np.bool_]


@overload
def fill_after(filled: int, offset: int, length: int) -> int: ...


@overload
def fill_after(
    filled: npt.NDArray[np.int32], offset: npt.NDArray[np.int64], length: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]: ...


def fill_after(filled: Any, offset: Any, length: Any) -> Any:
    """The fill count of a block after a run of ``length`` rows written at ``offset``.

    A run from offset 0 restarts the block's run, and a run that starts at
    its fill count ``filled`` extends it: either way the block then holds its
    rows ``0 .. offset + length - 1`` in order. Any other run (a gap, a
    rewrite in the middle) breaks the block until its next offset-0 write.

    Elementwise over numpy arrays (the general path: every run of a write at
    once), or over Python ints (one run at a time).
    """
    if type(offset) is int:
        # NOTE: a conditional rather than the arrays' expression: a decode
        # step calls this once per request, on the small-write path.
        return offset + length if offset == 0 or filled == offset else BROKEN
    return np.where((offset == 0) | (filled == offset), offset + length, BROKEN)


@overload
def stamp_rule(key: BlockHash | None, filled: int, block_size: int) -> tuple[bool, bool]: ...


@overload
def stamp_rule(
    key: npt.NDArray[np.object_], filled: npt.NDArray[np.int32], block_size: int
) -> tuple[BoolArray, BoolArray]: ...


def stamp_rule(key: Any, filled: Any, block_size: int) -> tuple[Any, Any]:
    """Whether a block a write touched is stamped with ``key``, and whether it is incomplete.

    A touched block is stamped exactly when the caller gave its key and its
    rows are complete (``filled == block_size``), and incomplete when keyed
    but not complete; every other touched block loses its stamp, since its
    rows changed. So a block without a key is neither stamped nor incomplete,
    and a keyed block is one or the other.

    Elementwise: ``key`` is a key or None and ``filled`` an int, or an object
    array of them and an array.
    """
    keyed = key != None  # noqa: E711 (elementwise on an object array)
    return keyed & (filled == block_size), keyed & (filled != block_size)
