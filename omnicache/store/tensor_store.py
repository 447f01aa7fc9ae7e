"""`TensorStore`: the store's one public class, which owns entries and counters and delegates."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_optional_int
from omnicache.store import outputs as step_outputs
from omnicache.store import slots as slot_cuts
from omnicache.store.block_tier import BlockTier, TierBridge, check_tier
from omnicache.store.blocks import (
    block_id_array,
    check_block_id,
    check_block_keys,
    request_spans,
    small_block_ids,
)
from omnicache.store.copies import sync
from omnicache.store.deferred_rows import Chunk, DeferredMethods, DeferredRows
from omnicache.store.entries import (
    Entry,
    check_capacity,
    check_rows,
    clear_blocks,
    entry_named,
    make_layout,
    make_spec,
    new_entry,
)
from omnicache.store.reads import Reader, ReadMethods
from omnicache.store.specs import (
    HIDDEN_STATES,
    EntrySpec,
    ScheduledRequest,
    StoreStats,
    WriteResult,
    describe,
)
from omnicache.store.writes import Writer


class _EvictionSource(Protocol):
    num_blocks: int
    block_size: int

    def add_eviction_listener(self, callback: Any) -> None: ...

    def remove_eviction_listener(self, callback: Any) -> None: ...


class TensorStore(DeferredMethods, ReadMethods):
    """Per-block tensors for named entries, stamped with the key they hold.

    Writes and inspection are defined here; the methods for deferred entries
    (`stage` .. `discard`) and reads (`probe` .. `read_merged`) in
    `deferred_rows.DeferredMethods` and `reads.ReadMethods`.

    Args:
        num_blocks: Number of blocks, as in the block pool.
        block_size: Tokens per block, as in the block pool.
        device: ``"cpu"`` or a CUDA device for the cache tensors.
        pin_memory: Pin CPU cache tensors so that copies from CUDA run
            asynchronously; None pins when CUDA is available.
        hidden_size: Declares `HIDDEN_STATES` up front with this many values
            per token (otherwise it is created by its first write).
        hidden_dtype: Its dtype; required with ``hidden_size``.
        max_bytes: Cap on the bytes of all cache tensors together (None: no
            cap); `register` raises `StoreCapacityError` beyond it.
        tier: A second tier: stamped blocks are offered to it, and
            `read_through` fills blocks from it (None: no tier).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
        hidden_size: int | None = None,
        hidden_dtype: torch.dtype | None = None,
        max_bytes: int | None = None,
        tier: BlockTier | None = None,
    ) -> None:
        layout = make_layout(num_blocks, block_size, device, pin_memory)
        check_optional_int("max_bytes", max_bytes, minimum=0)
        if (hidden_size is None) != (hidden_dtype is None):
            raise ValueError(
                "hidden_size and hidden_dtype: expected both or neither, found "
                f"hidden_size={hidden_size}, hidden_dtype={hidden_dtype}"
            )
        check_tier(tier)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = layout.num_slots
        self.device = layout.device
        self.pin_memory = layout.pin_memory
        self.max_bytes = max_bytes
        self.tier = tier
        self._layout = layout
        self._entries: dict[str, Entry] = {}
        self._stats = StoreStats()
        bridge = TierBridge(layout, self._stats)
        self._bridge = bridge
        self._writer = Writer(layout, self._stats, bridge)
        self._reader = Reader(layout, self._stats)
        self._deferred = DeferredRows(layout, self._stats)
        # Names of outputs whose unplaced rows were logged (once per name).
        self._logged_unplaced: set[str] = set()
        if hidden_size is not None and hidden_dtype is not None:
            self.register(HIDDEN_STATES, hidden_size, hidden_dtype)

    # -- entries ------------------------------------------------------------

    def register(
        self,
        name: str,
        dim: int | Sequence[int],
        dtype: torch.dtype,
        *,
        deferred: bool = False,
    ) -> EntrySpec:
        """Declares an entry of ``dim`` values of ``dtype`` per token.

        Registering the same spec again returns it unchanged.

        Args:
            name: Entry name.
            dim: Values per token, or the per-token shape.
            dtype: Element type.
            deferred: Rows are staged per request and written by `commit`.

        Returns:
            The entry's spec.

        Raises:
            ValueError: A bad argument, or ``name`` registered differently.
            StoreCapacityError: The entry does not fit under ``max_bytes``.
        """
        spec = make_spec(self._layout, name, dim, dtype, deferred)
        existing = self._entries.get(name)
        if existing is not None:
            if existing.spec != spec:
                raise ValueError(
                    f"entry {name!r}: already registered as {describe(existing.spec)}, "
                    f"found {describe(spec)}"
                )
            return spec
        check_capacity(self._entries, [spec], self.max_bytes)
        self._entries[name] = new_entry(self._layout, spec)
        return spec

    @property
    def entries(self) -> dict[str, EntrySpec]:
        """Registered entries by name, in registration order."""
        return {name: entry.spec for name, entry in self._entries.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of all cache tensors (what ``max_bytes`` caps)."""
        return sum(entry.spec.nbytes for entry in self._entries.values())

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    # -- inspection (read-only: what tests and debugging look at) -----------

    def stamp_of(self, name: str, block_id: int) -> BlockHash | None:
        """Returns the key block ``block_id`` holds for entry ``name``, or None."""
        entry = entry_named(self._entries, name)
        check_block_id("block_id", block_id, self.num_blocks)
        stamp: BlockHash | None = entry.stamps[block_id]
        return stamp

    def filled_of(self, name: str, block_id: int) -> int:
        """Rows of block ``block_id`` of entry ``name`` written in order from offset 0.

        -1 when they did not arrive in order (the block cannot be stamped
        before its next offset-0 write); see `omnicache.store.fill`.
        """
        entry = entry_named(self._entries, name)
        check_block_id("block_id", block_id, self.num_blocks)
        return int(entry.filled[block_id])

    def cached_rows(self, name: str) -> torch.Tensor:
        """A copy of every row of entry ``name``, stamped or not, on the CPU.

        Returns:
            ``(num_slots, *row_shape)`` rows in slot order. Reads check stamps;
            this does not (it shows what a read would never return).
        """
        entry = entry_named(self._entries, name)
        sync(entry)
        return entry.flat.to("cpu", copy=True).view(self.num_slots, *entry.spec.row_shape)

    def staged_rows(self) -> dict[str, dict[str, list[Chunk]]]:
        """Staged rows by request and entry name: (first token position, rows) chunks.

        Chunks are in staging order; the rows are the store's copies, to be
        read, not written.
        """
        return self._deferred.staged_rows()

    # -- block pool ----------------------------------------------------------

    def attach(self, pool: _EvictionSource) -> None:
        """Subscribes `on_block_evicted` to ``pool``'s evictions.

        Raises:
            ValueError: The pool's geometry differs from the store's.
        """
        if pool.num_blocks != self.num_blocks or pool.block_size != self.block_size:
            raise ValueError(
                f"pool: expected {self.num_blocks} blocks of {self.block_size} tokens, found "
                f"{pool.num_blocks} blocks of {pool.block_size} tokens"
            )
        pool.add_eviction_listener(self.on_block_evicted)

    def detach(self, pool: _EvictionSource) -> None:
        """Stops listening to ``pool``'s evictions."""
        pool.remove_eviction_listener(self.on_block_evicted)

    def on_block_evicted(self, block_id: int, key: BlockHash) -> None:
        """Eviction listener: block ``block_id`` lost ``key`` and gets a new owner.

        Its stamps and fill counts are cleared for every entry, whatever key
        they held: the next owner's rows start a new run. Rows staged for it
        before are refused by `commit` (the block changed hands).
        """
        check_block_id("block_id", block_id, self.num_blocks)
        for entry in self._entries.values():
            if entry.stamps[block_id] is not None:
                self._stats.num_evicted_stamps += 1
        clear_blocks(self._entries.values(), block_id)
        self._deferred.handed_out(block_id)

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Clears stamps and fill counts of ``block_ids`` for every entry.

        The blocks count as handed out again: rows staged for them before
        are refused by `commit`.
        """
        given = list(block_ids)
        ids: slot_cuts.IntArray | list[int] | None = small_block_ids(given, self.num_blocks)
        if ids is None:
            ids = block_id_array("block_ids", given, self.num_blocks, distinct=False)
        clear_blocks(self._entries.values(), ids)
        self._deferred.handed_out(ids)

    def invalidate_all(self) -> None:
        """Clears every stamp and fill count.

        Staged rows stay, but every block counts as handed out again: once
        the keys are gone, a block's next owner comes without an eviction
        call, so `commit` refuses every row staged before (`discard` drops
        them).
        """
        clear_blocks(self._entries.values(), slice(None))
        self._deferred.handed_out_all()

    # -- writes -------------------------------------------------------------

    def write(
        self,
        name: str,
        rows: torch.Tensor,
        slot_mapping: object,
        *,
        block_keys: Mapping[int, BlockHash] | None = None,
        num_tokens: int | None = None,
    ) -> WriteResult:
        """Writes ``rows[i]`` into slot ``slot_mapping[i]`` of entry ``name``.

        Args:
            name: A registered entry.
            rows: ``(n, *row_shape)`` rows of the entry's dtype, n >= num_tokens.
            slot_mapping: ``block_id * block_size + offset`` per row: an
                integer tensor (a CPU one avoids a device sync), ndarray or
                sequence.
            block_keys: Keys of blocks this write may complete (block id ->
                key); a touched block whose rows become complete is stamped
                with its key. Keys of untouched blocks have no effect.
            num_tokens: Rows to write (default: all of ``slot_mapping``);
                later slots and rows are padding.

        Returns:
            The stamped blocks and the keyed blocks left incomplete.

        Raises:
            ValueError, IndexError, TypeError: Bad input; nothing is written.
        """
        entry = entry_named(self._entries, name)
        segs = slot_cuts.cut(slot_mapping, num_tokens, self.num_slots, self.block_size)
        check_rows(entry.spec, rows, len(segs.slots))
        keys = check_block_keys(block_keys, self.num_blocks)
        return self._writer.apply(entry, rows, segs, keys, self.tier)

    def write_blocks(
        self,
        name: str,
        rows: torch.Tensor,
        block_ids: Sequence[int],
        *,
        block_keys: Sequence[BlockHash] | None = None,
    ) -> WriteResult:
        """Writes whole blocks: ``rows[i * block_size + j]`` to offset j of ``block_ids[i]``.

        Args:
            name: A registered entry.
            rows: ``(len(block_ids) * block_size, *row_shape)`` rows.
            block_ids: Distinct blocks.
            block_keys: The key of each block, aligned with ``block_ids``
                (None: the blocks stay unstamped).

        Returns:
            As `write`.
        """
        ids = block_id_array("block_ids", block_ids, self.num_blocks)
        if block_keys is not None and len(block_keys) != len(ids):
            raise ValueError(
                f"block_keys: expected {len(ids)} keys (one per block), found {len(block_keys)}"
            )
        slots = (ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        keys = None if block_keys is None else dict(zip(ids.tolist(), block_keys, strict=True))
        return self.write(name, rows, slots, block_keys=keys)

    def write_outputs(
        self,
        slot_mapping: object,
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        block_keys: Mapping[int, BlockHash] | None = None,
        num_tokens: int | None = None,
        num_tokens_padded: int | None = None,
    ) -> dict[str, WriteResult]:
        """Writes one step's hidden states and per-token multimodal outputs.

        A multimodal output is per-token, and cached, when it is a registered
        entry or a tensor with 2 or more dims whose first dim is
        ``num_tokens_padded``; such a tensor of an unknown name creates its
        entry. Everything else (1-D per-request metadata, lists, ...) is not
        cached; of those, a tensor of 2 or more dims with at least
        ``num_tokens`` but fewer than ``num_tokens_padded`` rows looks
        per-token but cannot be told from per-request rows (a decode step has
        one token per request), so it is counted in ``num_unplaced_outputs``
        and logged once per name (register it to cache it). Deferred entries
        are skipped here (see `stage_outputs`, and `write_step`, which does
        both at once).

        Args:
            slot_mapping: Slot per scheduled token (see `write`).
            hidden_states: ``(>= num_tokens, hidden)`` rows.
            multimodal_outputs: The model's multimodal outputs by name.
            block_keys: As in `write`, for every entry.
            num_tokens: Tokens to write (default: all of ``slot_mapping``).
            num_tokens_padded: Rows the model produced, padding included
                (default: ``num_tokens``).

        Returns:
            The result of each entry written, by name.

        Raises:
            ValueError, IndexError, TypeError, StoreCapacityError: Bad input or
                no room for a new entry; nothing is created or written.
        """
        segs = slot_cuts.cut(slot_mapping, num_tokens, self.num_slots, self.block_size)
        _, direct = self._checked_outputs(
            len(segs.slots), hidden_states, multimodal_outputs, block_keys, num_tokens_padded
        )
        # Every check passed: create the new entries, then write.
        return self._write_direct(direct, segs)

    def write_step(
        self,
        requests: Sequence[ScheduledRequest],
        slot_mapping: object,
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        block_keys: Mapping[int, BlockHash] | None = None,
        num_tokens_padded: int | None = None,
    ) -> dict[str, WriteResult]:
        """Writes one step's direct entries and stages its deferred ones, all or nothing.

        Direct entries are written as by `write_outputs` (every slot of
        ``slot_mapping``), deferred entries staged per request as by
        `stage_outputs`. Every check (requests, slots, keys, every output's
        rows, room for new entries) runs before anything is created, written
        or staged. With deferred entries registered, the slots also tell the
        store whose table each block is in and which block each staged row
        is for, which `commit` checks.

        Args:
            requests: The step's requests in batch order; their
                ``num_new_tokens`` sum to ``len(slot_mapping)``.
            slot_mapping: Slot per row of the step, request by request (see
                `write`); the outputs' later rows are padding.
            hidden_states: ``(>= len(slot_mapping), hidden)`` rows.
            multimodal_outputs: The model's multimodal outputs by name.
            block_keys: As in `write`, for every direct entry.
            num_tokens_padded: Rows the model produced, padding included
                (default: ``len(slot_mapping)``).

        Returns:
            The result of each direct entry written, by name.

        Raises:
            ValueError, IndexError, TypeError, StoreCapacityError: Bad input or
                no room for a new entry; nothing is created, written or staged.
        """
        spans = request_spans(requests)
        segs = slot_cuts.cut(slot_mapping, None, self.num_slots, self.block_size)
        num_rows = len(segs.slots)
        num_scheduled = spans[-1][1] if spans else 0
        if num_scheduled != num_rows:
            raise ValueError(
                f"requests: expected num_new_tokens summing to {num_rows} (one per slot), "
                f"found {num_scheduled}"
            )
        outputs, direct = self._checked_outputs(
            num_rows, hidden_states, multimodal_outputs, block_keys, num_tokens_padded
        )
        deferred = step_outputs.deferred_outputs(self._entries, outputs, num_rows)
        # Every check passed: nothing below can fail.
        results = self._write_direct(direct, segs)
        # NOTE: whose blocks these are matters only to deferred rows; a store
        # without deferred entries spares every step the bookkeeping.
        tracked = any(entry.spec.deferred for entry in self._entries.values())
        self._deferred.stage_step(deferred, requests, spans, segs.slots if tracked else None)
        return results

    def synchronize(self) -> None:
        """Waits for every asynchronous copy into the cache tensors."""
        for entry in self._entries.values():
            sync(entry)

    # -- internals ----------------------------------------------------------

    def _checked_outputs(
        self,
        num_rows: int,
        hidden_states: torch.Tensor | None,
        multimodal_outputs: Mapping[str, object] | None,
        block_keys: Mapping[int, BlockHash] | None,
        num_tokens_padded: int | None,
    ) -> tuple[dict[str, object], step_outputs.DirectWrites]:
        """A step's outputs in one mapping, and its direct writes of ``num_rows`` rows, checked."""
        padded = step_outputs.padded_rows(num_tokens_padded, num_rows)
        outputs = step_outputs.merge_outputs(hidden_states, multimodal_outputs)
        new_specs, todo, unplaced = step_outputs.direct_outputs(
            self._layout, self._entries, outputs, num_rows, padded
        )
        keys = check_block_keys(block_keys, self.num_blocks)
        check_capacity(self._entries, new_specs, self.max_bytes)
        return outputs, step_outputs.DirectWrites(new_specs, todo, keys, unplaced, num_rows, padded)

    def _write_direct(
        self, direct: step_outputs.DirectWrites, segs: slot_cuts.Segments | slot_cuts.SmallSegments
    ) -> dict[str, WriteResult]:
        """Creates the new entries, writes each entry's rows, and reports unplaced outputs."""
        step_outputs.report_unplaced(direct, self._stats, self._logged_unplaced)
        for spec in direct.new_specs:
            self._entries[spec.name] = new_entry(self._layout, spec)
        return {
            spec.name: self._writer.apply(
                self._entries[spec.name], rows, segs, direct.block_keys, self.tier
            )
            for spec, rows in direct.todo
        }
