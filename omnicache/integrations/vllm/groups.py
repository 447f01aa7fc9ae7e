"""Which of vLLM's KV cache groups the store's rows follow, and that group's block keys.

A model may have several KV cache groups (full attention beside sliding
window, chunked local attention or Mamba layers), each with its own block
table over one shared ``BlockPool``. The store keeps one row per token, so its
rows follow ONE group's block ids: a full-attention group, because it is the
only kind that holds a block for every token of a prefix. A sliding-window
group nulls the blocks that left its window, a chunked local group those
before the current chunk, and a Mamba group keeps one state per block, so
rows indexed by their block ids would lose most of a prefix; a circular
buffer holds one scratch block per request that vLLM never caches. These sit
beside the full-attention group. A model without a full-attention group is
refused, and so is every kind of group vLLM itself does not prefix-cache
(cross-attention, reference sliding windows, static sinks, HiSparse, Mamba
outside "align" mode), each with the reason (`_refused_managers`).

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
    """The kinds of group vLLM prefix-caches (or skips in its lookups), by exact class."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        ChunkedLocalAttentionManager,
        CircularBufferManager,
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )

    # NOTE: by exact class: vLLM's subclasses change which blocks a table
    # holds (see `_refused_managers`). A circular buffer is one scratch block
    # per request that vLLM leaves out of every lookup (its spec is not
    # ``prefix_cacheable``): it sits beside the groups that are cached.
    return {
        FullAttentionManager: "full attention",
        SlidingWindowManager: "sliding window",
        ChunkedLocalAttentionManager: "chunked local attention",
        MambaManager: "Mamba",
        CircularBufferManager: "circular buffer",
    }


def _refused_managers() -> dict[type[Any], str]:
    """Kinds of group vLLM itself does not prefix-cache, or caches where the store cannot follow."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        CrossAttentionManager,
        HiSparseHotManager,
        HiSparseResidentManager,
        HiSparseSourceManager,
        RSWAManager,
        SinkFullAttentionManager,
    )

    hisparse = (
        "vLLM does not prefix-cache HiSparse hot or resident groups (their spec is not "
        "prefix_cacheable); a HiSparse model's prefix cache is its source group's host pages"
    )
    return {
        RSWAManager: (
            "vLLM does not prefix-cache reference sliding windows: the model that makes them "
            "(Unlimited-OCR) turns prefix caching off, its decode KV not being a function of "
            "its prefix"
        ),
        CrossAttentionManager: (
            "vLLM does not prefix-cache cross-attention: encoder-decoder models do not support "
            "prefix caching, and this manager's lookup raises"
        ),
        SinkFullAttentionManager: (
            "vLLM does not prefix-cache static-sink attention: its KV cache coordinator cannot "
            "build this manager (its constructor takes no needs_kv_cache_zeroing)"
        ),
        HiSparseSourceManager: (
            "vLLM prefix-caches a HiSparse model in this group's host pages, a block pool of "
            "their own, which the store (indexed by the manager's pool) cannot follow"
        ),
        HiSparseHotManager: hisparse,
        HiSparseResidentManager: hisparse,
    }


def _check_group(index: int, group_manager: Any, supported: dict[type[Any], str]) -> str:
    """The kind of group ``index``, if the store can stand beside it or follow it."""
    kind = supported.get(type(group_manager))
    where = f"group {index} ({type_name(group_manager.kv_cache_spec)})"
    if kind is None:
        reason = _refused_managers().get(type(group_manager))
        raise ValueError(
            f"manager: expected KV cache groups of {', '.join(supported.values())}, "
            f"found {type_name(group_manager)} for {where}"
            + ("" if reason is None else f": {reason}")
        )
    mode = getattr(group_manager, "mamba_cache_mode", "align")
    if kind == "Mamba" and mode != "align":
        raise ValueError(
            f"manager: expected Mamba groups in mamba_cache_mode 'align' (the only mode vLLM "
            f"prefix-caches), found {mode!r} for {where}"
        )
    return kind


def store_group(manager: Any, kv_cache_group_id: int | None) -> StoreGroup:
    """The group the store follows: ``kv_cache_group_id``, or the first full-attention group.

    Raises:
        ValueError: a group of another kind than full attention, sliding
            window, chunked local attention, Mamba ("align") or circular
            buffer (the error says why vLLM does not prefix-cache a kind it
            names); groups on several block pools; no full-attention group,
            or ``kv_cache_group_id`` naming another kind of group.
    """
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    supported = _supported_managers()
    managers = manager.coordinator.single_type_managers
    kinds: list[str] = []
    for index, group_manager in enumerate(managers):
        kind = _check_group(index, group_manager, supported)
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
