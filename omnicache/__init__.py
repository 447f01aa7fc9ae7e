"""omnicache: a content-addressed prefix cache for multimodal model serving.

The torch-free layers (annotations, prompt annotation, block keys, block pool,
prefix cache) are imported eagerly; the tensor store, which needs torch, is
imported on first use of its names, so a router or a preprocessing process
can compute keys without torch installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from omnicache.annotations import AnnotatedTokens, TokenBlock, TokenRangeAnnotation
from omnicache.block_hash import (
    DEFAULT_BLOCK_ALGORITHM,
    BlockHash,
    BlockHasher,
    block_hash_hex,
    block_hash_low64,
)
from omnicache.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheBlock,
)
from omnicache.prefix_cache import PrefixCache, PrefixCacheStats, RequestBlocks
from omnicache.preprocess import annotate_prompt

if TYPE_CHECKING:
    from omnicache.store import StaleBlockError, StoreCapacityError, TensorStore

__all__ = [
    "DEFAULT_BLOCK_ALGORITHM",
    "AllBlocksCleared",
    "AnnotatedTokens",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheBlock",
    "PrefixCache",
    "PrefixCacheStats",
    "RequestBlocks",
    "StaleBlockError",
    "StoreCapacityError",
    "TensorStore",
    "TokenBlock",
    "TokenRangeAnnotation",
    "annotate_prompt",
    "block_hash_hex",
    "block_hash_low64",
]

_LAZY = {"TensorStore", "StaleBlockError", "StoreCapacityError"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("omnicache.store"), name)
    raise AttributeError(f"module 'omnicache' has no attribute {name!r}")
