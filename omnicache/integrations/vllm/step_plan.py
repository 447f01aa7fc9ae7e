"""What the scheduler tells the worker about one step: `StepPlan`, and the slots it implies.

The scheduler's process builds one `StepPlan` per step (`connector`) and vLLM
carries it to the worker's process inside the step's ``SchedulerOutput``
(``kv_connector_metadata``). The worker (`live_store`) writes the step's
hidden states by it. Plain data: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from omnicache.block_hash import BlockHash

__all__ = ["LoadOrder", "PlannedRequest", "StepPlan", "block_ids_of", "planned_slots"]


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One scheduled request's part of a step."""

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
    """Blocks of one request to fill from a tier before the step's forward pass."""

    req_id: str
    block_ids: tuple[int, ...]
    block_keys: tuple[BlockHash, ...]
    # Per block, its tier values (one per tier entry, in the entries' order),
    # fetched and verified by the scheduler.
    values: tuple[tuple[bytes, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step of the scheduler, as the worker's store needs it.

    The worker applies a plan in this order: ``reset`` and
    ``cleared_block_ids`` (blocks vLLM handed out again or dropped the key
    of), ``loads`` (before the forward pass), the step's rows (stamping the
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
    cleared_block_ids: tuple[int, ...] = ()
    reset: bool = False
    invalidated_block_ids: tuple[int, ...] = ()
    # Requests that finished (or were aborted) since the previous step.
    finished_req_ids: tuple[str, ...] = ()
    # Blocks to fill from a tier before the forward pass (each also part of
    # its request's hit).
    loads: tuple[LoadOrder, ...] = ()


def block_ids_of(slots: npt.NDArray[np.int64], block_size: int) -> tuple[int, ...]:
    """The blocks a run of a request's slots passes through, in order."""
    if not len(slots):
        return ()
    ids = slots // block_size
    first = np.concatenate(([True], ids[1:] != ids[:-1]))
    return tuple(int(block_id) for block_id in ids[first])


def planned_slots(
    requests: Sequence[PlannedRequest], block_size: int
) -> npt.NDArray[np.int64] | None:
    """The slots of the step's rows, request after request; None if any request lacks blocks."""
    parts: list[npt.NDArray[np.int64]] = []
    for item in requests:
        if item.num_new == 0:
            continue
        if not item.block_ids:
            return None
        positions = np.arange(item.start, item.start + item.num_new, dtype=np.int64)
        ids = np.asarray(item.block_ids, dtype=np.int64)
        index = positions // block_size - item.start // block_size
        if index[-1] >= len(ids):
            return None
        parts.append(ids[index] * block_size + positions % block_size)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
