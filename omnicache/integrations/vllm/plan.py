"""The one message between omnicache's two processes: `StepPlan`, and the sides that make it.

The engine core builds one `StepPlan` per step (`mirror.StoreMirror`, the
scheduler side) and vLLM carries it to the worker's process inside the
step's ``SchedulerOutput`` (``kv_connector_metadata``, through
`connector.OmniStoreConnector`, which does nothing else); the worker
(`live_store.LiveStore`) writes the step's hidden states by it. The connector
knows each side only by the small protocol it calls (`SchedulerSide`,
`WorkerSide`), bound by the scheduler and the worker at start. Plain data
and protocols: no vLLM, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.common import wants_hidden_states

__all__ = [
    "LoadOrder",
    "PlannedRequest",
    "SchedulerSide",
    "StepPlan",
    "WorkerSide",
]

REQUEST_ID_PARAM = "omnicache_request_id"
"""The ``kv_transfer_params`` key of the engine core's id of a request that asked."""
RESULT_KEY_PARAM = "omnicache_result_key"
"""The ``kv_transfer_params`` key of the secret that takes a request's prompt result."""
NUM_POSITIONS_PARAM = "omnicache_num_positions"
"""The ``kv_transfer_params`` key of the rows a request that asked for every position's hidden
states gets: its tokens but the last, as the engine ended it."""
EXTERNAL_TOKENS_PARAM = "omnicache_external_tokens"
"""The ``kv_transfer_params`` key of the tokens a request's first admission loaded from the tier."""

MAX_STAGED_STEPS = 256
"""The most steps whose rows wait to be written together (the worker's `LiveStore`).

A write's cost is mostly its fixed part (about 1 ms on a 2-core host for 4
to 256 rows), so fewer, larger writes; ``max_staged_bytes`` bounds the
memory the staged rows take (beside the model, on its device). Both sides
count on it: rows staged from a plan this many plans before a steady decode
step that clears blocks are written before its clears, so the scheduler
lets such a step clear blocks that no later plan wrote rows to
(`StepPlan.decode`).
"""

_LOG = logging.getLogger(__name__)
_NO_REQUESTS: frozenset[str] = frozenset()


