"""What `OmniKVCacheManager` records of each request: its store group's block table and hit."""

from __future__ import annotations

import reprlib
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.groups import group_keys
from omnicache.store import ScheduledRequest

__all__ = ["NULL_BLOCK_ID", "RequestState", "check_no_hit"]

NULL_BLOCK_ID = 0
"""vLLM's null block: never handed out, it stands for blocks a group skips."""


@dataclass(slots=True, eq=False)
class RequestState:
    """What the wrapper records of a request, from its allocation to its free."""

    request: Any
    # The request's block table in vLLM's store group (its own list, updated in place).
    blocks: list[Any]
    # Hash blocks per store block.
    scale: int
    num_hit_tokens: int = 0
    hit_block_ids: tuple[int, ...] = ()
    hit_block_keys: tuple[BlockHash, ...] = ()

    def slots(
        self,
        start: int,
        num_new: int,
        block_size: int,
        block_keys: dict[int, BlockHash],
        where: str,
    ) -> npt.NDArray[np.int64]:
        """Slots of the request's tokens ``[start, start + num_new)``, ``num_new > 0``.

        Adds to ``block_keys`` the key of each full block those tokens touch.
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
        positions = np.arange(start, stop, dtype=np.int64)
        ids = np.asarray(block_ids, dtype=np.int64)
        slots: npt.NDArray[np.int64] = (
            ids[positions // block_size - first] * block_size + positions % block_size
        )
        return slots

    def keys(self) -> Sequence[BlockHash]:
        """The keys of the request's full blocks in the store group."""
        return group_keys(self.request.block_hashes, self.scale)


def check_no_hit(item: ScheduledRequest, where: str) -> None:
    """Rejects a request whose hit fields the caller filled in.

    NOTE: the wrapper owns the hits: it records each request's hit blocks and
    their keys when it allocates them, and a caller's could name blocks the
    request never adopted.
    """
    for name, value in (
        ("hit_block_ids", item.hit_block_ids),
        ("hit_block_keys", item.hit_block_keys),
    ):
        if not (isinstance(value, Sized) and len(value) == 0):
            raise ValueError(
                f"{where}.{name}: expected () (the wrapper fills in the hit it recorded), "
                f"found {reprlib.repr(value)}"
            )
