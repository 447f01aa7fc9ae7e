"""vLLM's KV cache manager as an engine builds it, for one group or several (hybrid models).

For tests and benchmarks that drive vLLM's scheduler side by hand: an engine
builds its manager from the model's layers; these build
the same manager for one group of full-attention layers, or for one group per
spec given (full attention beside sliding window, chunked local attention or
Mamba layers), caching prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from omnicache.checks import check_bool, check_int
from omnicache.integrations.vllm.common import require_vllm, vllm_series

__all__ = ["new_hybrid_kv_cache_manager", "new_kv_cache_manager"]


def new_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    *,
    max_model_len: int,
    num_kv_heads: int = 1,
    head_size: int = 8,
    dtype: torch.dtype = torch.float16,
    enable_kv_cache_events: bool = True,
    num_hash_lookahead_tokens: int = 0,
) -> Any:
    """A `vllm.v1.core.kv_cache_manager.KVCacheManager` with prefix caching on.

    Args:
        num_blocks: Blocks in the pool (block 0 is vLLM's null block).
        block_size: Tokens per block, for the KV cache and for block hashes.
        max_model_len: The longest request the manager accepts, in tokens.
        num_kv_heads, head_size, dtype: The attention spec's shape (the
            scheduler side uses it only to size pages).
        enable_kv_cache_events: Whether the manager queues KV cache events.
        num_hash_lookahead_tokens: vLLM 0.33's lookahead block hashes (EAGLE-
            style drafters); vLLM 0.32 has none, so only 0 there.
    """
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    check_int("num_blocks", num_blocks, minimum=2)
    check_int("block_size", block_size, minimum=1)
    check_int("max_model_len", max_model_len, minimum=1)
    check_bool("enable_kv_cache_events", enable_kv_cache_events)
    check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, minimum=0)
    lookahead: dict[str, int] = {}
    if num_hash_lookahead_tokens:
        series = vllm_series()
        if series == "0.32.":
            raise ValueError(
                f"num_hash_lookahead_tokens: expected 0 (vLLM {series}x has no lookahead "
                f"block hashes), found {num_hash_lookahead_tokens}"
            )
        lookahead["num_hash_lookahead_tokens"] = num_hash_lookahead_tokens
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
        **lookahead,
    )


def new_hybrid_kv_cache_manager(
    num_blocks: int,
    specs: Sequence[Any],
    *,
    max_model_len: int,
    hash_block_size: int | None = None,
    enable_kv_cache_events: bool = True,
) -> Any:
    """A `vllm.v1.core.kv_cache_manager.KVCacheManager` with one KV cache group per spec.

    As vLLM's engine sizes them: the scheduler's block size is the least
    common multiple of the groups' block sizes, and the hash block size by
    default their greatest common divisor.

    Args:
        num_blocks: Blocks in the pool every group shares (block 0 is vLLM's null block).
        specs: One ``vllm.v1.kv_cache_interface.KVCacheSpec`` per group, in order.
        max_model_len: The longest request the manager accepts, in tokens.
        hash_block_size: Tokens per block key; it divides every group's block size.
        enable_kv_cache_events: Whether the manager queues KV cache events.
    """
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

    check_int("num_blocks", num_blocks, minimum=2)
    check_int("max_model_len", max_model_len, minimum=1)
    check_bool("enable_kv_cache_events", enable_kv_cache_events)
    if not specs or not all(isinstance(spec, KVCacheSpec) for spec in specs):
        raise TypeError(
            f"specs: expected one or more KVCacheSpec, found {[type(s).__name__ for s in specs]}"
        )
    sizes = [int(spec.block_size) for spec in specs]
    if hash_block_size is None:
        hash_block_size = math.gcd(*sizes)
    check_int("hash_block_size", hash_block_size, minimum=1)
    if any(size % hash_block_size for size in sizes):
        raise ValueError(
            f"hash_block_size: expected a divisor of every group's block size {sizes}, "
            f"found {hash_block_size}"
        )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
            for i, spec in enumerate(specs)
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=math.lcm(*sizes),
        hash_block_size=hash_block_size,
        enable_caching=True,
        enable_kv_cache_events=enable_kv_cache_events,
    )
