"""Which of vLLM's KV cache groups the store's rows follow, and that group's block keys.

A model may have several KV cache groups (full attention beside sliding
window, chunked local attention or Mamba layers), each with its own block
table over one shared ``BlockPool``. The store keeps one row per token, so its
rows follow ONE group's block ids: a full-attention group, because it is the
only kind that holds a block for every token of a prefix. A sliding-window
group nulls the blocks that left its window, a chunked local group those
before the current chunk, and a Mamba group keeps one state per block, so
rows indexed by their block ids would lose most of a prefix. A model without
a full-attention group is refused.

vLLM hashes prompts in blocks of ``hash_block_size`` tokens, which may be finer
than the group's block size; each key chains over its whole prefix, so the key
of a group block is the hash at its last hash boundary (as vLLM's
``BlockHashListWithBlockSize`` views them):

```
hash blocks (16)  | A | B | C | D |      request.block_hashes = [A, B, C, D]
group blocks (32) |   B   |   D   |      group_keys(...)      = [B, D]
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, type_name

__all__ = ["StoreGroup", "group_keys", "store_group"]


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


def _supported_managers() -> dict[type[Any], str]:
    from vllm.v1.core.single_type_kv_cache_manager import (
        ChunkedLocalAttentionManager,
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )

    # NOTE: by exact class: vLLM's subclasses (sinks, circular buffers, sparse
    # tiers, reference sliding windows) change which blocks a table holds.
    return {
        FullAttentionManager: "full attention",
        SlidingWindowManager: "sliding window",
        ChunkedLocalAttentionManager: "chunked local attention",
        MambaManager: "Mamba",
    }


def store_group(manager: Any, kv_cache_group_id: int | None) -> StoreGroup:
    """The group the store follows: ``kv_cache_group_id``, or the first full-attention group.

    Raises:
        ValueError: a group of another kind than full attention, sliding
            window, chunked local attention or Mamba; groups on several block
            pools; no full-attention group, or ``kv_cache_group_id`` naming
            another kind of group.
    """
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    supported = _supported_managers()
    managers = manager.coordinator.single_type_managers
    kinds: list[str] = []
    for index, group_manager in enumerate(managers):
        kind = supported.get(type(group_manager))
        if kind is None:
            raise ValueError(
                f"manager: expected KV cache groups of {', '.join(supported.values())}, "
                f"found {type_name(group_manager)} for group {index} "
                f"({type_name(group_manager.kv_cache_spec)})"
            )
        if group_manager.block_pool is not manager.block_pool:
            # NOTE: every reuse must pass the one hook on the manager's pool.
            raise ValueError(
                f"manager: expected every KV cache group on the manager's block pool, "
                f"found group {index} ({kind}) on another pool"
            )
        kinds.append(kind)
    full = [index for index, m in enumerate(managers) if type(m) is FullAttentionManager]
    if kv_cache_group_id is None:
        if not full:
            raise ValueError(
                "manager: expected a full-attention KV cache group (the only kind whose "
                f"blocks hold every token of a prefix, which the store's rows follow), "
                f"found groups {kinds}"
            )
        group_id = full[0]
    else:
        group_id = check_int(
            "kv_cache_group_id", kv_cache_group_id, minimum=0, maximum=len(managers) - 1
        )
        if group_id not in full:
            raise ValueError(
                f"kv_cache_group_id: expected a full-attention group {full}, found group "
                f"{group_id} ({kinds[group_id]})"
            )
    block_size = int(managers[group_id].block_size)
    hash_block_size = int(manager.block_pool.hash_block_size)
    if block_size % hash_block_size:
        raise ValueError(
            f"manager: expected a block size that is a multiple of the hash block size "
            f"{hash_block_size}, found {block_size} (group {group_id})"
        )
    return StoreGroup(group_id, block_size, block_size // hash_block_size)
