"""Helpers shared by the store's test modules: stores, rows, and a store's whole state."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from helpers import DeviceConfig

from omnicache.block_hash import BlockHash
from omnicache.store import EntrySpec, StoreStats, TensorStore

# No two neighbours adjacent: every block is a run of its own.
SCATTERED = [14, 3, 9, 0, 12, 6, 1, 10, 4, 15, 7, 2, 13, 8, 11, 5]


def make(cfg: DeviceConfig, num_blocks: int = 8, block_size: int = 4, **kwargs: Any) -> TensorStore:
    return TensorStore(num_blocks, block_size, device=cfg.store_device, **kwargs)


def rows(
    cfg: DeviceConfig,
    n: int,
    *row_shape: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> torch.Tensor:
    """Distinct values per row: row i holds seed * 1000 + i * 10 + column."""
    shape = row_shape or (3,)
    width = int(np.prod(shape))
    base = torch.arange(n * width, dtype=torch.float64).view(n, width) % width
    base += torch.arange(n, dtype=torch.float64)[:, None] * 10 + seed * 1000
    return base.to(dtype).view(n, *shape).to(cfg.source_device)


def _bits(t: torch.Tensor) -> bytes:
    """The bytes of ``t``: equal exactly when the bits are (NaN payloads, -0.0 included)."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


class Snapshot(NamedTuple):
    """Everything a call that must change nothing could change, comparable with ``==``."""

    # Every row of each entry, stamped or not, as bytes.
    rows: dict[str, bytes]
    stamps: dict[str, list[BlockHash | None]]
    filled: dict[str, list[int]]
    entries: dict[str, EntrySpec]
    stats: StoreStats
    # Request -> entry -> (first token position, bytes of the rows) chunks.
    staged: dict[str, dict[str, list[tuple[int, bytes]]]]


def snapshot(store: TensorStore) -> Snapshot:
    """The store's state, through its public inspection methods."""
    store.synchronize()
    names = list(store.entries)
    blocks = range(store.num_blocks)
    return Snapshot(
        rows={name: _bits(store.cached_rows(name)) for name in names},
        stamps={name: [store.stamp_of(name, b) for b in blocks] for name in names},
        filled={name: [store.filled_of(name, b) for b in blocks] for name in names},
        entries=store.entries,
        stats=store.stats,
        staged={
            req_id: {
                name: [(start, _bits(chunk)) for start, chunk in chunks]
                for name, chunks in per_entry.items()
            }
            for req_id, per_entry in store.staged_rows().items()
        },
    )


def assert_same(a: Snapshot, b: Snapshot) -> None:
    """Two states are equal, field by field (so that a failure names the field)."""
    assert a.rows.keys() == b.rows.keys()
    for name in a.rows:
        assert a.rows[name] == b.rows[name], name
    assert a.stamps == b.stamps
    assert a.filled == b.filled
    assert a.entries == b.entries
    assert a.stats == b.stats
    assert a.staged == b.staged
