"""Block ids, block keys and a step's requests, as callers hand them in: checked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, check_str, type_name
from omnicache.store.slots import IntArray
from omnicache.store.specs import ScheduledRequest


def check_block_id(what: str, block_id: int, num_blocks: int) -> None:
    """One block id: an int (numpy ints too, never a bool) in ``0..num_blocks - 1``."""
    if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
        raise TypeError(f"{what}: expected int, found {type_name(block_id)}")
    if not 0 <= block_id < num_blocks:
        raise IndexError(f"{what}: expected 0..{num_blocks - 1}, found {block_id}")


def block_id_array(
    what: str, block_ids: Sequence[int], num_blocks: int, *, distinct: bool = True
) -> IntArray:
    """Block ids as a contiguous int64 array, checked (and distinct unless told)."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"{what}: expected a flat sequence of int, found {block_ids!r}")
    if not ids.size:
        return ids.astype(np.int64)
    # NOTE: contiguous, as the gathers index with it (see slots.parse_slots).
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= num_blocks:
        index = int(np.flatnonzero((ids < 0) | (ids >= num_blocks))[0])
        raise IndexError(f"{what}[{index}]: expected 0..{num_blocks - 1}, found {int(ids[index])}")
    if distinct and np.bincount(ids).max() > 1:
        raise ValueError(f"{what}: expected distinct blocks, found {ids.tolist()}")
    return ids


SMALL_BLOCK_IDS = 32
"""Block ids of at most this many are handled as Python ints (`small_block_ids`)."""


def small_block_ids(block_ids: list[int], num_blocks: int) -> list[int] | None:
    """``block_ids`` if they are few, of type int and in range; else None (`block_id_array`).

    NOTE: a decode step clears the stamps of a block or two, and numpy's
    per-call work (right after a forward pass, cold) costs a hundred times
    the clearing. None hands the ids to the general path, which raises the
    errors.
    """
    if len(block_ids) > SMALL_BLOCK_IDS:
        return None
    for block_id in block_ids:
        if type(block_id) is not int or not 0 <= block_id < num_blocks:
            return None
    return block_ids


def hit_blocks(
    block_ids: Sequence[int],
    block_keys: Sequence[BlockHash],
    num_blocks: int,
    *,
    distinct: bool = False,
) -> IntArray:
    """The blocks as an id array, checked with their keys.

    A block may repeat unless ``distinct``: reading it twice is harmless,
    filling it twice is not.
    """
    if len(block_ids) != len(block_keys):
        raise ValueError(
            f"block_keys: expected {len(block_ids)} keys (one per block), found {len(block_keys)}"
        )
    if not all(issubclass(t, bytes) for t in set(map(type, block_keys))):
        for index, key in enumerate(block_keys):
            if not isinstance(key, bytes):
                raise TypeError(f"block_keys[{index}]: expected bytes, found {type_name(key)}")
    return block_id_array("block_ids", block_ids, num_blocks, distinct=distinct)


def hit_block_list(
    block_ids: Sequence[int], block_keys: Sequence[BlockHash], num_blocks: int
) -> list[int]:
    """`hit_blocks` as a list; lists and tuples of a few ints skip numpy.

    NOTE: input the quick checks do not accept goes through `hit_blocks`,
    which raises the errors.
    """
    if type(block_ids) in (list, tuple) and len(block_ids) == len(block_keys):
        if not block_ids:
            return []
        if (
            set(map(type, block_ids)) == {int}
            and min(block_ids) >= 0
            and max(block_ids) < num_blocks
            and all(issubclass(t, bytes) for t in set(map(type, block_keys)))
        ):
            return list(block_ids)
    ids: list[int] = hit_blocks(block_ids, block_keys, num_blocks).tolist()
    return ids


def check_block_keys(
    block_keys: Mapping[int, BlockHash] | None, num_blocks: int
) -> Mapping[int, BlockHash]:
    """A write's keys by block id (None: none), checked."""
    if block_keys is None:
        return {}
    # NOTE: the exact-type test spares most calls the slower ABC check.
    if type(block_keys) is not dict and not isinstance(block_keys, Mapping):
        raise TypeError(
            f"block_keys: expected a mapping block id -> key, found {type_name(block_keys)}"
        )
    if not block_keys:
        return block_keys
    # NOTE: type sets are built in C; the per-item loops run only to name an error.
    id_types = set(map(type, block_keys))
    if id_types != {int} or min(block_keys) < 0 or max(block_keys) >= num_blocks:
        for block_id in block_keys:
            if type(block_id) is not int:
                raise TypeError(f"block_keys: expected int block ids, found {type_name(block_id)}")
            if not 0 <= block_id < num_blocks:
                raise IndexError(
                    f"block_keys: expected block ids 0..{num_blocks - 1}, found {block_id!r}"
                )
    key_types = set(map(type, block_keys.values()))
    if not all(issubclass(t, bytes) for t in key_types):
        for block_id, key in block_keys.items():
            if not isinstance(key, bytes):
                raise TypeError(f"block_keys[{block_id}]: expected bytes, found {type_name(key)}")
    return block_keys


def request_spans(requests: Sequence[ScheduledRequest]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` rows of each request in a step's outputs, requests checked."""
    spans: list[tuple[int, int]] = []
    start = 0
    seen: set[str] = set()
    for index, request in enumerate(requests):
        if not isinstance(request, ScheduledRequest):
            raise TypeError(
                f"requests[{index}]: expected ScheduledRequest, found {type_name(request)}"
            )
        n = request.num_new_tokens
        computed = request.num_computed_tokens
        req_id = request.req_id
        # NOTE: this loop runs for every request of every step; the checks
        # (and their names) run only for a request that fails this test.
        if (
            type(n) is not int
            or n < 0
            or type(computed) is not int
            or computed < 0
            or not isinstance(req_id, str)
        ):
            check_int(f"requests[{index}].num_new_tokens", n, minimum=0)
            check_int(f"requests[{index}].num_computed_tokens", computed, minimum=0)
            check_str(f"requests[{index}].req_id", req_id)
        if req_id in seen:
            raise ValueError(f"requests[{index}]: request {req_id!r} listed twice")
        seen.add(req_id)
        spans.append((start, start + n))
        start += n
    return spans
