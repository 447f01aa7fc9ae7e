"""The collector `OmniKVCacheManager` installs as ``BlockPool.metrics_collector``.

vLLM calls the pool's collector ``on_block_evicted`` for each block it hands
out (``get_new_blocks``) or whose keys it drops (``evict_blocks``), while the
block still holds its old keys, and ``reset`` when the prefix cache is reset.
Every KV cache group draws its blocks from that one pool, so one hook sees
every reuse, whichever group the block served before or serves next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ReuseHook"]


class ReuseHook:
    """Stands in for ``BlockPool.metrics_collector`` and forwards to the one it replaced.

    Args:
        inner: the collector that was there (None: none).
        on_reused: called with each block vLLM hands out again or whose keys
            it drops, before the collector it replaced hears of it.
        on_reset: called when the prefix cache is reset.
    """

    __slots__ = ("inner", "on_reset", "on_reused")

    def __init__(
        self, inner: Any, on_reused: Callable[[Any], None], on_reset: Callable[[], None]
    ) -> None:
        self.inner = inner
        self.on_reused = on_reused
        self.on_reset = on_reset

    def on_block_evicted(self, block: Any) -> None:
        self.on_reused(block)
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def reset(self) -> None:
        self.on_reset()
        if self.inner is not None:
            self.inner.reset()

    def on_block_allocated(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def should_sample_block(self) -> bool:
        return self.inner is not None and bool(self.inner.should_sample_block())

    def drain_events(self) -> list[Any]:
        return [] if self.inner is None else list(self.inner.drain_events())
