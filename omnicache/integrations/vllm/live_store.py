"""`LiveStore`: a worker's `TensorStore` fed by each step's hidden states, and prompt results.

The worker that runs the model applies each step's `StepPlan` (from the
scheduler) to the rows the model produced, in the plan's order:

1. ``reset`` and ``cleared_block_ids``: stamps of blocks vLLM handed out again
   (`LiveStore.begin`: the connector applies it before it loads blocks from
   a tier, which then stamps the blocks it fills);
2. the step's rows, written at the forward pass's own slot mapping (the KV
   cache's slots), stamped with the plan's keys when the slots are those the
   scheduler planned (otherwise written without keys: nothing stamped);
3. ``invalidated_block_ids``;
4. every prefix hit that starts in this step is *verified*: a hit block not
   stamped with its key counts as stale (`LiveStoreStats.num_stale_hit_blocks`)
   and is never served; requests that asked for their prompt's hidden states
   get the hit blocks' rows from the store and the rest from the step's rows
   (`TensorStore.read_merged`).

A request whose tier load failed (`LiveStore.fail_loads`) was computed over
KV that is not its own: its rows stamp nothing and feed no prompt result, and
its hit is not verified (vLLM recomputes it from the failed block on).

Writes come before reads because vLLM caches a block as soon as it is
allocated: a request scheduled in the same step as the one computing a block
can hit it, and its rows exist once the step's rows are written.

Prompt results are kept per request until taken (`LiveStore.take`), at most
``max_results`` of them (the oldest untaken one is dropped first, counted in
``num_results_dropped``); a request that finishes before all its prompt
positions were seen is dropped (``num_incomplete_dropped``). A request whose
hit could not be read has a result of None (``num_prompt_failures``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, check_str, type_name
from omnicache.integrations.vllm.step_plan import PlannedRequest, StepPlan, planned_slots
from omnicache.store import HIDDEN_STATES, ScheduledRequest, TensorStore

__all__ = ["LiveStore", "LiveStoreStats"]


@dataclass(slots=True)
class LiveStoreStats:
    """Counters of a `LiveStore` since construction (``num_pending_results``: now)."""

    num_steps: int = 0
    # Blocks whose stamps the plans cleared (vLLM handed them out again).
    num_cleared_blocks: int = 0
    num_rows_written: int = 0
    # Prefix hits verified, and their blocks.
    num_hit_requests: int = 0
    num_hit_blocks: int = 0
    # Hit blocks whose rows did not hold their key: never served.
    num_stale_hit_blocks: int = 0
    # Steps whose slot mapping differed from the scheduler's plan.
    num_slot_mismatches: int = 0
    # Requests whose rows were dropped: their tier load failed.
    num_failed_load_requests: int = 0
    num_prompt_results: int = 0
    num_prompt_failures: int = 0
    num_results_dropped: int = 0
    num_incomplete_dropped: int = 0
    num_pending_results: int = 0


@dataclass(slots=True)
class _Prompt:
    """The prompt rows of one request, gathered chunk by chunk."""

    num_tokens: int
    # (first position, rows), in position order.
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, start: int, rows: torch.Tensor) -> torch.Tensor | None:
        """Adds rows from position ``start``; returns the whole prompt once complete.

        A chunk replaces every chunk from its start on: a request recomputed
        after preemption starts over.
        """
        self.chunks = [chunk for chunk in self.chunks if chunk[0] < start]
        self.chunks.append((start, rows[: self.num_tokens - start]))
        position = 0
        for first, part in self.chunks:
            if first != position:
                return None
            position += len(part)
        if position < self.num_tokens:
            return None
        return torch.cat([part for _, part in self.chunks])


class LiveStore:
    """A worker's store of hidden states, kept in step with the scheduler's plans.

    Args:
        store: a store with the KV cache's number of blocks and block size,
            and a `HIDDEN_STATES` entry.
        max_results: prompt results kept until taken.
    """

    def __init__(self, store: TensorStore, *, max_results: int) -> None:
        if not isinstance(store, TensorStore):
            raise TypeError(f"store: expected a TensorStore, found {type_name(store)}")
        if HIDDEN_STATES not in store.entries:
            raise ValueError(
                f"store: expected an entry {HIDDEN_STATES!r}, found {sorted(store.entries)}"
            )
        self.store = store
        self.max_results = check_int("max_results", max_results, minimum=1)
        self._prompts: dict[str, _Prompt] = {}
        self._results: OrderedDict[str, torch.Tensor | None] = OrderedDict()
        self._stats = LiveStoreStats()
        self._begun: StepPlan | None = None
        self._failed: set[str] = set()

    @property
    def stats(self) -> LiveStoreStats:
        """A snapshot of the counters."""
        return replace(self._stats, num_pending_results=len(self._results))

    def begin(self, plan: StepPlan) -> None:
        """Applies the start of a step's plan: cleared stamps, new prompt requests (once)."""
        if self._begun is plan:
            return
        self._begun = plan
        self._failed.clear()
        store = self.store
        if plan.reset:
            store.invalidate_all()
        if plan.cleared_block_ids:
            store.invalidate(plan.cleared_block_ids)
            self._stats.num_cleared_blocks += len(plan.cleared_block_ids)
        for req_id, num_tokens in plan.prompt_requests.items():
            self._prompts[req_id] = _Prompt(num_tokens)

    def fail_loads(self, req_ids: Iterable[str]) -> None:
        """Marks requests of the begun step whose tier load failed (see the module)."""
        self._failed.update(req_ids)

    def apply(
        self,
        plan: StepPlan,
        batch_order: Sequence[str] = (),
        hidden_states: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
    ) -> dict[int, BlockHash]:
        """Applies one step: its plan, and the rows the model produced for it.

        Args:
            plan: the scheduler's plan of the step.
            batch_order: the step's request ids in the order of the rows.
            hidden_states: ``(>= num scheduled tokens, hidden)`` rows (None:
                no forward pass this step).
            slot_mapping: the forward pass's slot of each row (padding after
                the scheduled tokens).

        Returns:
            Block id -> key of the blocks the step's rows stamped.

        Raises:
            RuntimeError: the rows' requests are not the plan's.
        """
        store = self.store
        self._stats.num_steps += 1
        self.begin(plan)
        failed, self._failed = set(self._failed), set()
        self._begun = None
        self._stats.num_failed_load_requests += len(failed)
        batch: list[PlannedRequest] = []
        stamped: dict[int, BlockHash] = {}
        if hidden_states is not None and plan.requests:
            batch = self._batch(plan, batch_order)
            stamped = self._write(plan, batch, hidden_states, slot_mapping, failed)
        if plan.invalidated_block_ids:
            store.invalidate(plan.invalidated_block_ids)
            for block_id in plan.invalidated_block_ids:
                stamped.pop(block_id, None)
        if batch and hidden_states is not None:
            self._read(batch, hidden_states, failed)
        for req_id in plan.finished_req_ids:
            if self._prompts.pop(req_id, None) is not None:
                self._stats.num_incomplete_dropped += 1
        return stamped

    def take(self, request_ids: Iterable[str]) -> dict[str, torch.Tensor | None]:
        """Removes and returns the prompt results of the requests that have one.

        Returns:
            Request id -> ``(num_prompt_tokens, hidden)`` rows, or None when
            its hit could not be read (stale); ids without a result are left
            out.
        """
        found: dict[str, torch.Tensor | None] = {}
        for index, req_id in enumerate(request_ids):
            check_str(f"request_ids[{index}]", req_id)
            if req_id in self._results:
                found[req_id] = self._results.pop(req_id)
        return found

    def _batch(self, plan: StepPlan, batch_order: Sequence[str]) -> list[PlannedRequest]:
        by_id = {item.req_id: item for item in plan.requests}
        if sorted(batch_order) != sorted(by_id):
            raise RuntimeError(
                f"step: expected rows of the planned requests {sorted(by_id)}, found rows of "
                f"{sorted(batch_order)}"
            )
        return [by_id[req_id] for req_id in batch_order]

    def _write(
        self,
        plan: StepPlan,
        batch: list[PlannedRequest],
        hidden_states: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        failed: set[str],
    ) -> dict[int, BlockHash]:
        if not plan.caching:
            return {}
        if slot_mapping is None:
            raise RuntimeError("step: expected the forward pass's slot mapping, found none")
        num_rows = sum(item.num_new for item in batch)
        slots = slot_mapping[:num_rows].to("cpu", torch.int64).numpy()
        planned = planned_slots(batch, self.store.block_size)
        keys = dict(plan.block_keys)
        for item in batch:
            if item.req_id in failed:
                # NOTE: rows computed over KV that did not load: never stamped.
                for block_id in item.block_ids:
                    keys.pop(block_id, None)
        if planned is None or not np.array_equal(planned, slots):
            # NOTE: rows written without keys clear the stamps of every block
            # they touch: the scheduler's mirror may then promise a hit the
            # worker cannot serve, which the read check counts.
            self._stats.num_slot_mismatches += 1
            keys = {}
        result = self.store.write(
            HIDDEN_STATES, hidden_states, slots, block_keys=keys, num_tokens=num_rows
        )
        self._stats.num_rows_written += num_rows
        return {block_id: keys[block_id] for block_id in result.stamped_block_ids}

    def _read(
        self, batch: list[PlannedRequest], hidden_states: torch.Tensor, failed: set[str]
    ) -> None:
        offset = 0
        for item in batch:
            rows = hidden_states[offset : offset + item.num_new]
            offset += item.num_new
            if item.req_id in failed:
                continue
            if item.hit_block_ids:
                self._stats.num_hit_requests += 1
                self._stats.num_hit_blocks += len(item.hit_block_ids)
                valid = self.store.probe(item.hit_block_ids, item.hit_block_keys)
                self._stats.num_stale_hit_blocks += len(item.hit_block_ids) - valid
            prompt = self._prompts.get(item.req_id)
            if prompt is None or item.start >= prompt.num_tokens:
                continue
            start, part = item.start, rows.clone()
            if item.hit_block_ids:
                merged = self.store.read_merged(
                    [
                        ScheduledRequest(
                            item.req_id,
                            item.num_new,
                            item.start,
                            item.hit_block_ids,
                            item.hit_block_keys,
                        )
                    ],
                    hidden_states=rows,
                )
                if merged.misses:
                    self._finish(item.req_id, None)
                    continue
                start, part = 0, merged.hidden_states[item.req_id]
            whole = prompt.add(start, part)
            if whole is not None:
                self._finish(item.req_id, whole)

    def _finish(self, req_id: str, rows: torch.Tensor | None) -> None:
        del self._prompts[req_id]
        if rows is None:
            self._stats.num_prompt_failures += 1
        else:
            self._stats.num_prompt_results += 1
        self._results[req_id] = rows
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)
            self._stats.num_results_dropped += 1