@dataclass(slots=True)
class PlannedRequest:
    """One scheduled request's part of a step.

    Built by the scheduler and never changed after (as `StepPlan`). Not a
    frozen dataclass: the scheduler builds one a request every step, and a
    frozen one sets each field through ``object.__setattr__``, several
    times the cost (benchmarks/bench_vllm_wrapper.py pins the plan's cost).
    """

    req_id: str
    # Position of the first token the step computes for the request.
    start: int
    num_new: int
    # The blocks holding tokens ``start .. start + num_new - 1``, in order; empty
    # when the scheduler could not confirm them (the rows are then written
    # without keys, so no block they touch keeps a stamp).
    block_ids: tuple[int, ...] = ()
    # The request's prefix hit, given in the step that starts right after it
    # (``start == len(hit_block_ids) * block_size``), otherwise empty.
    hit_block_ids: tuple[int, ...] = ()
    hit_block_keys: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Blocks of one waiting request for the worker to fill from a tier (values not included).

    The request is not in the step: vLLM holds it until the worker reports
    the load done (``get_finished``), with the blocks that did not load.
    """

    req_id: str
    block_ids: tuple[int, ...]
    block_keys: tuple[BlockHash, ...]


@dataclass(slots=True)
class StepPlan:
    """One step of the scheduler, as the worker's store needs it.

    Built by the scheduler and never changed after: a worker may keep one
    (`LiveStore` stages steps by their plans). Not frozen, as
    `PlannedRequest`.

    The worker applies a plan in this order: ``reset`` and
    ``cleared_block_ids`` (blocks vLLM handed out again or dropped the key
    of), ``loads`` (blocks of requests the step does not compute), the step's rows (stamping the
    full blocks of ``block_keys`` they complete), ``invalidated_block_ids``
    (allocations the scheduler did not schedule after all), then the reads
    of hits.
    """

    # Prefix caching on: rows are written into the store and hits read from it.
    caching: bool
    requests: tuple[PlannedRequest, ...] = ()
    # Block id -> key, for the full blocks the step's rows touch.
    block_keys: Mapping[int, BlockHash] = field(default_factory=dict)
    # Requests new to the worker that asked for their prompt's hidden states:
    # request id -> number of prompt tokens.
    prompt_requests: Mapping[str, int] = field(default_factory=dict)
    # Those of them that asked for every position's hidden states (prompt and
    # generated): their rows are gathered until they finish.
    sequence_requests: frozenset[str] = frozenset()
    # The secret that takes each of their results (the connector's, given
    # back to the caller with the request's id): request id -> key.
    result_keys: Mapping[str, str] = field(default_factory=dict)
    cleared_block_ids: tuple[int, ...] = ()
    reset: bool = False
    invalidated_block_ids: tuple[int, ...] = ()
    # Requests that finished (or were aborted) since the previous step.
    finished_req_ids: tuple[str, ...] = ()
    # Blocks of waiting requests to fill from a tier (each then part of its
    # request's hit, in the step that first schedules it).
    loads: tuple[LoadOrder, ...] = ()
    # A steady decode step (`mirror.StoreMirror` marks them): every request
    # computes one token in its one planned block, none has a hit, the plan
    # resets, invalidates, loads and asks for nothing, and it clears only
    # blocks that no plan of the `MAX_STAGED_STEPS` before it (``number``)
    # wrote rows to. The worker stages such a step by its plan without
    # reading its requests (`staged_steps.StagedSteps`): right after the forward
    # pass, reading them took a quarter of what the worker's store did for a
    # decode step. Rows it still holds staged are in none of the cleared
    # blocks but those of plans that old, which it writes first. The
    # plan-wide conditions are checked here, the requests' when the worker
    # reads them.
    decode: bool = False
    # The scheduler's count of the plans before this one (`mirror.StoreMirror`;
    # 0 for a plan made otherwise).
    number: int = 0

    def __post_init__(self) -> None:
        if self.decode and (
            not self.caching
            or not self.requests
            or self.prompt_requests
            or self.reset
            or self.invalidated_block_ids
            or self.loads
        ):
            raise ValueError(
                "decode: expected a cached step of requests that resets, invalidates, "
                f"loads and asks for nothing, found caching={self.caching}, "
                f"{len(self.requests)} requests, prompt_requests={sorted(self.prompt_requests)}, "
                f"reset={self.reset}, invalidated_block_ids={self.invalidated_block_ids}, "
                f"{len(self.loads)} loads"
            )


def batch_requests(plan: StepPlan, batch_order: Sequence[str]) -> list[PlannedRequest]:
    """The plan's requests in the order of a step's rows (the model runner's batch order).

    Raises:
        RuntimeError: the rows are not those of the planned requests, each once.
    """
    by_id = {item.req_id: item for item in plan.requests}
    batch = [by_id.get(req_id) for req_id in batch_order]
    if len(batch) != len(by_id) or len(set(batch_order)) != len(by_id) or None in batch:
        raise RuntimeError(
            f"step: expected rows of the planned requests {sorted(by_id)}, found rows of "
            f"{sorted(batch_order)}"
        )
    return batch  # type: ignore[return-value]


def planned_slots(requests: Sequence[PlannedRequest], block_size: int) -> list[int] | None:
    """The slots of the step's rows, request after request; None if any request lacks blocks.

    NOTE: Python ints, a range a block: a worker computes them right after
    the forward pass, where each of numpy's calls is cold and costs more
    than a step's few blocks of slots.
    """
    slots: list[int] = []
    for item in requests:
        position, end = item.start, item.start + item.num_new
        if position == end:
            continue
        block_ids = item.block_ids
        first = position // block_size
        while position < end:
            block = position // block_size
            if block - first >= len(block_ids):
                return None
            stop = min(end, (block + 1) * block_size)
            base = (block_ids[block - first] - block) * block_size
            slots.extend(range(base + position, base + stop))
            position = stop
    return slots


def asks(req_id: str, sampling_params: Any) -> str | None:
    """`wants_hidden_states`, where a bad value is logged and taken as none.

    NOTE: the front end refuses a bad value before the request gets here
    (`omnicache.integrations.vllm.frontend`); one that comes another way
    (vLLM's plugins limited by ``VLLM_PLUGINS``) must not stop the engine.
    """
    try:
        return wants_hidden_states(sampling_params)
    except ValueError as error:
        _LOG.warning("request %s: %s; its hidden states are not kept", req_id, error)
        return None


def scheduled(scheduler_output: Any) -> Iterator[tuple[str, int, int]]:
    """``(request id, first position, tokens)`` of each request a ``SchedulerOutput`` computes."""
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.num_computed_tokens, counts[new.req_id]
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        yield req_id, start, counts[req_id]


def prompt_requests(scheduler_output: Any) -> tuple[dict[str, int], frozenset[str]]:
    """The step's new requests that ask for hidden states.

    Returns:
        Request id -> prompt tokens, of every one that asks; and the ids of
        those that ask for every position's (`StepPlan.sequence_requests`).
    """
    prompts: dict[str, int] = {}
    if not scheduler_output.scheduled_new_reqs:
        return prompts, _NO_REQUESTS
    sequences: set[str] = set()
    for new in scheduler_output.scheduled_new_reqs:
        kind = asks(new.req_id, new.sampling_params)
        if kind is not None:
            prompts[new.req_id] = new.prompt_len
        if kind == "all":
            sequences.add(new.req_id)
    return prompts, frozenset(sequences)


def uncached_plan(scheduler_output: Any) -> StepPlan:
    """The plan of a step without prefix caching: every request's rows, nothing stamped."""
    prompts, sequences = prompt_requests(scheduler_output)
    return StepPlan(
        caching=False,
        requests=tuple(PlannedRequest(*item) for item in scheduled(scheduler_output)),
        prompt_requests=prompts,
        sequence_requests=sequences,
        finished_req_ids=tuple(sorted(scheduler_output.finished_req_ids)),
    )


class SchedulerSide(Protocol):
    """What the connector's scheduler side hands to omnicache's scheduler (`StoreMirror`)."""

    def step_plan(self, scheduler_output: Any) -> StepPlan:
        """The step's plan (``build_connector_meta``)."""
        ...

    def num_external_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens after vLLM's local hit the tier holds (``get_num_new_matched_tokens``)."""
        ...

    def on_external_allocated(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """vLLM gave the external tokens blocks (``update_state_after_alloc``)."""
        ...

    def on_loads_done(self, req_ids: Iterable[str], failed_block_ids: Iterable[int]) -> None:
        """The worker finished these requests' loads, these blocks not loaded
        (``update_connector_output``)."""
        ...

    def finished(self, request: Any) -> tuple[bool, dict[str, Any]]:
        """Whether a load still holds the request's blocks, and its ``kv_transfer_params``
        besides its id (``request_finished``)."""
        ...

    def close(self) -> None: ...


class WorkerSide(Protocol):
    """What the connector's worker side hands to omnicache's worker (`live_store.LiveStore`)."""

    def start_step(self, plan: StepPlan) -> set[int]:
        """Clears stamps, then runs the plan's loads; the blocks that did not load.

        Called by the connector in a step with loads, where vLLM starts
        them: before its forward pass when the step has a synchronous load,
        otherwise after it, once the step's rows are applied (omnicache's
        loads are asynchronous). Either way the stamps are cleared first (by
        whichever of the two begins the step; applying the step's rows
        begins every step, one without loads too), and the loads fill blocks
        of waiting requests, which the step's rows never touch.
        """
        ...

    def close(self) -> None: ...
