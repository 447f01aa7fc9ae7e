"""Moving rows into and out of an entry's cache, and waiting for asynchronous copies.

Rows move as bits (see `entries._WIDE_DTYPES`), in as few ops as the slots
allow: each parallel op may wake the thread pool, which on a loaded host
costs more than a small copy. Copies from CUDA into a pinned CPU cache are
asynchronous; each entry keeps the events of its copies in flight, and every
read or write of its cache waits for them first (`sync`).
"""

from __future__ import annotations

import numpy as np
import torch

from omnicache.store.entries import Entry, Layout
from omnicache.store.slots import IntArray, Segments, SmallSegments, is_one_run, runs


def sync(entry: Entry) -> None:
    """Waits for the asynchronous copies into ``entry``'s cache."""
    if entry.pending:
        for event in entry.pending:
            event.synchronize()
        entry.pending.clear()


def widen_pair(
    entry: Entry, dst: torch.Tensor, src: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views two ``(rows, dim)`` tensors as rows of the entry's wide type, if both allow."""
    if entry.wide_dtype != entry.spec.dtype:
        try:
            return dst.view(entry.wide_dtype), src.view(entry.wide_dtype)
        except RuntimeError:
            pass
    return dst, src


def copy_rows(layout: Layout, entry: Entry, rows: torch.Tensor, segs: Segments) -> None:
    """Copies ``rows[i]`` into slot ``segs.slots[i]`` of the entry's cache."""
    slots = segs.slots
    n = len(slots)
    src = rows.detach()[:n].reshape(n, entry.dim)
    # NOTE: an earlier asynchronous copy into these slots must land first.
    sync(entry)
    if src.is_cuda and layout.on_cpu:
        # Each run of consecutive slots is one copy from the device into
        # the (pinned) cache; readers wait for the event.
        for start, stop in runs(slots):
            first = int(slots[start])
            entry.flat[first : first + stop - start].copy_(
                src[start:stop], non_blocking=layout.pin_memory
            )
        if layout.pin_memory:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            entry.pending.append(event)
        return
    if src.device != layout.device:
        src = src.to(layout.device)
    if layout.on_cpu and is_one_run(segs):
        for start, stop in runs(slots):
            first = int(slots[start])
            entry.flat[first : first + stop - start].copy_(src[start:stop])
        return
    dst_w, src_w = widen_pair(entry, entry.flat, src)
    if segs.whole_blocks:
        # One index per block moves block_size rows at once.
        index = torch.from_numpy(segs.blocks).to(layout.device)
        row_w = layout.block_size * dst_w.shape[1]
        # NOTE: reshape, not view: strided rows (a column slice of a fused
        # projection) cannot always be viewed as whole blocks, and failing
        # here would leave the entries written before this one changed.
        dst_w.view(layout.num_blocks, row_w).index_put_(
            (index,), src_w.reshape(len(segs.blocks), row_w)
        )
        return
    index_t = segs.slots_tensor
    if index_t is None or index_t.device != layout.device:
        index_t = torch.from_numpy(slots).to(layout.device)
    dst_w.index_put_((index_t.to(torch.int64),), src_w)


def copy_small_rows(layout: Layout, entry: Entry, rows: torch.Tensor, segs: SmallSegments) -> None:
    """`copy_rows` of a small write: one copy op, on the CPU or the cache's device.

    CUDA rows for a CPU cache take `copy_rows`, run by run.
    """
    n = len(segs.slots)
    src = rows.detach() if rows.requires_grad else rows
    if src.shape[0] != n:
        src = src[:n]
    if src.ndim != 2:
        src = src.reshape(n, entry.dim)
    # NOTE: an earlier asynchronous copy into these slots must land first.
    if entry.pending:
        sync(entry)
    if not layout.on_cpu and src.device != layout.device:
        src = src.to(layout.device)
    if segs.one_run:
        first = segs.slots[0]
        entry.flat[first : first + n].copy_(src)
        return
    # One op for every row: each parallel op may wake the thread pool.
    source = segs.source
    if isinstance(source, torch.Tensor):
        index = (source if source.shape[0] == n else source[:n]).to(layout.device, torch.int64)
    elif source is not None:
        index = torch.from_numpy(source[:n].astype(np.int64)).to(layout.device)
    else:
        # NOTE: through numpy: torch.tensor of a list of ints costs several
        # times as much, for 4 slots as for 512 (benchmarks/bench_store.py).
        index = torch.from_numpy(np.array(segs.slots, dtype=np.int64))
        if not layout.on_cpu:
            index = index.to(layout.device)
    dst_w, src_w = widen_pair(entry, entry.flat, src)
    dst_w.index_put_((index,), src_w)


def gather_blocks(layout: Layout, entry: Entry, ids: IntArray, flat_out: torch.Tensor) -> None:
    """Copies whole blocks ``ids`` into ``flat_out`` (``len(ids) * block_size`` rows)."""
    index = torch.from_numpy(ids)
    if not layout.on_cpu:
        index = index.to(layout.device)
    dst_w, src_w = widen_pair(entry, flat_out, entry.flat)
    row_w = layout.block_size * dst_w.shape[1]
    torch.index_select(
        src_w.view(layout.num_blocks, row_w), 0, index, out=dst_w.view(len(ids), row_w)
    )
