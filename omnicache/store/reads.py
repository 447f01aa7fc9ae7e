"""Reads: whole stamped blocks, and a step's merged rows (hit blocks, then the step's rows).

A read names the key each block must hold; a block stamped otherwise is a
counted miss or a `StaleBlockError`, never wrong data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int
from omnicache.store import outputs as step_outputs
from omnicache.store.block_tier import BlockTier, TierBridge
from omnicache.store.blocks import hit_block_list, hit_blocks, request_spans
from omnicache.store.copies import gather_blocks, sync, widen_pair
from omnicache.store.deferred_rows import DeferredRows
from omnicache.store.entries import (
    Entry,
    Layout,
    check_out,
    check_rows,
    empty_rows,
    entries_named,
    entry_named,
)
from omnicache.store.slots import IntArray
from omnicache.store.specs import (
    MergedRead,
    ReadMiss,
    ScheduledRequest,
    StaleBlockError,
    StoreStats,
)


def num_valid(
    entries: Sequence[Entry], ids: IntArray, keys: Sequence[BlockHash]
) -> tuple[int, tuple[Entry, int] | None]:
    """Leading blocks holding their keys for every entry, and the first failure."""
    best = len(ids)
    failure: tuple[Entry, int] | None = None
    if not best:
        return best, failure
    expected = np.empty(best, dtype=object)
    expected[:] = list(keys)
    for entry in entries:
        bad = np.flatnonzero(entry.stamps[ids[:best]] != expected[:best])
        if bad.size:
            best = int(bad[0])
            failure = (entry, int(ids[best]))
    return best, failure


def num_valid_list(
    entries: Sequence[Entry], ids: list[int], keys: Sequence[BlockHash]
) -> tuple[int, tuple[Entry, int] | None]:
    """`num_valid` over a list: a request's few blocks cost less than numpy calls."""
    best = len(ids)
    failure: tuple[Entry, int] | None = None
    for entry in entries:
        stamps = entry.stamps
        for index in range(best):
            block_id = ids[index]
            if stamps[block_id] != keys[index]:
                best = index
                failure = (entry, block_id)
                break
    return best, failure


class _MergeLayout(NamedTuple):
    """Index tensors of a merged read, on the store's device (see `Reader._merge_layout`)."""

    # Slot each output row is gathered from (None: no cached rows).
    gather: torch.Tensor | None
    # Output row of each new row read (None: none).
    new_dst: torch.Tensor | None
    # Row of the step's outputs for each of them (None: the first num_new).
    new_src: torch.Tensor | None
    num_new: int
    # Rows of each request read, in batch order.
    num_rows: list[int]


