"""Rows of deferred entries, kept per request until it finishes (`commit`) or aborts (`discard`).

A deferred entry's rows are not written when computed: they are staged per
request (copied on the device they came from, since the model may reuse its
output buffers) and written into the request's blocks once, when it finishes
and its block table is still known. Staged rows never touch the cache until
then, so a request that aborts leaves no trace but the counters.

Hands. A commit can come after its blocks changed hands (a scheduler that
commits after it freed the blocks), and writing then would overwrite the new
owner's rows, or even stamp them with the old key. So every staged chunk
keeps a mark of when it was staged and, when `TensorStore.write_step` staged
it, the block of each row (the step's slots); every block keeps when it last
changed hands and which request's step last wrote into it. A block changes
hands when the store is told it was handed out again (`on_block_evicted`,
`invalidate`, `invalidate_all`, `read_through`), or when a `write_step` of
one request writes into it after one of another request did, with no hand-out
between (a block freed without a key comes with no eviction call). A commit
whose rows would land in a block that changed hands after they were staged,
or in another block than the one they were staged for, is refused
(`StaleCommitError`): nothing is written, the rows stay staged (`discard`
drops them) and the refusal is counted. A token staged again by a later
chunk takes that chunk's rows (they overwrite the earlier ones), so only the
last chunk of each token is checked: a preempted request that recomputes its
tokens into new blocks commits them. The store knows only what it is told: a
new owner that comes without an eviction call and writes through `write` or
`write_outputs` alone (no `write_step`) goes unseen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, check_str, type_name
from omnicache.store import outputs as step_outputs
from omnicache.store.block_tier import BlockTier
from omnicache.store.blocks import block_id_array, check_block_keys, request_spans
from omnicache.store.entries import Entry, Layout, check_rows, entry_named
from omnicache.store.slots import IntArray, segments
from omnicache.store.specs import (
    ScheduledRequest,
    StaleCommitError,
    StoreStats,
    WriteResult,
    merge_results,
)
from omnicache.store.writes import Writer

# (first token position, rows) of one staged chunk, as `TensorStore.staged_rows` shows it.
Chunk = tuple[int, torch.Tensor]


class _Staged(NamedTuple):
    """One staged chunk: rows of consecutive tokens of a request, and where they belong."""

    token_start: int
    rows: torch.Tensor
    # Hand-overs counted when it was staged: a block of its rows that changed
    # hands later refuses them.
    mark: int
    # The block of each row (None: staged without slots, by `stage` or
    # `stage_outputs`; then only hand-overs are checked).
    blocks: IntArray | None


class DeferredRows:
    """Staged rows by request and entry name, counted in ``stats.num_staged_bytes``."""

    def __init__(self, layout: Layout, stats: StoreStats) -> None:
        self._layout = layout
        self._stats = stats
        # req_id -> entry name -> chunks in staging order.
        self._staged: dict[str, dict[str, list[_Staged]]] = {}
        # Hand-overs so far, and each block's count when it last changed hands.
        self._mark = 0
        self._changed_at = np.zeros(layout.num_blocks, dtype=np.int64)
        # Per block, the request whose step wrote into it last since it was
        # handed out (None: none did).
        self._owner: list[str | None] = [None] * layout.num_blocks

    def handed_out(self, block_ids: IntArray | list[int] | int) -> None:
        """The store was told the (checked) blocks were handed out again."""
        self._mark += 1
        if isinstance(block_ids, list):
            # NOTE: a few ids (`blocks.small_block_ids`): no numpy call.
            for block_id in block_ids:
                self._changed_at[block_id] = self._mark
                self._owner[block_id] = None
            return
        self._changed_at[block_ids] = self._mark
        if isinstance(block_ids, np.ndarray):
            for block_id in block_ids.tolist():
                self._owner[block_id] = None
        else:
            self._owner[block_ids] = None

    def handed_out_all(self) -> None:
        """As `handed_out` for every block (the store forgot every key)."""
        self._mark += 1
        self._changed_at[:] = self._mark
        self._owner = [None] * self._layout.num_blocks

    def stage(self, entry: Entry, req_id: str, rows: torch.Tensor, token_start: int) -> None:
        """Checks and keeps a copy of ``rows`` for tokens ``token_start ..`` of a request."""
        if not entry.spec.deferred:
            raise ValueError(
                f"entry {entry.spec.name!r}: expected a deferred entry, found a direct one"
            )
        check_str("req_id", req_id)
        check_int("token_start", token_start, minimum=0)
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows: expected torch.Tensor, found {type_name(rows)}")
        check_rows(entry.spec, rows, int(rows.shape[0]) if rows.ndim else 0)
        self._keep(entry.spec.name, req_id, rows, token_start, self._mark, None)

    def stage_step(
        self,
        todo: Sequence[tuple[Entry, torch.Tensor]],
        requests: Sequence[ScheduledRequest],
        spans: Sequence[tuple[int, int]],
        slots: IntArray | list[int] | None,
    ) -> None:
        """Keeps each request's rows of each checked deferred output of a step.

        Args:
            todo: Deferred entries and their rows (checked: every span's rows).
            requests: The step's requests (checked), in batch order.
            spans: The ``[start, stop)`` rows of each request.
            slots: The checked slot of each row (None: not known): each
                request's step then wrote into the blocks of its rows, and
                its chunks know their blocks.
        """
        if slots is None:
            marks = [self._mark] * len(requests)
            blocks: list[IntArray | None] = [None] * len(requests)
        else:
            row_blocks = np.asarray(slots, dtype=np.int64) // self._layout.block_size
            marks = self._claim(requests, spans, row_blocks.tolist())
            blocks = [row_blocks[start:stop].copy() if todo else None for start, stop in spans]
        for entry, value in todo:
            for request, (start, stop), mark, row_blocks_of in zip(
                requests, spans, marks, blocks, strict=True
            ):
                rows = value[start:stop]
                self._keep(
                    entry.spec.name,
                    request.req_id,
                    rows,
                    request.num_computed_tokens,
                    mark,
                    row_blocks_of,
                )

    def has_staged(self, req_id: str) -> bool:
        """Whether ``req_id`` has rows waiting for `commit`."""
        return req_id in self._staged

    def commit(
        self,
        writer: Writer,
        entries: Mapping[str, Entry],
        req_id: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        tier: BlockTier | None,
    ) -> dict[str, WriteResult]:
        """Writes a request's staged rows into its blocks, then drops them (see `TensorStore`).

        Raises:
            ValueError, IndexError, TypeError: Nothing staged for ``req_id``,
                bad blocks or keys, or staged tokens beyond its blocks; then
                nothing is written and the rows stay staged.
            StaleCommitError: A row would land in a block that changed hands
                since it was staged, or in another block than it was staged
                for; counted, nothing is written and the rows stay staged.
        """
        per_entry = self._get(req_id)
        num_blocks = self._layout.num_blocks
        ids = block_id_array("block_ids", block_ids, num_blocks)
        if len(block_keys) > len(ids):
            raise ValueError(
                f"block_keys: expected at most {len(ids)} keys (one per block), "
                f"found {len(block_keys)}"
            )
        keys = check_block_keys(dict(zip(ids.tolist(), block_keys, strict=False)), num_blocks)
        bs = self._layout.block_size
        num_positions = len(ids) * bs
        for name, chunks in per_entry.items():
            for chunk in chunks:
                stop = chunk.token_start + int(chunk.rows.shape[0])
                if stop > num_positions:
                    raise ValueError(
                        f"entry {name!r}: staged tokens {chunk.token_start}..{stop - 1} of "
                        f"request {req_id!r}: expected tokens below {num_positions} "
                        f"({len(ids)} blocks of {bs})"
                    )
        for name, chunks in per_entry.items():
            refusal = self._refusal(req_id, name, chunks, ids)
            if refusal is not None:
                self._stats.num_refused_commits += 1
                raise refusal
        plans = []
        for name, chunks in per_entry.items():
            for chunk in chunks:
                positions = np.arange(
                    chunk.token_start, chunk.token_start + int(chunk.rows.shape[0]), dtype=np.int64
                )
                slots = ids[positions // bs] * bs + positions % bs
                plans.append((entries[name], chunk.rows, segments(slots, None, bs)))
        self._drop(req_id)
        results: dict[str, WriteResult] = {}
        for entry, rows, segs in plans:
            result = writer.apply(entry, rows, segs, keys, tier)
            name = entry.spec.name
            prev = results.get(name)
            results[name] = result if prev is None else merge_results(prev, result)
        return results

    def discard(self, req_id: str) -> int:
        """Drops a request's staged rows; returns their bytes.

        Raises:
            ValueError: ``req_id`` has nothing staged.
        """
        self._get(req_id)
        return self._drop(req_id)

    def staged_rows(self) -> dict[str, dict[str, list[Chunk]]]:
        """Every staged chunk by request and entry name, in staging order (see `TensorStore`)."""
        return {
            req_id: {
                name: [(chunk.token_start, chunk.rows) for chunk in chunks]
                for name, chunks in per_entry.items()
            }
            for req_id, per_entry in self._staged.items()
        }

    def _claim(
        self,
        requests: Sequence[ScheduledRequest],
        spans: Sequence[tuple[int, int]],
        row_blocks: list[int],
    ) -> list[int]:
        """Records whose step wrote into each block; returns each request's mark.

        A block that another request's step wrote into last changes hands.
        Requests are taken in batch order, each marked after its own blocks:
        two requests writing one block in one step leave the first one's rows
        refused.
        """
        owner = self._owner
        marks: list[int] = []
        for request, (start, stop) in zip(requests, spans, strict=True):
            req_id = request.req_id
            for block_id in set(row_blocks[start:stop]):
                held = owner[block_id]
                if held != req_id:
                    if held is not None:
                        self._mark += 1
                        self._changed_at[block_id] = self._mark
                    owner[block_id] = req_id
            marks.append(self._mark)
        return marks

    def _refusal(
        self, req_id: str, name: str, chunks: Sequence[_Staged], ids: IntArray
    ) -> StaleCommitError | None:
        """Why committing an entry's chunks into blocks ``ids`` is refused, if it is.

        Chunks fit ``ids`` (checked). Each token is checked as its last chunk
        staged it, since that chunk's rows overwrite the earlier ones.
        """
        bs = self._layout.block_size
        num_positions = len(ids) * bs
        marks = np.full(num_positions, -1, dtype=np.int64)
        staged_blocks = np.full(num_positions, -1, dtype=np.int64)
        for chunk in chunks:
            stop = chunk.token_start + int(chunk.rows.shape[0])
            marks[chunk.token_start : stop] = chunk.mark
            staged_blocks[chunk.token_start : stop] = -1 if chunk.blocks is None else chunk.blocks
        tokens = np.flatnonzero(marks >= 0)
        now = ids[tokens // bs]
        staged_for = staged_blocks[tokens]
        bad = np.flatnonzero(
            (self._changed_at[now] > marks[tokens]) | ((staged_for >= 0) & (staged_for != now))
        )
        if not bad.size:
            return None
        first = int(bad[0])
        token, block_id, staged_block = int(tokens[first]), int(now[first]), int(staged_for[first])
        owner = self._owner[block_id]
        return StaleCommitError(
            req_id,
            name,
            token,
            token // bs,
            block_id,
            None if staged_block < 0 else staged_block,
            # NOTE: a block the request wrote into again after it was handed
            # out is still one that was handed out since the row was staged.
            None if owner == req_id else owner,
        )

    def _keep(
        self,
        name: str,
        req_id: str,
        rows: torch.Tensor,
        token_start: int,
        mark: int,
        blocks: IntArray | None,
    ) -> None:
        if rows.shape[0] == 0:
            return
        chunk = _Staged(token_start, rows.detach().clone(), mark, blocks)
        self._staged.setdefault(req_id, {}).setdefault(name, []).append(chunk)
        self._stats.num_staged_bytes += chunk.rows.numel() * chunk.rows.element_size()

    def _get(self, req_id: str) -> dict[str, list[_Staged]]:
        per_entry = self._staged.get(req_id)
        if per_entry is None:
            raise ValueError(
                f"req_id: expected a request with staged rows, found {req_id!r} "
                f"({len(self._staged)} requests staged)"
            )
        return per_entry

    def _drop(self, req_id: str) -> int:
        per_entry = self._staged.pop(req_id)
        num_bytes = sum(
            chunk.rows.numel() * chunk.rows.element_size()
            for chunks in per_entry.values()
            for chunk in chunks
        )
        self._stats.num_staged_bytes -= num_bytes
        return num_bytes


class DeferredMethods:
    """`TensorStore`'s methods for deferred entries (TensorStore sets the attributes)."""

    tier: BlockTier | None
    _entries: dict[str, Entry]
    _deferred: DeferredRows
    _writer: Writer

    def stage(self, req_id: str, name: str, rows: torch.Tensor, *, token_start: int) -> None:
        """Keeps rows of deferred entry ``name`` for tokens ``token_start ..`` of a request.

        The rows are copied on their own device (the model may reuse its
        output buffers); `commit` writes them, `discard` drops them.
        """
        self._deferred.stage(entry_named(self._entries, name), req_id, rows, token_start)

    def stage_outputs(
        self,
        requests: Sequence[ScheduledRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
    ) -> None:
        """Stages each request's rows of every deferred entry in the outputs.

        Request i's rows follow those of requests 0 .. i-1 in each output;
        they belong to tokens ``num_computed_tokens ..`` of the request.
        """
        outputs = step_outputs.merge_outputs(hidden_states, multimodal_outputs)
        spans = request_spans(requests)
        total = spans[-1][1] if spans else 0
        todo = step_outputs.deferred_outputs(self._entries, outputs, total)
        self._deferred.stage_step(todo, requests, spans, None)

    def has_staged(self, req_id: str) -> bool:
        """Whether ``req_id`` has rows waiting for `commit`."""
        return self._deferred.has_staged(req_id)

    def commit(
        self,
        req_id: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
    ) -> dict[str, WriteResult]:
        """Writes a finished request's staged rows into its blocks.

        Call it before the request's block table is released. A table whose
        blocks changed hands since the rows were staged is refused (see
        `omnicache.store.deferred_rows`), never written.

        Args:
            req_id: A request with staged rows (`has_staged`).
            block_ids: The request's blocks, first block first.
            block_keys: Keys of its full blocks, first block first (at most
                ``len(block_ids)``); completed blocks are stamped with them.

        Returns:
            The merged result of each entry written, by name.

        Raises:
            ValueError: Unknown request, or staged tokens beyond its blocks;
                then nothing is written and the rows stay staged.
            StaleCommitError: A staged row's block in ``block_ids`` changed
                hands since the row was staged (handed out again, or written
                by another request's step), or is not the block
                `TensorStore.write_step` staged it for. Counted in
                ``num_refused_commits``; nothing is written and the rows stay
                staged, for `discard`.
        """
        return self._deferred.commit(
            self._writer, self._entries, req_id, block_ids, block_keys, self.tier
        )

    def discard(self, req_id: str) -> int:
        """Drops an aborted request's staged rows.

        Returns:
            The number of bytes dropped.

        Raises:
            ValueError: ``req_id`` has nothing staged.
        """
        return self._deferred.discard(req_id)
