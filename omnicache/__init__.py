"""omnicache: a content-addressed prefix cache for multimodal model serving.

The torch-free layers (annotations, prompt annotation, block keys) are
imported eagerly; the tensor store, which needs torch, is imported on first
use of its names, so a router or a preprocessing process can compute keys
without torch installed. The reference engine's block pool and prefix cache
(`BlockPool`, `PrefixCache`, their events and results) live in
`omnicache.reference`, the vLLM integration in `omnicache.integrations.vllm`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher, block_hash_hex, block_hash_low64
from omnicache.preprocess import annotate_prompt

if TYPE_CHECKING:
    from omnicache.store import (
        HIDDEN_STATES,
        BlockTier,
        EntrySpec,
        MergedRead,
        ReadMiss,
        ScheduledRequest,
        StaleBlockError,
        StaleCommitError,
        StoreCapacityError,
        StoreStats,
        TensorStore,
        TierBlock,
        WriteResult,
    )

__all__ = [
    "HIDDEN_STATES",
    "AnnotatedTokens",
    "BlockHash",
    "BlockHasher",
    "BlockTier",
    "EntrySpec",
    "MergedRead",
    "ReadMiss",
    "ScheduledRequest",
    "StaleBlockError",
    "StaleCommitError",
    "StoreCapacityError",
    "StoreStats",
    "TensorStore",
    "TierBlock",
    "TokenRangeAnnotation",
    "WriteResult",
    "annotate_prompt",
    "block_hash_hex",
    "block_hash_low64",
]

# The names of __all__ not imported above: the store's, imported from
# omnicache.store (and so torch) on first use.
_LAZY = frozenset(__all__) - frozenset(globals())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("omnicache.store"), name)
    raise AttributeError(f"module 'omnicache' has no attribute {name!r}")
