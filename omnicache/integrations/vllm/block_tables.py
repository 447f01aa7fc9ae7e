"""The engine core's block tables: a request's, and what the worker holds of each block.

Two tables the engine core keeps beside vLLM's, read together when a hit is
capped (`kv_cache_manager.cap_hit`) and when a step is planned
(`mirror.StoreMirror`):

- `RequestState`: a request's block table in the group the rows follow
  (`StoreGroup`), from its allocation to its free, and the hit it adopted;
- `WorkerTable`: per block of the KV cache, the key the worker's rows are
  stamped with and how many arrived in order, written by the store's own
  rules (`omnicache.store.fill`).

The KV cache manager writes the first and reads the second; the mirror
writes the second from the first. Neither table calls anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int
from omnicache.store.fill import fill_after

__all__ = [
    "RequestState",
    "WorkerTable",
]

NULL_BLOCK_ID = 0
"""vLLM's null block: never handed out, it stands for blocks a group skips."""


# -- the group the rows follow ----------------------------------------------------------
#
# The worker keeps one row per token, so its rows follow ONE group's block ids:
# a full-attention group, the only kind whose blocks hold every token of a
# prefix; other kinds sit beside it, and kinds vLLM does not prefix-cache are
# refused with the reason (docs/architecture.md, "Hybrid models and finer hash
# blocks"). With hash blocks finer than the group's, a group block's key is the
# hash at its last hash boundary:
#
#     hash blocks (16)  | A | B | C | D |      request.block_hashes = [A, B, C, D]
#     group blocks (32) |   B   |   D   |      group_keys(...)      = [B, D]


class StoreGroup(NamedTuple):
    """The KV cache group whose block ids index the store."""

    group_id: int
    # Tokens per block of that group (the store's block size).
    block_size: int
    # Hash blocks per group block (``block_size // hash_block_size``).
    scale: int


def group_keys(block_hashes: Sequence[BlockHash], scale: int) -> Sequence[BlockHash]:
    """The keys of a request's full group blocks, from its keys per hash block.

    With one hash block per group block, ``block_hashes`` itself (not a copy:
    this runs on every allocation).
    """
    return block_hashes[scale - 1 :: scale] if scale > 1 else block_hashes


# -- what the wrapper records of a request ------------------------------------------------


@dataclass(slots=True, eq=False)
class RequestState:
    """What the wrapper records of a request, from its allocation to its free."""

    request: Any
    # The request's block table in the rows' group (its own list, updated in place).
    blocks: list[Any]
    # Hash blocks per block of that group.
    scale: int
    # The hit it adopted, in whole blocks of that group, and their keys.
    hit_block_ids: tuple[int, ...] = ()
    hit_block_keys: tuple[BlockHash, ...] = ()

    def block_ids(
        self,
        start: int,
        num_new: int,
        block_size: int,
        block_keys: dict[int, BlockHash],
        where: str,
    ) -> list[int]:
        """The blocks of the request's tokens ``[start, start + num_new)``, ``num_new > 0``,
        in order.

        Adds to ``block_keys`` the key of each full block among them. (A
        decode step's one token: `token_block`.) Python ints throughout: a
        new request's allocation comes here once, cold, where numpy's
        per-call cost would be most of the work.
        """
        blocks = self.blocks
        stop = start + num_new
        if stop > len(blocks) * block_size:
            raise ValueError(
                f"{where}: expected tokens below {len(blocks) * block_size} ({len(blocks)} "
                f"blocks allocated), found tokens {start}..{stop - 1}"
            )
        first = start // block_size
        last = (stop - 1) // block_size
        block_ids = [block.block_id for block in blocks[first : last + 1]]
        if NULL_BLOCK_ID in block_ids:
            raise RuntimeError(
                f"{where}: tokens {start}..{stop - 1} map to vLLM's null block "
                f"(block table {block_ids})"
            )
        hashes = self.keys()
        for block in range(first, min(last + 1, len(hashes))):
            block_keys[block_ids[block - first]] = hashes[block]
        return block_ids

    def token_block(self, position: int, block_size: int) -> tuple[int, BlockHash | None] | None:
        """The block of the request's token at ``position``, and its key if it is a full block.

        None when the token has no block (out of range, or in vLLM's null
        block: `slots` says which). A decode step's one token, in a few
        statements: each request of every step comes here, where numpy's
        per-call cost would be most of the work.
        """
        index = position // block_size
        blocks = self.blocks
        if index >= len(blocks):
            return None
        block_id: int = blocks[index].block_id
        if block_id == NULL_BLOCK_ID:
            return None
        # NOTE: `keys` without its two calls when each hash block is a group block.
        hashes = self.request.block_hashes
        if self.scale > 1:
            hashes = group_keys(hashes, self.scale)
        return block_id, hashes[index] if index < len(hashes) else None

    def keys(self) -> Sequence[BlockHash]:
        """The keys of the request's full blocks in the rows' group."""
        return group_keys(self.request.block_hashes, self.scale)


