"""vLLM's KV cache manager for one full-attention group, as a single-group model's engine builds it.

For code that drives vLLM's scheduler side by hand (tests, benchmarks,
examples): an engine builds its manager from the model's layers; this builds
the same manager for one group of full-attention layers, caching prefixes.
"""

from __future__ import annotations

from typing import Any

import torch

from omnicache.checks import check_bool, check_int
from omnicache.integrations.vllm.common import require_vllm

__all__ = ["new_kv_cache_manager"]


def new_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    *,
    max_model_len: int,
    num_kv_heads: int = 1,
    head_size: int = 8,
    dtype: torch.dtype = torch.float16,
    enable_kv_cache_events: bool = True,
) -> Any:
    """A `vllm.v1.core.kv_cache_manager.KVCacheManager` with prefix caching on.

    Args:
        num_blocks: Blocks in the pool (block 0 is vLLM's null block).
        block_size: Tokens per block, for the KV cache and for block hashes.
        max_model_len: The longest request the manager accepts, in tokens.
        num_kv_heads, head_size, dtype: The attention spec's shape (the
            scheduler side uses it only to size pages).
        enable_kv_cache_events: Whether the manager queues KV cache events.
    """
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    check_int("num_blocks", num_blocks, minimum=2)
    check_int("block_size", block_size, minimum=1)
    check_int("max_model_len", max_model_len, minimum=1)
    check_bool("enable_kv_cache_events", enable_kv_cache_events)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        enable_kv_cache_events=enable_kv_cache_events,
    )
