"""Applying a checked write: rows into the cache, then fill counts, stamps, counters, tier.

A write is applied only after every check passed (the callers check); from
here on nothing can fail, so a call that writes several entries never leaves
some of them written and others not.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from omnicache.block_hash import BlockHash
from omnicache.store.block_tier import BlockTier, TierBridge
from omnicache.store.copies import copy_rows, copy_small_rows
from omnicache.store.entries import Entry, Layout
from omnicache.store.fill import fill_after, stamp_rule
from omnicache.store.slots import Segments, SmallSegments, as_segments
from omnicache.store.specs import StoreStats, WriteResult


class Writer:
    """Applies checked writes to entries, counting in ``stats`` and offering to the tier."""

    def __init__(self, layout: Layout, stats: StoreStats, bridge: TierBridge) -> None:
        self._layout = layout
        self._stats = stats
        self._bridge = bridge

    def apply(
        self,
        entry: Entry,
        rows: torch.Tensor,
        segs: Segments | SmallSegments,
        block_keys: Mapping[int, BlockHash],
        tier: BlockTier | None,
    ) -> WriteResult:
        """Writes ``rows[i]`` into slot ``segs.slots[i]`` of ``entry``: checked input only.

        Args:
            entry: The entry written.
            rows: At least ``len(segs.slots)`` rows of the entry's spec.
            segs: The slots, cut into runs.
            block_keys: Checked keys of blocks this write may complete.
            tier: The tier stamped blocks are offered to (None: none).
        """
        if isinstance(segs, SmallSegments):
            if not (rows.is_cuda and self._layout.on_cpu):
                return self.apply_small(entry, rows, segs, block_keys, tier)
            # Rows from the device into a CPU cache move run by run (see copy_rows).
            segs = as_segments(segs, self._layout.block_size)
        n = len(segs.slots)
        self._stats.num_writes += 1
        if n == 0:
            return WriteResult(entry.spec.name, 0, (), ())
        copy_rows(self._layout, entry, rows, segs)
        filled = entry.filled
        if segs.repeated_blocks:
            # Runs of one block must see each other's fill counts: in order.
            for block, offset, length in zip(
                segs.blocks.tolist(), segs.offsets.tolist(), segs.lens.tolist(), strict=True
            ):
                filled[block] = fill_after(filled.item(block), offset, length)
            touched = np.unique(segs.blocks)
        else:
            filled[segs.blocks] = fill_after(filled[segs.blocks], segs.offsets, segs.lens)
            touched = segs.blocks
        keys = np.empty(len(touched), dtype=object)
        keys[:] = list(map(block_keys.get, touched.tolist()))
        stamp, incomplete = stamp_rule(keys, filled[touched], self._layout.block_size)
        keys[~stamp] = None
        entry.stamps[touched] = keys
        return self._done(entry, n, touched[stamp].tolist(), touched[incomplete].tolist(), tier)

    def apply_small(
        self,
        entry: Entry,
        rows: torch.Tensor,
        segs: SmallSegments,
        block_keys: Mapping[int, BlockHash],
        tier: BlockTier | None,
    ) -> WriteResult:
        """`apply` of a small write: the same effects, over Python ints.

        Rows on the CPU, or on the cache's device; CUDA rows for a CPU cache
        take `apply`.
        """
        self._stats.num_writes += 1
        copy_small_rows(self._layout, entry, rows, segs)
        filled = entry.filled
        stamps = entry.stamps
        key_of = block_keys.get
        bs = self._layout.block_size
        stamped: list[int] = []
        incomplete: list[int] = []
        for block, offset, length in segs.runs:
            fill = fill_after(filled.item(block), offset, length)
            filled[block] = fill
            key = key_of(block)
            if key is None:
                # `stamp_rule` of a block without a key: neither stamped nor
                # incomplete. Most blocks of a decode step have none, and the
                # call would cost more than the rest of this loop.
                stamps[block] = None
                continue
            stamp, unfinished = stamp_rule(key, fill, bs)
            stamps[block] = key if stamp else None
            if stamp:
                stamped.append(block)
            elif unfinished:
                incomplete.append(block)
        if segs.repeated_blocks:
            # A block's last run decided its stamp, with its final fill count.
            # Report each keyed block once, ascending, as `apply` does: a keyed
            # block is either stamped or incomplete.
            keyed = sorted({block for block in segs.blocks if key_of(block) is not None})
            stamped = [block for block in keyed if stamps[block] is not None]
            incomplete = [block for block in keyed if stamps[block] is None]
        return self._done(entry, len(segs.slots), stamped, incomplete, tier)

    def _done(
        self,
        entry: Entry,
        num_rows: int,
        stamped: list[int],
        incomplete: list[int],
        tier: BlockTier | None,
    ) -> WriteResult:
        stats = self._stats
        stats.num_rows_written += num_rows
        if stamped:
            stats.num_stamped_blocks += len(stamped)
            if tier is not None:
                self._bridge.offer(tier, entry, stamped)
        if incomplete:
            stats.num_incomplete_blocks += len(incomplete)
        return WriteResult(entry.spec.name, num_rows, tuple(stamped), tuple(incomplete))