# -- what the worker holds ---------------------------------------------------------------


class WorkerTable:
    """Per block, the key the worker's rows are stamped with, and how many arrived in order.

    The worker's `TensorStore` without its rows: written by the store's own
    rules (`omnicache.store.fill`), so that a block is stamped here exactly
    when it is stamped there. Plain numpy: nothing here holds a tensor.

    Args:
        num_blocks: blocks of the KV cache (vLLM's null block included).
        block_size: tokens per block of the group the rows follow.
    """

    __slots__ = ("block_size", "filled", "num_blocks", "stamps")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.stamps: list[BlockHash | None] = [None] * num_blocks
        self.filled: list[int] = [0] * num_blocks

    def write_tokens(
        self, block_ids: Sequence[int], start: int, stop: int, block_keys: Mapping[int, BlockHash]
    ) -> None:
        """Rows of a request's tokens ``start .. stop - 1``, in order, in ``block_ids`` (the
        blocks those tokens lie in, in order), with the keys of the blocks they may complete.

        Each block touched is stamped with its key if it has one and its rows
        are then complete, and loses its stamp otherwise (the store's rule,
        `write_row`'s for each block's run).
        """
        bs = self.block_size
        base = start // bs * bs
        for block_id in block_ids:
            offset = max(start - base, 0)
            end = min(stop - base, bs)
            self.write_row(block_id, offset, block_keys.get(block_id), end - offset)
            base += bs

    def write_row(self, block_id: int, offset: int, key: BlockHash | None, length: int = 1) -> None:
        """``length`` rows written at ``offset`` of one block (a decode step's one row), with
        the block's key or None (`write`'s rule)."""
        self.filled[block_id] = count = fill_after(self.filled[block_id], offset, length)
        self.stamps[block_id] = key if key is not None and count == self.block_size else None

    def stamp_blocks(self, block_ids: Sequence[int], block_keys: Sequence[BlockHash]) -> None:
        """Whole blocks written at once (loaded from a tier), each stamped with its key."""
        for block_id, key in zip(block_ids, block_keys, strict=True):
            self.filled[block_id] = self.block_size
            self.stamps[block_id] = key

    def unstamp(self, block_ids: Iterable[int]) -> None:
        """The blocks' rows were written without keys: they keep their rows, not their stamps."""
        for block_id in block_ids:
            self.stamps[block_id] = None

    def clear(self, block_ids: Iterable[int]) -> None:
        """The blocks hold nothing any more."""
        for block_id in block_ids:
            self.stamps[block_id] = None
            self.filled[block_id] = 0

    def clear_all(self) -> None:
        self.stamps = [None] * self.num_blocks
        self.filled = [0] * self.num_blocks

    def num_valid(self, block_ids: Sequence[int], block_keys: Sequence[BlockHash]) -> int:
        """How many of the leading ``block_ids`` are stamped with their ``block_keys``."""
        stamps = self.stamps
        for index, (block_id, key) in enumerate(zip(block_ids, block_keys, strict=False)):
            if stamps[block_id] != key:
                return index
        return min(len(block_ids), len(block_keys))
