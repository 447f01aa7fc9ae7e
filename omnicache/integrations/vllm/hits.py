"""Hits the store can serve: vLLM's lookup, shortened until the store holds every row of it.

A hit comes with its rows only if every block of it in the store group holds
the request's key for that block (its stamps). A hit that ends inside a
block, or on blocks without their rows, is shortened, and shortened the way
vLLM would find it: by looking it up again, over every group, at the
longest length the store serves. Truncating each group's block list instead
would be wrong for a sliding-window group, whose hit is the window of blocks
that ends at the hit's end: at a shorter length it needs other blocks (which
vLLM may not hold, so the hit may shrink further), and a chunked local group
needs the blocks of the chunk that holds the new end.
"""

from __future__ import annotations

from typing import Any

from omnicache.integrations.vllm.groups import StoreGroup, group_keys
from omnicache.store import TensorStore

__all__ = ["cap_hit", "lookup"]


def cap_hit(
    manager: Any, store: TensorStore, group: StoreGroup, request: Any, blocks: Any, num_hit: int
) -> tuple[tuple[Any, int, int] | None, int]:
    """vLLM's hit of ``num_hit`` tokens (``blocks``), or one the store serves.

    Every lookup is shorter than the one before, so this ends.

    Returns:
        None if vLLM's hit comes with its rows, else the hit the store serves
        as vLLM's lookup returns it (blocks per group, tokens, shared-prefix
        boundary); and the store group's hit blocks found without their rows.
    """
    block_size = group.block_size
    keys = group_keys(request.block_hashes, group.scale)
    capped: tuple[Any, int, int] | None = None
    num_capped = 0
    while True:
        num_blocks = num_hit // block_size
        hit = blocks.blocks[group.group_id][:num_blocks]
        num_valid = store.probe([block.block_id for block in hit], keys[:num_blocks])
        if num_valid * block_size == num_hit:
            return capped, num_capped
        num_capped += num_blocks - num_valid
        # NOTE: a free block without its outputs can never serve a hit (only
        # an owner writes rows), yet vLLM would keep finding it first among
        # blocks that share its key, such as the copy this request is about
        # to compute. Dropping its key lets the next lookup find the copy. A
        # held block keeps its key: its owner may still commit deferred rows.
        useless = {
            block.block_id
            for block, key in zip(hit[num_valid:], keys[num_valid:num_blocks], strict=True)
            if block.ref_cnt == 0 and not store.probe([block.block_id], [key])
        }
        if useless:
            manager.evict_blocks(useless)
        capped = lookup(manager, request, num_valid * block_size)
        blocks, num_hit, _ = capped


def lookup(manager: Any, request: Any, max_length: int) -> tuple[Any, int, int]:
    """vLLM's lookup over every group for a hit of at most ``max_length`` tokens.

    NOTE: the coordinator's, not the manager's: 0.32's manager takes no
    length. The third value is the manager's shared-prefix boundary.
    """
    if max_length == 0:
        return manager.empty_kv_cache_blocks, 0, 0
    found, num_hit, num_uncached = manager.coordinator.find_longest_cache_hit(
        request.block_hashes, max_length
    )
    boundary = num_hit + num_uncached if num_uncached else 0
    return manager.create_kv_cache_blocks(found), num_hit, boundary
