"""The reference engine: the block manager of a small engine of omnicache's own.

Inside vLLM, vLLM's own block pool and KV cache manager hold the blocks,
and omnicache keys them and caps their hits (`omnicache.integrations.vllm`).
This package writes that part out for an engine of omnicache's own, so the
library's pieces can be seen working together without vLLM: chained block
keys, the longest cached prefix, allocation, and lazy LRU eviction that
tells a listener (the store) which block lost which key. The demo's
`ServingEngine` (`omnicache.demo.engine`), the benchmarks and the tests
run on it.

- `omnicache.reference.block_pool`: `BlockPool`, the hash→block table,
  reference counts, the free queue (LRU) and the events it emits.
- `omnicache.reference.prefix_cache`: `PrefixCache`, per-request lookup,
  allocation and stats over a pool and a `BlockHasher`.

No part of the library imports it (the store knows a pool only by its
eviction listeners, `TensorStore.attach`), and it imports no torch. See
docs/architecture.md.
"""

from omnicache.reference.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheBlock,
)
from omnicache.reference.prefix_cache import PrefixCache, PrefixCacheStats, RequestBlocks

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheBlock",
    "PrefixCache",
    "PrefixCacheStats",
    "RequestBlocks",
]
