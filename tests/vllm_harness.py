"""An engine's two sides without an engine: vLLM's manager under omnicache, and the worker's store.

`EngineHarness` drives vLLM's real ``KVCacheManager`` (scheduler side, CPU)
wrapped in `OmniKVCacheManager`, with the `StoreMirror` a live engine's
scheduler binds to the connector, and a worker's `LiveStore`, the way a live
engine does each step: the scheduler looks up and allocates, the mirror
plans the step, the worker starts it (clears, loads), then applies the
step's rows at the slots of the requests' block tables. The rows come from
the test (a deterministic stand-in for the model), and every request asks
for its prompt's hidden states, so a test reads back what a caller of the
engine would get.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from omnicache.integrations.vllm import OmniKVCacheManager
from omnicache.store import TensorStore

Rows = Callable[[Any], torch.Tensor]
"""A request's hidden states at every position, as a model computes them from scratch."""


class EngineHarness:
    """One engine's scheduler side and worker side, stepped by hand.

    Args:
        manager: vLLM's manager, with prefix caching.
        rows: the stand-in model.
        hidden_size: the rows' width.
        kv_cache_group_id: the group the rows follow (None: the first full one).
        max_results: prompt results the worker keeps.
    """

    def __init__(
        self,
        manager: Any,
        rows: Rows,
        hidden_size: int,
        *,
        kv_cache_group_id: int | None = None,
        max_results: int = 64,
    ) -> None:
        # NOTE: the worker's module imports vLLM; this module must import without it.
        from omnicache.integrations.vllm.live_store import LiveStore

        self.manager = manager
        self.rows = rows
        self.wrapper = OmniKVCacheManager(manager, kv_cache_group_id=kv_cache_group_id)
        self.mirror = self.wrapper.attach_mirror()
        block_size = self.wrapper.group.block_size
        self.store = TensorStore(
            manager.block_pool.num_gpu_blocks,
            block_size,
            hidden_size=hidden_size,
            hidden_dtype=torch.float32,
        )
        self.live = LiveStore(self.store, max_results=max_results)
        # Requests scheduled before (a first step is a new request's, which asks).
        self._seen: set[str] = set()
        self._finished: list[str] = []

    @property
    def block_size(self) -> int:
        return self.wrapper.group.block_size

    def admit(self, request: Any, num_new: int | None = None) -> int:
        """vLLM's lookup and an allocation of ``num_new`` tokens (all the rest by default).

        Returns the tokens of the hit the request adopts.
        """
        blocks, num_hit, _ = self.wrapper.get_computed_blocks(request)
        count = request.num_tokens - num_hit if num_new is None else num_new
        allocated = self.wrapper.allocate_slots(request, count, num_hit, blocks)
        assert allocated is not None
        request.num_computed_tokens = int(num_hit)
        return int(num_hit)

    def step(self, scheduled: Sequence[tuple[Any, int]], *, flush: bool = True) -> dict[int, Any]:
        """One step computing ``num_new`` tokens of each request, from its computed tokens on.

        Each request's slots must have been allocated (`admit`, or
        ``wrapper.allocate_slots``). With ``flush``, the worker's staged
        rows are then written, as a caller between steps has them written
        (the engine's ``omni_live_store_stats``), for a test that reads the
        store between steps. Returns the blocks the step stamped.
        """
        items = [
            (request.request_id, request.num_computed_tokens, num_new)
            for request, num_new in scheduled
        ]
        prompts = {
            request.request_id: request.num_prompt_tokens
            for request, _ in scheduled
            if request.request_id not in self._seen
        }
        self._seen.update(prompts)
        # NOTE: the connector gives each result its key; here the request's id.
        plan = replace(
            self.mirror.plan(items, prompts, self._finished), result_keys={r: r for r in prompts}
        )
        self._finished = []
        self.live.start_step(plan)
        parts: list[torch.Tensor] = []
        slots: list[np.ndarray] = []
        for (request, num_new), (_rid, start, _) in zip(scheduled, items, strict=True):
            parts.append(self.rows(request)[start : start + num_new])
            slots.append(self._slots(request.request_id, start, num_new))
        # NOTE: a step without requests runs no forward pass. As the worker's
        # capture does, a steady decode step's slot values are read first.
        mapping = torch.from_numpy(np.concatenate(slots)) if slots else None
        values = None if mapping is None else self.live.decode_slot_values(plan, mapping)
        stamped = self.live.apply(
            plan,
            [rid for rid, _, _ in items],
            torch.cat(parts) if parts else None,
            mapping,
            slot_values=values,
        )
        if flush:
            stamped.update(self.live.flush())
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
        return stamped

    def finish(self, request: Any, status: Any = None) -> None:
        """Frees the request as the scheduler does; the worker hears of it in the next plan."""
        from vllm.v1.request import RequestStatus

        request.status = RequestStatus.FINISHED_STOPPED if status is None else status
        self.wrapper.free(request)
        self._finished.append(request.request_id)

    def take(self, request_id: str) -> torch.Tensor | None:
        """The request's prompt hidden states from the worker (None: its hit was stale).

        Raises:
            KeyError: the worker has no result for it (taken, or incomplete).
        """
        found = self.live.results.take({request_id: request_id})[request_id]
        assert not isinstance(found, int)  # no size limit asked
        return found

    def run(self, request: Any) -> tuple[int, list[int], torch.Tensor | None]:
        """Admit, compute the rest in one step, finish: the hit, block table and prompt rows."""
        num_hit = self.admit(request)
        block_ids = self.wrapper.request_block_ids(request.request_id)
        self.step([(request, request.num_tokens - num_hit)])
        self.finish(request)
        return num_hit, block_ids, self.take(request.request_id)

    def _slots(self, request_id: str, start: int, num_new: int) -> np.ndarray:
        """The KV cache slots of the request's tokens, as vLLM's slot mapping has them."""
        ids = np.asarray(self.wrapper.request_block_ids(request_id), dtype=np.int64)
        positions = np.arange(start, start + num_new, dtype=np.int64)
        size = self.block_size
        return ids[positions // size] * size + positions % size
