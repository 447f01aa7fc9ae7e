"""`StoreMirror`: the scheduler's copy of the worker's stamps, and each step's `StepPlan`.

The worker writes every scheduled token's hidden states into its store,
synchronously inside the step, and stamps the full blocks they complete. The
scheduler must know those stamps *before* the step runs: it caps every prefix
hit to stamped blocks (`OmniKVCacheManager`), and vLLM caches a block as
soon as it allocates it, so a request scheduled later in the same step can
hit a block that this step computes.

So the scheduler's store mirrors the worker's: its `HIDDEN_STATES` entry
holds one byte per slot instead of the hidden rows, and it is written by the
same rules at the same slots with the same keys, when vLLM allocates the
slots (`StepListener.on_allocated`); blocks vLLM hands out again are cleared
in both (`on_cleared`, sent in the next plan). Since the worker applies each
step's plan before the next one, a stamp in the mirror is a stamp in the
worker's store by the time a request scheduled after it reads it. An
allocation that is not scheduled in the end (vLLM's priority preemption can
take back a request already scheduled) is undone in both stores. The worker
still verifies every hit it reads: a mirror that runs ahead of it costs a
counted stale hit, never wrong rows.

Blocks loaded from a tier (`on_loaded`, from the connector's
``update_state_after_alloc``) are stamped in the mirror when vLLM allocates
them, in the step whose plan orders their load: the worker loads them in
that step's ``start_load_kv``, before the forward pass and before the step's
reads, so by the time any request reads them (the loading request itself, or
one scheduled later in the same step or after) the worker holds them. They
extend the loading request's hit in the plan (local hit, then loaded blocks).
A load the worker could not serve whole loads nothing: vLLM learns its block
ids after the step (``get_block_ids_with_load_errors``) and recomputes the
request from the first of them; `on_load_failed` then clears those blocks'
stamps here and, through the next plan, in the worker (which never stamped
them). A request that read such a block in the same step finds no stamp: a
counted stale hit, never wrong rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.manager import OmniKVCacheManager
from omnicache.integrations.vllm.step_plan import (
    LoadOrder,
    PlannedRequest,
    StepPlan,
    block_ids_of,
)
from omnicache.store import HIDDEN_STATES

__all__ = ["StoreMirror"]


@dataclass(slots=True)
class _Allocation:
    """Slots vLLM gave a request in the step being scheduled."""

    start: int
    num_new: int
    block_ids: tuple[int, ...]
    block_keys: dict[int, BlockHash]


class StoreMirror:
    """Mirrors the worker's stamps in ``manager``'s store and plans each step.

    Registers a one-byte `HIDDEN_STATES` entry in the manager's store (from
    then on the manager caps hits to its stamps) and listens to the manager.
    """

    def __init__(self, manager: OmniKVCacheManager) -> None:
        if not isinstance(manager, OmniKVCacheManager):
            raise TypeError(
                f"manager: expected an OmniKVCacheManager, found {type(manager).__name__}"
            )
        manager.store.register(HIDDEN_STATES, 1, torch.uint8)
        self._manager = manager
        self._block_size = manager.store.block_size
        self._allocated: dict[str, _Allocation] = {}
        # Request id -> what the step loads for it from a tier.
        self._loaded: dict[str, LoadOrder] = {}
        self._cleared: dict[int, None] = {}
        self._reset = False
        manager.add_listener(self)

    # -- the manager's listener -------------------------------------------------------

    def on_allocated(
        self,
        request_id: str,
        start: int,
        slots: npt.NDArray[np.int64],
        block_keys: dict[int, BlockHash],
    ) -> None:
        store = self._manager.store
        store.write(
            HIDDEN_STATES,
            torch.ones((len(slots), 1), dtype=torch.uint8),
            slots,
            block_keys=block_keys,
        )
        block_ids = block_ids_of(slots, self._block_size)
        prior = self._allocated.get(request_id)
        if prior is not None:
            # NOTE: two allocations in one step cannot both be the step's
            # rows: start -1 never matches, so both are undone at planning.
            block_ids = prior.block_ids + block_ids
            start = -1
        self._allocated[request_id] = _Allocation(start, len(slots), block_ids, block_keys)

    def on_cleared(self, block_id: int | None) -> None:
        if block_id is None:
            self._reset = True
            self._cleared.clear()
        else:
            self._cleared[block_id] = None

    def on_loaded(
        self,
        request_id: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        values: Sequence[tuple[bytes, ...]],
    ) -> None:
        """Stamps blocks the worker will load from a tier in this step (see the module).

        ``values``: per block, its tier values, which the plan carries to the worker.
        """
        if not len(block_ids) == len(block_keys) == len(values):
            raise ValueError(
                f"block_keys, values: expected {len(block_ids)} of each (one per block), "
                f"found {len(block_keys)} and {len(values)}"
            )
        self._manager.store.write_blocks(
            HIDDEN_STATES,
            torch.ones((len(block_ids) * self._block_size, 1), dtype=torch.uint8),
            list(block_ids),
            block_keys=list(block_keys),
        )
        self._loaded[request_id] = LoadOrder(
            request_id, tuple(block_ids), tuple(block_keys), tuple(values)
        )

    def on_load_failed(self, block_ids: Iterable[int]) -> None:
        """Clears the stamps of blocks whose load (or computation over it) failed."""
        ids = list(dict.fromkeys(block_ids))
        if not ids:
            return
        self._manager.store.invalidate(ids)
        for block_id in ids:
            self._cleared[block_id] = None

    # -- planning -------------------------------------------------------------------

    def plan(
        self,
        scheduled: Iterable[tuple[str, int, int]],
        prompt_requests: Mapping[str, int],
        finished_req_ids: Iterable[str],
    ) -> StepPlan:
        """The step's plan, from its ``(request id, start, num_new)`` as vLLM scheduled them.

        Allocations that do not match what was scheduled are undone: their
        blocks lose their stamps here, and in the worker's store after the
        step's writes.
        """
        requests: list[PlannedRequest] = []
        loads: list[LoadOrder] = []
        block_keys: dict[int, BlockHash] = {}
        undone: dict[int, None] = {}
        for req_id, start, num_new in scheduled:
            allocation = self._allocated.pop(req_id, None)
            load = self._loaded.pop(req_id, None)
            if load is not None:
                # NOTE: a scheduled request's external tokens count as
                # computed in vLLM: their KV is loaded whatever the rows' plan.
                loads.append(load)
            if allocation is None or (allocation.start, allocation.num_new) != (start, num_new):
                if allocation is not None:
                    undone.update(dict.fromkeys(allocation.block_ids))
                requests.append(PlannedRequest(req_id, start, num_new))
                continue
            hit_ids, hit_keys = self._manager.hit_blocks(req_id)
            if load is not None:
                hit_ids, hit_keys = hit_ids + load.block_ids, hit_keys + load.block_keys
            if start != len(hit_ids) * self._block_size:
                hit_ids, hit_keys = (), ()
            requests.append(
                PlannedRequest(req_id, start, num_new, allocation.block_ids, hit_ids, hit_keys)
            )
            block_keys.update(allocation.block_keys)
        for allocation in self._allocated.values():
            undone.update(dict.fromkeys(allocation.block_ids))
        for unscheduled in self._loaded.values():
            undone.update(dict.fromkeys(unscheduled.block_ids))
        if undone:
            self._manager.store.invalidate(list(undone))
        plan = StepPlan(
            caching=True,
            requests=tuple(requests),
            block_keys=block_keys,
            prompt_requests=dict(prompt_requests),
            cleared_block_ids=tuple(self._cleared),
            reset=self._reset,
            invalidated_block_ids=tuple(undone),
            finished_req_ids=tuple(finished_req_ids),
            loads=tuple(loads),
        )
        self._allocated.clear()
        self._loaded.clear()
        self._cleared.clear()
        self._reset = False
        return plan