class Reader:
    """Reads entries' rows in ``layout``, counting in ``stats``."""

    def __init__(self, layout: Layout, stats: StoreStats) -> None:
        self._layout = layout
        self._stats = stats

    def read_blocks(
        self,
        entry: Entry,
        ids: IntArray,
        block_keys: Sequence[BlockHash],
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """`TensorStore.read_blocks` of checked blocks and keys."""
        num_rows = len(ids) * self._layout.block_size
        if out is not None:
            check_out(entry.spec, out, num_rows, self._layout.device, "out")
        valid, missed = num_valid([entry], ids, block_keys)
        if missed is not None:
            block_id = missed[1]
            self._stats.num_stale_reads += 1
            raise StaleBlockError(
                entry.spec.name, block_id, valid, block_keys[valid], entry.stamps[block_id]
            )
        buf = out if out is not None else empty_rows(self._layout, entry, num_rows)
        flat_out = buf.view(-1, entry.dim)[:num_rows]
        sync(entry)
        gather_blocks(self._layout, entry, ids, flat_out)
        self._stats.num_hit_blocks_read += len(ids)
        return flat_out.view(num_rows, *entry.spec.row_shape)

    def read_merged(
        self,
        entries: Mapping[str, Entry],
        requests: Sequence[ScheduledRequest],
        outputs: Mapping[str, object],
        out: Mapping[str, torch.Tensor] | None,
        strict: bool,
    ) -> MergedRead:
        """`TensorStore.read_merged` of a step's outputs in one mapping."""
        layout = self._layout
        bs = layout.block_size
        spans = request_spans(requests)
        total_new = spans[-1][1] if spans else 0
        hit_ids: list[list[int]] = []
        for index, request in enumerate(requests):
            ids = hit_block_list(request.hit_block_ids, request.hit_block_keys, layout.num_blocks)
            # NOTE: the step's rows follow the hit's rows: a request whose new
            # rows start elsewhere would get rows at the wrong positions.
            if ids and request.num_computed_tokens != len(ids) * bs:
                raise ValueError(
                    f"requests[{index}].num_computed_tokens: expected {len(ids) * bs} "
                    f"(request {request.req_id!r}: {len(ids)} hit blocks of {bs} tokens, "
                    f"its new rows right after them), found {request.num_computed_tokens}"
                )
            hit_ids.append(ids)
        read: list[tuple[Entry, torch.Tensor]] = []
        passthrough: dict[str, object] = {}
        for name, value in outputs.items():
            entry = entries.get(name)
            if entry is None:
                passthrough[name] = value
                continue
            rows = step_outputs.entry_output(name, value)
            check_rows(entry.spec, rows, total_new)
            read.append((entry, rows))
        live = [entry for entry, _ in read]
        misses: list[ReadMiss] = []
        # Output row offset of each request that is read, None for a miss.
        offsets: list[int | None] = []
        total_rows = 0
        for request, ids in zip(requests, hit_ids, strict=True):
            valid, missed = num_valid_list(live, ids, request.hit_block_keys)
            if missed is not None:
                entry, block_id = missed
                if strict:
                    self._stats.num_stale_reads += 1
                    raise StaleBlockError(
                        entry.spec.name,
                        block_id,
                        valid,
                        request.hit_block_keys[valid],
                        entry.stamps[block_id],
                        request.req_id,
                    )
                misses.append(ReadMiss(request.req_id, len(ids), valid, entry.spec.name))
                offsets.append(None)
                continue
            offsets.append(total_rows)
            total_rows += len(ids) * layout.block_size + request.num_new_tokens
        if out is not None:
            for entry, _ in read:
                name = entry.spec.name
                if name not in out:
                    raise ValueError(f"out: expected a buffer for entry {name!r}, found none")
                check_out(entry.spec, out[name], total_rows, layout.device, f"out[{name!r}]")
        # Every check passed.
        self._stats.num_read_requests += len(requests)
        self._stats.num_stale_reads += len(misses)
        self._stats.num_hit_blocks_read += sum(
            len(ids) for ids, offset in zip(hit_ids, offsets, strict=True) if offset is not None
        )
        merge = self._merge_layout(hit_ids, spans, offsets, total_new, total_rows)
        read_ids = [
            r.req_id for r, offset in zip(requests, offsets, strict=True) if offset is not None
        ]
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for entry, value in read:
            sync(entry)
            name = entry.spec.name
            buf = out[name] if out is not None else empty_rows(layout, entry, total_rows)
            flat_out = buf.view(-1, entry.dim)[:total_rows]
            self._merge_into(entry, flat_out, value, merge, spans, offsets, hit_ids)
            # NOTE: one split makes every request's view; the requests read
            # lie back to back in the buffer, in batch order.
            shaped = flat_out.view(total_rows, *entry.spec.row_shape)
            views = shaped.split_with_sizes(merge.num_rows) if read_ids else ()
            tensors[name] = dict(zip(read_ids, views, strict=True))
        if layout.pin_memory and any(v.is_cuda for _, v in read):
            # NOTE: new rows were copied from CUDA asynchronously; the caller
            # reads the buffers on the CPU right away.
            torch.cuda.current_stream().synchronize()
        return MergedRead(tensors, passthrough, tuple(misses))

    def _merge_layout(
        self,
        hit_ids: Sequence[list[int]],
        spans: Sequence[tuple[int, int]],
        offsets: Sequence[int | None],
        total_new: int,
        total_rows: int,
    ) -> _MergeLayout:
        """Where a merged read's rows come from, shared by its entries.

        NOTE: the cached rows of every request are one gather, and the new
        rows one indexed copy, not one op per request: each parallel op wakes
        the thread pool, which on a loaded host costs more than a small copy,
        and per-request work was most of a decode step's read. Rows that will
        take this step's rows gather slot 0 and are overwritten.
        """
        bs = self._layout.block_size
        cached_ids: list[int] = []
        # Per request read: output offset, cached rows, new rows, first new row.
        read_offsets: list[int] = []
        num_cached: list[int] = []
        num_new: list[int] = []
        new_starts: list[int] = []
        for ids, (start, stop), offset in zip(hit_ids, spans, offsets, strict=True):
            if offset is None:
                continue
            cached_ids += ids
            read_offsets.append(offset)
            num_cached.append(len(ids) * bs)
            num_new.append(stop - start)
            new_starts.append(start)
        num_rows = [c + n for c, n in zip(num_cached, num_new, strict=True)]
        gather: torch.Tensor | None = None
        if cached_ids:
            block_slots = (
                np.array(cached_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)
            ).reshape(-1)
            positions = _ranges(
                np.array(read_offsets, dtype=np.int64), np.array(num_cached, dtype=np.int64)
            )
            index = np.zeros(total_rows, dtype=np.int64)
            index[positions] = block_slots
            gather = self._to_device(torch.from_numpy(index))
        new_dst: torch.Tensor | None = None
        new_src: torch.Tensor | None = None
        num_new_read = sum(num_new)
        if num_new_read:
            counts = np.array(num_new, dtype=np.int64)
            first_new = np.array(read_offsets, dtype=np.int64) + np.array(
                num_cached, dtype=np.int64
            )
            new_dst = self._to_device(torch.from_numpy(_ranges(first_new, counts)))
            if num_new_read != total_new:
                # Requests that missed leave their rows out.
                new_src = self._to_device(
                    torch.from_numpy(_ranges(np.array(new_starts, dtype=np.int64), counts))
                )
        return _MergeLayout(gather, new_dst, new_src, num_new_read, num_rows)

    def _merge_into(
        self,
        entry: Entry,
        flat_out: torch.Tensor,
        value: torch.Tensor,
        merge: _MergeLayout,
        spans: Sequence[tuple[int, int]],
        offsets: Sequence[int | None],
        hit_ids: Sequence[list[int]],
    ) -> None:
        if merge.gather is not None:
            dst_w, src_w = widen_pair(entry, flat_out, entry.flat)
            torch.index_select(src_w, 0, merge.gather, out=dst_w)
        if merge.new_dst is None:
            return
        new_rows = value.detach().reshape(value.shape[0], entry.dim)
        dst_w, src_w = widen_pair(entry, flat_out, new_rows)
        if new_rows.device == flat_out.device:
            src = (
                src_w[: merge.num_new]
                if merge.new_src is None
                else src_w.index_select(0, merge.new_src)
            )
            dst_w.index_copy_(0, merge.new_dst, src)
            return
        # NOTE: across devices each request's rows are one (asynchronous) DMA copy.
        bs = self._layout.block_size
        for ids, (start, stop), offset in zip(hit_ids, spans, offsets, strict=True):
            if offset is not None and stop > start:
                first = offset + len(ids) * bs
                dst_w[first : first + stop - start].copy_(
                    src_w[start:stop], non_blocking=self._layout.pin_memory
                )

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        return index if self._layout.on_cpu else index.to(self._layout.device)


class ReadMethods:
    """`TensorStore`'s read methods (TensorStore sets the attributes)."""

    num_blocks: int
    tier: BlockTier | None
    _layout: Layout
    _entries: dict[str, Entry]
    _reader: Reader
    _bridge: TierBridge
    _deferred: DeferredRows

    def probe(
        self,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        names: Iterable[str] | None = None,
    ) -> int:
        """Returns how many leading blocks hold their keys for every entry.

        Args:
            block_ids: Blocks of a prefix hit, first block first.
            block_keys: The key each block is expected to hold.
            names: Entries to check (default: every registered entry).
        """
        entries = entries_named(self._entries, names)
        ids = hit_blocks(block_ids, block_keys, self.num_blocks)
        valid, _ = num_valid(entries, ids, block_keys)
        return valid

    def read_blocks(
        self,
        name: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the rows of whole blocks that must hold the given keys.

        Args:
            name: A registered entry.
            block_ids: Blocks to read, in order.
            block_keys: The key each block must hold.
            out: Optional ``(>= len(block_ids) * block_size, *row_shape)``
                buffer of the entry's dtype on the store's device.

        Returns:
            ``(len(block_ids) * block_size, *row_shape)`` rows.

        Raises:
            StaleBlockError: A block does not hold its key (counted).
        """
        entry = entry_named(self._entries, name)
        ids = hit_blocks(block_ids, block_keys, self.num_blocks)
        return self._reader.read_blocks(entry, ids, block_keys, out)

    def read_through(
        self,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        names: Iterable[str] | None = None,
    ) -> int:
        """Fills newly allocated blocks from the tier with the rows of their keys.

        Call it on a local miss, with blocks just allocated for the keys that
        follow the local hit: the tier's leading run of blocks held whole
        (every entry of ``names``) is copied in and stamped, as if computed
        here. When the tier is asked, every given block loses its previous
        stamps and fill counts for every entry, filled or not, and counts as
        handed out again (`commit` refuses rows staged for it before); without
        a tier, or with no entry to fill, nothing changes.

        Args:
            block_ids: Distinct blocks, one per key, first block first.
            block_keys: The chained keys to look up, first block first.
            names: Entries to fill (default: every registered entry); other
                entries of the filled blocks stay unstamped.

        Returns:
            How many leading blocks were filled (0 without a tier, or when the
            tier misses, is down, fails, or answers rows the store cannot
            take: of another shape, dtype, layout or device, or requiring
            grad).
        """
        entries = entries_named(self._entries, names)
        ids = hit_blocks(block_ids, block_keys, self.num_blocks, distinct=True)
        tier = self.tier
        if tier is None or not len(ids) or not entries:
            return 0
        self._deferred.handed_out(ids)
        return self._bridge.read_through(tier, entries, self._entries.values(), ids, block_keys)

    def new_read_buffers(
        self, num_rows: int, names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Allocates ``out`` buffers for `read_merged` (reuse them across steps).

        Args:
            num_rows: Rows per buffer: at least the cached plus new rows of
                every request read at once.
            names: Entries (default: every registered entry).
        """
        check_int("num_rows", num_rows, minimum=0)
        return {
            entry.spec.name: empty_rows(self._layout, entry, num_rows).view(
                num_rows, *entry.spec.row_shape
            )
            for entry in entries_named(self._entries, names)
        }

    def read_merged(
        self,
        requests: Sequence[ScheduledRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        strict: bool = False,
    ) -> MergedRead:
        """Per request, the rows of its hit blocks followed by this step's rows.

        Every output that is a registered entry is merged; other outputs are
        returned unchanged in ``passthrough``. Rows are gathered into one
        buffer per entry (``out[name]`` when given, else a new one).

        Args:
            requests: The step's requests in batch order (see
                `ScheduledRequest`); a request with hit blocks starts right
                after them (``num_computed_tokens == len(hit_block_ids) *
                block_size``), a request without gets its new rows only.
            hidden_states: This step's hidden states, requests' rows in order.
            multimodal_outputs: This step's multimodal outputs by name.
            out: Buffers by entry name, each ``(>= total rows, *row_shape)``
                of the entry's dtype on the store's device.
            strict: Raise `StaleBlockError` on a stale block instead of
                reporting the request in ``misses``.

        Returns:
            The merged rows, passthrough outputs and misses.

        Raises:
            ValueError, IndexError, TypeError: Bad input (a request with hit
                blocks whose ``num_computed_tokens`` is not their tokens is a
                ValueError); nothing is counted.
            StaleBlockError: With ``strict``, a stale block (counted).
        """
        outputs = step_outputs.merge_outputs(hidden_states, multimodal_outputs)
        return self._reader.read_merged(self._entries, requests, outputs, out, strict)


def _ranges(starts: IntArray, counts: IntArray) -> IntArray:
    """``starts[i] .. starts[i] + counts[i] - 1`` for each i, concatenated."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    ranges: IntArray = np.arange(total, dtype=np.int64) + np.repeat(
        starts - (ends - counts), counts
    )
    return ranges
