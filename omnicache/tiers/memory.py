"""MemoryTier: a `BlockTier` in this process's memory.

For several engines in one process, and as the reference the tier contract
tests hold `RedisTier` to: it keeps the same values under the same keys, with
an LRU byte cap in place of Redis's ``maxmemory``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_optional_int
from omnicache.store import EntrySpec, TierBlock
from omnicache.tiers import codec
from omnicache.tiers.base import TierStats, check_key_part, decode_run, value_key

__all__ = ["MemoryTier"]


class MemoryTier:
    """Block values in a dict, least recently used evicted beyond ``max_bytes``.

    Args:
        namespace: Second part of every value key (a deployment, a model).
        prefix: First part of every value key.
        max_bytes: Cap on the bytes of all values (None: no cap); the least
            recently written or read values go first.
        max_value_bytes: Largest value kept (None: no limit); larger ones are
            counted in ``num_oversize_values``.
        auth_key: 32 secret bytes: values carry a keyed MAC, and only values
            whose MAC holds are served (see `omnicache.tiers.codec`).
    """

    def __init__(
        self,
        *,
        namespace: str = "default",
        prefix: str = "omnicache",
        max_bytes: int | None = None,
        max_value_bytes: int | None = None,
        auth_key: bytes | None = None,
    ) -> None:
        self.namespace = check_key_part("namespace", namespace)
        self.prefix = check_key_part("prefix", prefix)
        check_optional_int("max_bytes", max_bytes, minimum=1)
        check_optional_int("max_value_bytes", max_value_bytes, minimum=1)
        self._auth_key = codec.check_auth_key(auth_key)
        self.max_bytes = max_bytes
        self.max_value_bytes = max_value_bytes
        # Value key -> value, least recently used first. Tests may edit it.
        self.values: OrderedDict[str, bytes] = OrderedDict()
        self._nbytes = 0
        self._stats = TierStats()
        self._lock = threading.Lock()

    @property
    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    def put(self, blocks: Sequence[TierBlock]) -> None:
        """Keeps each block's rows under ``{prefix}:{namespace}:{key hex}:{entry}``."""
        encoded = [
            (
                value_key(self.prefix, self.namespace, b.key, b.name),
                codec.encode(b.key, b.name, b.rows, auth_key=self._auth_key),
            )
            for b in blocks
        ]
        with self._lock:
            stats = self._stats
            for name, value in encoded:
                stats.num_put_values += 1
                if self.max_value_bytes is not None and len(value) > self.max_value_bytes:
                    stats.num_oversize_values += 1
                    continue
                old = self.values.pop(name, None)
                if old is not None:
                    self._nbytes -= len(old)
                self.values[name] = value
                self._nbytes += len(value)
                stats.num_written_values += 1
            if self.max_bytes is not None:
                while self._nbytes > self.max_bytes and self.values:
                    _, value = self.values.popitem(last=False)
                    self._nbytes -= len(value)

    def get(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> list[Mapping[str, torch.Tensor]]:
        """The leading blocks of ``keys`` held whole (see `BlockTier.get`)."""
        names = [[value_key(self.prefix, self.namespace, k, e.name) for e in entries] for k in keys]
        with self._lock:
            stats = self._stats
            stats.num_get_calls += 1
            stats.num_get_blocks += len(keys)

            def value_of(index: int, j: int) -> bytes | None:
                value = self.values.get(names[index][j])
                if value is not None:
                    self.values.move_to_end(names[index][j])
                return value

            def on_reject(index: int, spec: EntrySpec, why: codec.Rejection) -> None:
                stats.num_rejected_values += 1

            run = decode_run(keys, entries, block_size, value_of, on_reject, self._auth_key)
            stats.num_hit_blocks += len(run)
            return run
