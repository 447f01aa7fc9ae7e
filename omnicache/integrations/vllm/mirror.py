"""The engine core's mirror of what the worker holds, and the plan of each step.

Everything here runs in the engine core's process, inside vLLM's scheduler,
and knows the worker only by the plans it sends it (`plan.StepPlan`):

- `StoreMirror` writes the worker's table (`block_tables.WorkerTable`: per
  block, the key the worker's rows are stamped with and how many arrived in
  order) as vLLM allocates slots: the KV cache manager
  (`kv_cache_manager.OmniKVCacheManager`) tells it each allocation, with the
  request's block table and hit, and each reuse, and caps hits to the
  table; the mirror calls nothing back. It turns each step into its
  `StepPlan`; it is the connector's scheduler side (`plan.SchedulerSide`),
  and with a tier it looks blocks up there.

The mirror and the worker. The worker writes every scheduled token's hidden
states into its store, synchronously inside the step, and stamps the full
blocks they complete. The scheduler must know those stamps *before* the
step runs: it caps every prefix hit to stamped blocks, and vLLM caches a
block as soon as it allocates it, so a request scheduled later in the same
step can hit a block that this step computes. So the table is written by the
same rules at the same slots with the same keys, as vLLM allocates the
slots (a one-token allocation, a decode token, is queued and recorded at
the mirror's next use, in vLLM's order: before any lookup, reuse or plan
reads or changes the table); blocks vLLM hands out again are cleared in
both (``cleared_block_ids`` in the next plan). Since the worker applies
each step's plan before the next one, a stamp in the table is a stamp in
the worker's store by the time a request scheduled after it reads it. An
allocation that is not scheduled in the end (vLLM's priority preemption can
take back a request already scheduled) is undone in both; a request
scheduled otherwise than allocated is planned without blocks, and since the
worker then writes the whole step's rows without keys (it cannot check
their slots), no block of the step keeps a stamp in either. The worker still
verifies every hit it reads: a table that runs ahead of it (a step's slots
not the planned ones) costs a counted stale hit, never wrong rows.

The mirror also numbers the plans (`StepPlan.number`) and keeps, per block,
the number of the last plan that wrote rows to it: a steady decode step may
clear blocks that no plan of the `plan.MAX_STAGED_STEPS` before it wrote
to (`StepPlan.decode`), since the worker holds no rows staged for them but
from plans that old, which it writes first. Most blocks vLLM hands out are
either new or cached long before, so the steps where a request starts a
block stay steady decode steps.

Blocks loaded from a tier (docs/architecture.md, "Hidden states in a live
engine"): the lookup asks only which blocks exist; `StoreMirror.on_loaded`
stamps them when vLLM allocates them and the plan orders their load while
vLLM holds the request; `StoreMirror.on_loads_done` clears the blocks that
did not load, and the request's first scheduled step carries its hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.block_tables import RequestState, WorkerTable
from omnicache.integrations.vllm.kv_tier import TierReader
from omnicache.integrations.vllm.plan import (
    EXTERNAL_TOKENS_PARAM,
    MAX_STAGED_STEPS,
    LoadOrder,
    PlannedRequest,
    StepPlan,
    prompt_requests,
    scheduled,
)

__all__ = ["StoreMirror"]

# A step without new requests: none asks for hidden states (`plan.prompt_requests`).
_NONE: tuple[Mapping[str, int], frozenset[str]] = (MappingProxyType({}), frozenset())


# -- the mirror and the plan ----------------------------------------------------------------


class StoreMirror:
    """Mirrors the worker's stamps and plans each step.

    Keeps the `WorkerTable`, which the KV cache manager caps hits to, and
    hears the manager's allocations and reuses (the manager makes it:
    `kv_cache_manager.OmniKVCacheManager.attach_mirror`). It is the
    connector's scheduler side (`plan.SchedulerSide`): the step's plan, and
    with a tier (``reader``) the tier's hooks.

    Args:
        num_blocks: blocks of the KV cache (vLLM's null block included).
        block_size: tokens per block of the group the rows follow.
        reader: the tier's reader (None: no tier, no external tokens).
    """

    def __init__(self, num_blocks: int, block_size: int, reader: TierReader | None = None) -> None:
        self._reader = reader
        self._table = WorkerTable(num_blocks, block_size)
        self._block_size = block_size
        # One-token allocations (a decode token each: most of a step's), as the
        # manager queues them: (request id, its state, the token's position),
        # recorded as `on_allocated` would, in vLLM's order, before anything
        # else reads or changes what the mirror holds (`_record_queued`).
        self.queued: list[tuple[str, RequestState, int]] = []
        # Request id -> the slots vLLM gave it in the step being scheduled: its
        # part of the step (without a hit, which the plan adds); and, for those
        # whose slots touch full blocks, those blocks' keys.
        self._allocated: dict[str, PlannedRequest] = {}
        self._allocated_keys: dict[str, dict[int, BlockHash]] = {}
        # Request id -> its load, ordered in the step being scheduled.
        self._loaded: dict[str, LoadOrder] = {}
        # Loads ordered and not yet reported done by the worker.
        self._loading: set[str] = set()
        # Request id -> its loaded blocks, until its first scheduled step.
        self._external_hits: dict[str, LoadOrder] = {}
        self._cleared: dict[int, None] = {}
        self._reset = False
        # Per block, the number of the last plan that wrote rows to it (an
        # allocation), and whether a block handed out again in the step being
        # scheduled was written by one of the `MAX_STAGED_STEPS` plans before
        # it: the worker may still hold those rows staged (`StepPlan.decode`).
        self._num_plans = 0
        self._written_at = [-MAX_STAGED_STEPS] * self._table.num_blocks
        self._clears_recent = False

    @property
    def table(self) -> WorkerTable:
        """What the worker holds once it has applied every allocation so far (queued ones too)."""
        if self.queued:
            self._record_queued()
        return self._table

    # -- the connector's scheduler side ---------------------------------------------------

    def step_plan(self, scheduler_output: Any) -> StepPlan:
        """The plan of the step ``scheduler_output`` describes (see `plan`)."""
        prompts, sequences = (
            prompt_requests(scheduler_output) if scheduler_output.scheduled_new_reqs else _NONE
        )
        finished = scheduler_output.finished_req_ids
        return self.plan(
            scheduled(scheduler_output),
            prompts,
            sorted(finished) if finished else (),
            sequence_requests=sequences,
        )

    def num_external_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """The further full blocks of the key chain the tier holds (`TierReader.num_blocks`).

        Never the prompt's last token: vLLM must compute one.
        """
        if self._reader is None:
            return 0
        size = self._block_size
        keys = request.block_hashes[: int(request.num_tokens - 1) // size]
        return self._reader.num_blocks(request.request_id, keys, num_computed_tokens // size) * size

    def on_external_allocated(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Orders the load of the blocks vLLM gave a request's external tokens (`on_loaded`)."""
        size = self._block_size
        if num_external_tokens % size or (num_external_tokens and self._reader is None):
            raise RuntimeError(
                f"request {request.request_id}: expected external tokens in whole blocks of "
                f"the tier, found {num_external_tokens}"
            )
        if self._reader is None:
            return
        num = num_external_tokens // size
        first, keys = self._reader.allocated(request.request_id, num)
        if num:
            self.on_loaded(request.request_id, block_ids[first : first + num], keys)

    def on_loads_done(self, req_ids: Iterable[str], failed_block_ids: Iterable[int]) -> None:
        """The worker ran these requests' loads; the blocks that did not load lose their stamps.

        A request whose load failed keeps as its hit the blocks before the
        first that failed, and never asks the tier again.
        """
        self._loading.difference_update(req_ids)
        failed = set(failed_block_ids)
        if not failed:
            return
        ids = sorted(failed)
        self.table.clear(ids)
        for block_id in ids:
            self._cleared[block_id] = None
        for req_id, order in list(self._external_hits.items()):
            index = next((i for i, b in enumerate(order.block_ids) if b in failed), None)
            if index is None:
                continue
            if self._reader is not None:
                self._reader.failed(req_id, index)
            self._external_hits[req_id] = LoadOrder(
                req_id, order.block_ids[:index], order.block_keys[:index]
            )

    def finished(self, request: Any) -> tuple[bool, dict[str, Any]]:
        """Whether a load holds its blocks; with a tier, ``{"omnicache_external_tokens": n}``."""
        req_id = request.request_id
        unread = self._external_hits.pop(req_id, None)
        if unread is not None:
            # NOTE: loaded for a request that ended before it ran: vLLM may
            # never cache them, so no reuse would clear their stamps. The
            # worker clears them in the next plan, after the load.
            self.table.clear(unread.block_ids)
            self._cleared.update(dict.fromkeys(unread.block_ids))
        if self._reader is None:
            return req_id in self._loading, {}
        external = self._reader.finished(req_id) * self._block_size
        return req_id in self._loading, {EXTERNAL_TOKENS_PARAM: external}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    # -- what the manager tells it ---------------------------------------------------

    def on_allocated(self, request_id: str, state: RequestState, start: int, num_new: int) -> None:
        """The request was given slots for its tokens ``start .. start + num_new - 1``,
        which the step computes (``state``: the request's, its block table updated).

        The manager queues one-token allocations instead (`queued`).
        """
        if self.queued:
            self._record_queued()
        self._record(request_id, state, start, num_new)

    def _record_queued(self) -> None:
        """Records the queued one-token allocations, in order (`on_allocated`'s)."""
        size, table, number = self._block_size, self._table, self._num_plans
        allocated, allocated_keys = self._allocated, self._allocated_keys
        written_at = self._written_at
        try:
            for request_id, state, start in self.queued:
                found = state.token_block(start, size) if request_id not in allocated else None
                if found is None:
                    self._record(request_id, state, start, 1)
                    continue
                # A decode token, the common case: its block, and one row of the table.
                block_id, key = found
                offset = start % size
                table.write_row(block_id, offset, key)
                written_at[block_id] = number
                allocated[request_id] = (
                    PlannedRequest(request_id, start, 1, (block_id,))
                    if offset
                    else PlannedRequest(
                        request_id, start, 1, (block_id,), state.hit_block_ids, state.hit_block_keys
                    )
                )
                if key is not None:
                    allocated_keys[request_id] = {block_id: key}
        finally:
            # NOTE: never recorded twice, even after an error.
            self.queued.clear()

    def _record(self, request_id: str, state: RequestState, start: int, num_new: int) -> None:
        size = self._block_size
        prior = self._allocated.get(request_id)
        block_keys: dict[int, BlockHash] = {}
        ids = state.block_ids(start, num_new, size, block_keys, "allocate_slots")
        self._table.write_tokens(ids, start, start + num_new, block_keys)
        number, written_at = self._num_plans, self._written_at
        for block_id in ids:
            written_at[block_id] = number
        block_ids = tuple(ids)
        if prior is not None:
            # NOTE: two allocations in one step cannot both be the step's
            # rows: start -1 never matches, so both are undone at planning.
            block_ids = prior.block_ids + block_ids
            start = -1
        # NOTE: the request's hit rides on an allocation that starts a block,
        # the only kind the plan gives one (`plan`).
        self._allocated[request_id] = (
            PlannedRequest(request_id, start, num_new, block_ids)
            if start % size
            else PlannedRequest(
                request_id, start, num_new, block_ids, state.hit_block_ids, state.hit_block_keys
            )
        )
        if block_keys:
            self._allocated_keys[request_id] = block_keys

    def on_cleared(self, block_id: int | None) -> None:
        """vLLM handed ``block_id`` out again or dropped its key (None: every block)."""
        if block_id is None:
            self.table.clear_all()
            self._reset = True
            self._cleared.clear()
        else:
            self.table.clear((block_id,))
            self._cleared[block_id] = None
            if self._written_at[block_id] + MAX_STAGED_STEPS > self._num_plans:
                self._clears_recent = True

    def on_loaded(
        self, request_id: str, block_ids: Sequence[int], block_keys: Sequence[BlockHash]
    ) -> None:
        """Stamps blocks the worker will load from a tier in this step (see the module)."""
        if len(block_ids) != len(block_keys):
            raise ValueError(
                f"block_keys: expected {len(block_ids)} (one per block), found {len(block_keys)}"
            )
        self.table.stamp_blocks(block_ids, block_keys)
        order = LoadOrder(request_id, tuple(block_ids), tuple(block_keys))
        self._loaded[request_id] = order
        self._external_hits[request_id] = order

    # -- planning -------------------------------------------------------------------

    def plan(
        self,
        scheduled: Iterable[tuple[str, int, int]],
        prompt_requests: Mapping[str, int],
        finished_req_ids: Iterable[str],
        *,
        sequence_requests: Iterable[str] = (),
    ) -> StepPlan:
        """The step's plan, from its ``(request id, start, num_new)`` as vLLM scheduled them.

        Allocations that do not match what was scheduled are undone: their
        blocks lose their stamps here, and in the worker's store after the
        step's writes; and a request scheduled without a matching
        allocation is planned without blocks, so the step's rows are
        written without keys, and none of its blocks keeps a stamp. A step
        of one decode token a request, each in its allocated block and
        without a hit, that loads and asks for nothing, and clears only
        blocks no plan of the last `MAX_STAGED_STEPS` wrote rows to, is
        marked as one (`StepPlan.decode`): the worker stages it by its plan
        alone.
        """
        if self.queued:
            self._record_queued()
        requests: list[PlannedRequest] = []
        block_keys: dict[int, BlockHash] = {}
        undone: dict[int, None] = {}
        size = self._block_size
        allocated, allocated_keys = self._allocated, self._allocated_keys
        external_hits = self._external_hits
        # Whether every request computes one token in its block, without a hit;
        # and whether one computes tokens in no planned blocks.
        decode, unplanned = True, False
        for req_id, start, num_new in scheduled:
            planned = allocated.pop(req_id, None)
            keys = allocated_keys.pop(req_id, None) if allocated_keys else None
            external = external_hits.pop(req_id, None) if external_hits else None
            if planned is None or planned.start != start or planned.num_new != num_new:
                if planned is not None:
                    undone.update(dict.fromkeys(planned.block_ids))
                requests.append(PlannedRequest(req_id, start, num_new))
                decode = False
                unplanned = unplanned or num_new > 0
                continue
            if keys:
                block_keys.update(keys)
            if start % size:
                # NOTE: no hit: one is given in the step right after it, which
                # starts a block (most decode steps start none).
                requests.append(planned)
                if num_new != 1 or len(planned.block_ids) != 1:
                    decode = False
                continue
            hit_ids, hit_keys = planned.hit_block_ids, planned.hit_block_keys
            if external is not None:
                hit_ids, hit_keys = hit_ids + external.block_ids, hit_keys + external.block_keys
            # NOTE: vLLM takes as computed a prefix of the hit: all of it, or,
            # after a failed load, the blocks before the first that failed.
            num_hit = start // size
            if num_hit > len(hit_ids):
                hit_ids, hit_keys = (), ()
            if num_new != 1 or len(planned.block_ids) != 1 or (num_hit and hit_ids):
                decode = False
            requests.append(
                PlannedRequest(
                    req_id, start, num_new, planned.block_ids, hit_ids[:num_hit], hit_keys[:num_hit]
                )
            )
        if allocated:
            for planned in allocated.values():
                undone.update(dict.fromkeys(planned.block_ids))
            allocated.clear()
            allocated_keys.clear()
        if undone:
            self.table.clear(undone)
        if unplanned and block_keys:
            # NOTE: the worker cannot check the slots of a request without
            # planned blocks, and writes such a step's rows without keys
            # (`LiveStore`): no block the step writes is stamped there, nor here.
            self.table.unstamp([b for item in requests for b in item.block_ids])
            block_keys = {}
        # NOTE: each part built only when the step has one: most steps have
        # none, and the scheduler plans every step.
        loaded, cleared = self._loaded, self._cleared
        # NOTE: the fields in their order, without keywords: the scheduler plans
        # every step, and keywords cost more than the rest of a decode step's
        # plan (benchmarks/bench_vllm_wrapper.py pins the plan's cost).
        plan = StepPlan(
            True,  # caching
            tuple(requests),  # requests
            block_keys,  # block_keys
            dict(prompt_requests) if prompt_requests else {},  # prompt_requests
            frozenset(sequence_requests),  # sequence_requests
            {},  # result_keys (the connector's)
            tuple(cleared) if cleared else (),  # cleared_block_ids
            self._reset,  # reset
            tuple(undone) if undone else (),  # invalidated_block_ids
            tuple(finished_req_ids),  # finished_req_ids
            tuple(loaded.values()) if loaded else (),  # loads
            decode  # decode
            and bool(requests)
            and not (undone or loaded or self._clears_recent or self._reset or prompt_requests),
            self._num_plans,  # number
        )
        self._num_plans += 1
        self._clears_recent = False
        if loaded:
            self._loading.update(loaded)
            loaded.clear()
        if cleared:
            cleared.clear()
        self._reset = False
        return plan
