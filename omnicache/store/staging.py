"""Rows of deferred entries, kept per request until it finishes (`commit`) or aborts (`discard`).

A deferred entry's rows are not written when computed: they are staged per
request (copied on the device they came from, since the model may reuse its
output buffers) and written into the request's blocks once, when it finishes
and its block table is still known. Staged rows never touch the cache until
then, so a request that aborts leaves no trace but the counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, check_str, type_name
from omnicache.store import outputs as step_outputs
from omnicache.store.blocks import block_id_array, check_block_keys, request_spans
from omnicache.store.entries import Entry, Layout, check_rows, entry_named
from omnicache.store.slots import segments
from omnicache.store.specs import ScheduledRequest, StoreStats, WriteResult, merge_results
from omnicache.store.tier import BlockTier
from omnicache.store.writes import Writer

# (first token position, rows) of one staged chunk.
Chunk = tuple[int, torch.Tensor]


class Staging:
    """Staged rows by request and entry name, counted in ``stats.num_staged_bytes``."""

    def __init__(self, layout: Layout, stats: StoreStats) -> None:
        self._layout = layout
        self._stats = stats
        # req_id -> entry name -> chunks in staging order.
        self._staged: dict[str, dict[str, list[Chunk]]] = {}

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
        self._keep(entry.spec.name, req_id, rows, token_start)

    def stage_step(
        self,
        todo: Sequence[tuple[Entry, torch.Tensor]],
        requests: Sequence[ScheduledRequest],
        spans: Sequence[tuple[int, int]],
    ) -> None:
        """Keeps each request's rows of each checked deferred output of a step.

        Args:
            todo: Deferred entries and their rows (checked: every span's rows).
            requests: The step's requests (checked), in batch order.
            spans: The ``[start, stop)`` rows of each request.
        """
        for entry, value in todo:
            for request, (start, stop) in zip(requests, spans, strict=True):
                rows = value[start:stop]
                self._keep(entry.spec.name, request.req_id, rows, request.num_computed_tokens)

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
        plans = []
        for name, chunks in per_entry.items():
            for token_start, chunk in chunks:
                stop = token_start + int(chunk.shape[0])
                if stop > num_positions:
                    raise ValueError(
                        f"entry {name!r}: staged tokens {token_start}..{stop - 1} of request "
                        f"{req_id!r}: expected tokens below {num_positions} "
                        f"({len(ids)} blocks of {bs})"
                    )
                positions = np.arange(token_start, stop, dtype=np.int64)
                slots = ids[positions // bs] * bs + positions % bs
                plans.append((entries[name], chunk, segments(slots, None, bs)))
        self._drop(req_id)
        results: dict[str, WriteResult] = {}
        for entry, chunk, segs in plans:
            result = writer.apply(entry, chunk, segs, keys, tier)
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
            req_id: {name: list(chunks) for name, chunks in per_entry.items()}
            for req_id, per_entry in self._staged.items()
        }

    def _keep(self, name: str, req_id: str, rows: torch.Tensor, token_start: int) -> None:
        if rows.shape[0] == 0:
            return
        chunk = rows.detach().clone()
        self._staged.setdefault(req_id, {}).setdefault(name, []).append((token_start, chunk))
        self._stats.num_staged_bytes += chunk.numel() * chunk.element_size()

    def _get(self, req_id: str) -> dict[str, list[Chunk]]:
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
            chunk.numel() * chunk.element_size()
            for chunks in per_entry.values()
            for _, chunk in chunks
        )
        self._stats.num_staged_bytes -= num_bytes
        return num_bytes


class DeferredMethods:
    """`TensorStore`'s methods for deferred entries (TensorStore sets the attributes)."""

    tier: BlockTier | None
    _entries: dict[str, Entry]
    _staging: Staging
    _writer: Writer

    def stage(self, req_id: str, name: str, rows: torch.Tensor, *, token_start: int) -> None:
        """Keeps rows of deferred entry ``name`` for tokens ``token_start ..`` of a request.

        The rows are copied on their own device (the model may reuse its
        output buffers); `commit` writes them, `discard` drops them.
        """
        self._staging.stage(entry_named(self._entries, name), req_id, rows, token_start)

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
        self._staging.stage_step(todo, requests, spans)

    def has_staged(self, req_id: str) -> bool:
        """Whether ``req_id`` has rows waiting for `commit`."""
        return self._staging.has_staged(req_id)

    def commit(
        self,
        req_id: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
    ) -> dict[str, WriteResult]:
        """Writes a finished request's staged rows into its blocks.

        Call it before the request's block table is released.

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
        """
        return self._staging.commit(
            self._writer, self._entries, req_id, block_ids, block_keys, self.tier
        )

    def discard(self, req_id: str) -> int:
        """Drops an aborted request's staged rows.

        Returns:
            The number of bytes dropped.

        Raises:
            ValueError: ``req_id`` has nothing staged.
        """
        return self._staging.discard(req_id)
