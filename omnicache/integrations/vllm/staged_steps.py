"""Steps whose rows wait to be written: which steps, what they keep, and their write.

`LiveStore` applies a step's rows right after the forward pass; writing
them there costs a write's fixed part every step (most of a small write's
cost), and on a GPU reading the step's slots would wait for the forward
pass. So a step's rows may wait (`staged_slots`): those of a step that
neither loads nor invalidates, whose hits (verified and read at once) are
in no block a staged step or the step itself writes.

A steady decode step (`StepPlan.decode`: one token of each request in its
planned block, no hit, nothing loaded or asked, and only blocks cleared
that no plan of the `MAX_STAGED_STEPS` before it wrote rows to) is staged
by its plan alone: its slots and blocks are found later (`StagedSteps.resolve`),
in one loop over every such step, before anything reads the staged steps
(a step that is not one, or their write), by `staged_slots` as any staged
step's: in one loop, later, reading a step's requests costs a fraction
of what it costs right after its forward pass, when the host's caches are
cold (benchmarks/bench_live_store.py pins a decode step's cost). Such a step
that clears blocks writes first only the rows staged from plans that old
(`StagedSteps.holds_plan_up_to`): no later staged step wrote to its cleared
blocks, and the staged decode steps are not resolved for it.
A step whose rows turn out not to be its plan's requests is refused then,
after the steps before it are written. On the CPU, once the staged rows
are the model's own, such a step is checked before its forward pass and
only staged after it (`LiveStore.decode_slot_values`): the count of its
rows and where they are, as every staged step's, are checked in one loop
when the staged steps are taken to be written (`StagedSteps.take`).

What a staged step keeps (`StagedSteps`): on a device (a GPU), a copy of its
rows and of its slot mapping, made there (no value of either is read: the
step never waits for the forward pass); on the CPU, where reading waits for
nothing, its slots' values and the model's rows themselves (`LiveStore`'s
``copy_steps``; a model that writes a step's rows where a staged step's are
is refused before anything writes them, `StagedSteps.fresh_rows`).

They wait until a step that loads, invalidates, or reads or clears a block
holding staged rows (a steady decode step's clears: rows of plans
`MAX_STAGED_STEPS` before it or older), or until `MAX_STAGED_STEPS` of
them wait or one more step's rows would take more than
``max_staged_bytes`` (a step whose rows alone would is written at once,
and so is one of more than `MAX_HOST_STEP_BYTES` on the CPU). Then they
are written first (`write_staged`), so whatever reads the store finds
what writing each step would have left: the staged slots are compared
with the plans' (a device's read then, once); if every step's match, the
rows are written with the plans' keys in a few writes (`_groups`: runs of
decode steps request by request, the steps between them step after step);
otherwise step by step, in order, a step at other slots than planned
without keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple, cast

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int
from omnicache.integrations.vllm.plan import (
    MAX_STAGED_STEPS,
    StepPlan,
    batch_requests,
    planned_slots,
)
from omnicache.store import HIDDEN_STATES, TensorStore

__all__ = [
    "MAX_STAGED_BYTES",
    "StagedSteps",
    "default_max_staged_bytes",
]

MAX_STAGED_BYTES = 32 * 2**20
"""`LiveStore`'s default ``max_staged_bytes``."""
STAGED_BUDGET_SHARE = 16
"""A vLLM worker's default ``max_staged_bytes`` is at most 1/16 of its KV cache budget."""
MAX_HOST_STEP_BYTES = 2**20
"""The largest step, in bytes of its rows, whose rows wait to be written on the CPU.

On the CPU reading a step's slots waits for nothing: a step's rows wait
only to share a write's fixed part (small steps: decode batches, short
chunks). A larger step's rows cost more in the larger write they join
(concatenated with the steps' around them): in the engine, staging prefill
steps of 7.5 MiB doubled the store's share of them (0.36% to 0.73%, with
copies of the staged rows, `benchmarks/bench_live_store.py`).
"""
MAX_FLUSH_WRITES = 4
"""The most writes the staged steps' rows take (`_groups`); with more runs, one write."""


def default_max_staged_bytes(budget: int) -> int:
    """The default bound on the staged steps' rows of a worker given ``budget`` bytes.

    `MAX_STAGED_BYTES`, or a `STAGED_BUDGET_SHARE`-th of the budget if less:
    the rows come out of the budget (the worker's
    ``determine_available_memory``), and a small one keeps most of it.
    """
    check_int("budget", budget, minimum=0)
    return min(MAX_STAGED_BYTES, budget // STAGED_BUDGET_SHARE)


def staged_slots(
    plan: StepPlan, batch_order: Sequence[str] | None, block_size: int, staged_blocks: set[int]
) -> tuple[list[int], list[int], bool] | None:
    """The rows' planned slots, blocks and whether the step has hits, when its rows may wait.

    Such a step writes new tokens of each request (a prefill chunk or a
    decode token) in planned blocks, rows of the planned requests;
    loads nothing, invalidates nothing, resets nothing (it may clear
    stamps of blocks handed out again, gather prompts' rows and finish
    requests); and its hits are in no block that a staged step or the
    step itself writes, so they are verified and read at once. The next
    step that reads a block holding staged rows, clears one, loads or
    invalidates writes the waiting rows first (`LiveStore.begin`), so
    whatever reads the store finds what writing every step at once would
    have left. Their rows are written together (`write_staged`). The answer
    depends on the plan and the staged steps only: the same on every rank.

    Args:
        plan: the step's plan.
        batch_order: the rows' request ids (None: the slots in the plan's order).
        block_size: tokens per block.
        staged_blocks: the blocks of the staged steps' rows (`StagedSteps.blocks`).

    Returns:
        The slots in the rows' order, the blocks they are in, and whether
        any request has a hit; None if the step's rows are written now.
    """
    requests = plan.requests
    if not (plan.caching and requests) or (plan.reset or plan.invalidated_block_ids or plan.loads):
        return None
    if batch_order is not None and len(batch_order) != len(requests):
        return None
    bs = block_size
    ids: list[str] = []
    blocks: list[int] = []
    slots: list[int] = []
    hits: list[int] = []
    for item in requests:
        block_ids = item.block_ids
        if not block_ids:
            return None
        if item.hit_block_ids:
            hits.extend(item.hit_block_ids)
        ids.append(item.req_id)
        if item.num_new == 1:
            # NOTE: a decode token, the common case, without a call.
            block = block_ids[0]
            blocks.append(block)
            slots.append(block * bs + item.start % bs)
            continue
        own = planned_slots((item,), bs)
        if not own:
            return None
        blocks.extend(block_ids)
        slots.extend(own)
    if hits and not (staged_blocks.isdisjoint(hits) and set(blocks).isdisjoint(hits)):
        return None
    if batch_order is None or ids == batch_order:
        return slots, blocks, bool(hits)
    # NOTE: the model runner's batch order is not the scheduler's once a
    # request left the batch.
    span: dict[str, tuple[int, int]] = {}
    end = 0
    for item in requests:
        span[item.req_id] = (end, end + item.num_new)
        end += item.num_new
    if len(span) != len(batch_order) or span.keys() != set(batch_order):
        return None
    ordered = [slot for req_id in batch_order for slot in slots[slice(*span[req_id])]]
    return ordered, blocks, bool(hits)


# A step whose rows wait to be written (`StagedSteps.steps`): its rows (a
# copy made on their device; on the CPU the model's own; None in a
# follower's store) and its slot mapping (a copy made on its device; on the
# CPU its values); its planned slots in the rows' order, its plan's keys, the
# rows' request ids and its plan's number (`StepPlan.number`). NOTE: a tuple:
# right after the forward pass, the host's every kind of work is cold, a
# class's constructor one more.
_StagedStep = tuple[
    torch.Tensor | None,
    torch.Tensor | list[int],
    list[int],
    Mapping[int, BlockHash],
    Sequence[str],
    int,
]


# A steady decode step staged by its plan (`StepPlan.decode`): its rows and
# slot mapping as a `_StagedStep`'s, its plan and the rows' request ids. Its
# slots and blocks are found when it is resolved (`StagedSteps.resolve`).
_DecodeStep = tuple[torch.Tensor | None, torch.Tensor | list[int], StepPlan, Sequence[str]]


@dataclass(slots=True, eq=False)
class StagedSteps:
    """The steps whose rows wait to be written (`LiveStore` stages them), their bound and
    their write rule.

    The write rule, stated here once: the staged rows are written before a
    step whose rows would take them past ``max_bytes`` is staged
    (`write_before`), and once `MAX_STAGED_STEPS` steps wait
    (`write_after`); `writes_with` is both, for a step about to be staged.
    A step is staged at all only within ``max_bytes`` and, on the CPU,
    `MAX_HOST_STEP_BYTES` (`admits`). (Their other reasons to be written,
    which the plans give, are `LiveStore.begin`'s.)

    ``steps``: in order, each with its planned slots; ``decode``: the steady
    decode steps staged after them by their plans alone (`StepPlan.decode`),
    whose slots `resolve` finds later, in one loop over all of them, before
    anything reads ``steps`` or ``blocks``: right after a forward pass,
    reading a step's requests costs several times what it does in a loop
    over many steps.
    ``nbytes``: the bytes of the model's rows they stand for (counted alike
    on every rank; rows kept without a copy hold their step's padding rows
    too, which vLLM's CPU backend does not add; a follower's decode step
    keeps the model's rows until written, for their count); ``blocks``: the
    blocks of the planned slots of ``steps``.
    """

    block_size: int
    # The most bytes of the model's rows the staged steps take (0: none waits).
    max_bytes: int = MAX_STAGED_BYTES
    steps: list[_StagedStep] = field(default_factory=list)
    decode: list[_DecodeStep] = field(default_factory=list)
    nbytes: int = 0
    blocks: set[int] = field(default_factory=set)

    def admits(self, nbytes: int, on_cpu: bool) -> bool:
        """Whether a step of ``nbytes`` (its model's rows) may wait at all (the write rule)."""
        return nbytes <= self.max_bytes and (nbytes <= MAX_HOST_STEP_BYTES or not on_cpu)

    def write_before(self, nbytes: int) -> bool:
        """Whether the staged rows are written before a step of ``nbytes`` joins them."""
        return self.nbytes + nbytes > self.max_bytes

    def write_after(self) -> bool:
        """Whether the staged rows are written now that a step joined them."""
        return len(self.steps) + len(self.decode) >= MAX_STAGED_STEPS

    def writes_with(self, nbytes: int) -> bool:
        """Whether staging a step of ``nbytes`` writes the staged rows, before or after it."""
        return (
            self.write_before(nbytes) or len(self.steps) + len(self.decode) + 1 >= MAX_STAGED_STEPS
        )

    def add(
        self,
        rows: torch.Tensor | None,
        mapping: torch.Tensor | list[int],
        planned: tuple[list[int], list[int], bool] | None,
        plan: StepPlan,
        batch_order: Sequence[str],
        nbytes: int,
    ) -> None:
        """Stages a step: with its planned slots and blocks (`staged_slots`), or None for a
        steady decode step staged by its plan alone."""
        if planned is None:
            self.decode.append((rows, mapping, plan, batch_order))
        else:
            self.steps.append(
                (rows, mapping, planned[0], plan.block_keys, batch_order, plan.number)
            )
            # NOTE: kept as steps come, not gathered when asked: with a large
            # batch and small blocks, most decode steps clear blocks.
            self.blocks.update(planned[1])
        self.nbytes += nbytes

    def holds_plan_up_to(self, number: int) -> bool:
        """Whether a staged step's plan is numbered ``number`` or less (`StepPlan.number`).

        The oldest staged step's, in order: the steps are staged as their plans come.
        """
        if self.steps:
            return self.steps[0][5] <= number
        return bool(self.decode) and self.decode[0][2].number <= number

    def holds(self, block_ids: Sequence[int]) -> bool:
        """Whether any of ``block_ids`` holds rows of ``steps`` (at their planned slots)."""
        return bool(block_ids) and not self.blocks.isdisjoint(block_ids)

    def resolve(self) -> None:
        """Turns the decode steps staged by their plans into ``steps``, in order.

        Each step's slots and blocks are `staged_slots`'s, in its rows' order
        (the model runner's batch order), once its requests are seen to be
        decode tokens (`StepPlan.decode` checks the rest of the plan). Its
        rows are left as they are (`take` cuts them).

        Raises:
            RuntimeError: a step's rows are not its plan's requests, or one of
                them is not one new token in one block without a hit. The
                steps before it are in ``steps``; it and those after it are
                dropped, unwritten (the caller writes the steps before it,
                then refuses it, as it would have refused it when computed).
        """
        decode, self.decode = self.decode, []
        bs = self.block_size
        for rows, mapping, plan, order in decode:
            for item in plan.requests:
                if item.num_new != 1 or len(item.block_ids) != 1 or item.hit_block_ids:
                    raise RuntimeError(
                        "decode: expected one new token in one block and no hit for each "
                        f"request of a decode step, found request {item.req_id!r} with "
                        f"{item.num_new} new tokens in blocks {item.block_ids} and "
                        f"{len(item.hit_block_ids)} hit blocks"
                    )
            planned = staged_slots(plan, order, bs, self.blocks)
            if planned is None:
                # NOTE: the one reason left for a decode step: rows of other
                # requests than planned, which this refuses.
                batch_requests(plan, order)
                raise RuntimeError(f"step: expected a decode step's slots, found none: {plan}")
            self.steps.append((rows, mapping, planned[0], plan.block_keys, order, plan.number))
            self.blocks.update(planned[1])

    def take(self, rows: torch.Tensor | None = None) -> list[_StagedStep]:
        """Empties the staged steps, those staged by their plans too; returns ``steps``, in
        order (`resolve` first), once their rows are seen in place (`fresh_rows`, with
        ``rows``: a step's, computed and not yet staged), each cut to its slots.

        A decode step staged as computed (`LiveStore.decode_slot_values`)
        keeps the model's rows, padding included (a follower's too: every
        rank checks their count); their count is checked here, in one loop
        over the steps, rather than right after its forward pass.

        Raises:
            RuntimeError: as `fresh_rows`, or a step has fewer rows than
                slots; the staged steps are dropped, unwritten.
        """
        self.fresh_rows(rows)
        steps = self._empty()
        for index, step in enumerate(steps):
            kept, slots = step[0], step[2]
            if kept is None or kept.shape[0] == len(slots):
                continue
            if kept.shape[0] < len(slots):
                raise RuntimeError(
                    f"step: expected a row for each of a staged step's {len(slots)} slots, "
                    f"found {kept.shape[0]} rows; the {len(steps)} staged steps are dropped, "
                    "unwritten"
                )
            steps[index] = (kept[: len(slots)], *step[1:])
        return steps

    def _empty(self) -> list[_StagedStep]:
        steps = self.steps
        self.steps, self.decode, self.nbytes, self.blocks = [], [], 0, set()
        return steps

    def fresh_rows(self, hidden_states: torch.Tensor | None) -> None:
        """Checks that the staged rows start at as many places as there are steps, and
        ``hidden_states`` (a step's rows, computed and not yet staged, or None) at none of
        them.

        A staged step on the CPU keeps the model's rows without a copy; a
        model that wrote a later step's rows where they are (it reuses its
        output) overwrote them. Checked before anything writes them (`take`,
        with the rows of the step being applied when it writes them first,
        and `LiveStore` before a step written at once), in one loop over the
        steps, rather than as each step is staged, right after its forward
        pass. Copies (a device's, ``copy_steps``) are new memory: never one
        place twice.

        Raises:
            RuntimeError: two staged steps' rows, or ``hidden_states`` and a
                staged step's, start at one place; the staged steps are
                dropped, unwritten, so nothing they held is ever served.
        """
        starts = [
            rows.data_ptr()
            for rows in chain((step[0] for step in self.steps), (step[0] for step in self.decode))
            if rows is not None
        ]
        distinct = set(starts)
        if len(distinct) != len(starts):
            where = "a staged step's"
        elif hidden_states is not None and hidden_states.data_ptr() in distinct:
            where = "this step's"
        else:
            return
        num = len(self.steps) + len(self.decode)
        self._empty()
        raise RuntimeError(
            "step: expected the model's rows of each step in new memory on the CPU (a "
            f"staged step keeps them without a copy), found {where} rows where a "
            f"staged step's are: the model reuses its output; the {num} staged steps' "
            "rows were overwritten and are dropped, unwritten"
        )


class Written(NamedTuple):
    """What `write_staged` did."""

    # Block id -> key of the blocks the rows stamped.
    stamped: dict[int, BlockHash]
    num_rows: int
    # Steps at other slots than planned (written without keys).
    num_slot_mismatches: int


def write_staged(
    store: TensorStore, staged: list[_StagedStep], marks: Callable[[int], torch.Tensor] | None
) -> Written:
    """Writes the rows of ``staged`` steps (taken from a `StagedSteps`, in order).

    ``marks``: a follower's rows (`LiveStore`'s), or None when the steps
    keep the model's rows.

    Every step's rows at their planned slots: a write with every step's
    keys for each run of `_groups` (at most `MAX_FLUSH_WRITES`, else, or
    with a slot planned twice, one write of every step): decode steps of one batch order (the common
    case) request by request (each block's rows then come in order, a
    run of slots), others step after step. Otherwise each step in order, as if
    written when computed: a step at other slots than planned without
    keys (as `LiveStore` writes a step at once).

    Raises:
        IndexError: a step's slot outside the store (nothing is written).
        ValueError: a slot planned twice (nothing is written).
    """
    keys: dict[int, BlockHash] = {}
    for entry in staged:
        keys.update(entry[3])
    planned = list(chain.from_iterable(step[2] for step in staged))
    found: list[int]
    if type(staged[0][1]) is list:
        # The CPU's: every step's values, read when it was staged.
        found = list(chain.from_iterable(cast("list[list[int]]", [s[1] for s in staged])))
    else:
        # NOTE: the one read of a device's staged slots (on a GPU, the one wait).
        mappings = cast("list[torch.Tensor]", [step[1] for step in staged])
        found = torch.cat(mappings).to("cpu", torch.int64).tolist()
    copies = cast("list[torch.Tensor]", [step[0] for step in staged])
    if found == planned:
        groups = _groups(staged)
        if len(groups) > MAX_FLUSH_WRITES or (
            len(groups) > 1 and len(set(planned)) != len(planned)
        ):
            # NOTE: one write refuses a slot given twice before writing anything.
            groups = [(0, len(staged))]
        written: list[int] = []
        for first, stop in groups:
            slots, rows = _group_rows(staged[first:stop], copies[first:stop], marks)
            result = store.write(HIDDEN_STATES, rows, slots, block_keys=keys)
            written.extend(result.stamped_block_ids)
        # NOTE: a later write may have left a block an earlier one stamped.
        stamp = store.stamp_of
        return Written(
            {b: keys[b] for b in written if stamp(HIDDEN_STATES, b) == keys[b]}, len(found), 0
        )
    num_slots = store.num_slots
    by_step: list[list[int]] = []
    offset = 0
    for entry in staged:
        by_step.append(found[offset : offset + len(entry[2])])
        offset += len(entry[2])
    for step, slots in enumerate(by_step):
        if not all(0 <= slot < num_slots for slot in slots):
            # NOTE: before any write: the staged rows are dropped, the store unchanged.
            raise IndexError(
                f"step: expected the forward pass's slots in 0..{num_slots - 1}, found "
                f"{slots} (planned {staged[step][2]}) in staged step {step + 1} of "
                f"{len(staged)}"
            )
    stamped: dict[int, BlockHash] = {}
    mismatches = 0
    for step, slots in enumerate(by_step):
        step_keys = keys
        if slots != staged[step][2]:
            mismatches += 1
            step_keys = {}
        copy = copies[step]
        rows = copy if marks is None else marks(len(slots))
        result = store.write(HIDDEN_STATES, rows, slots, block_keys=step_keys)
        for block_id in result.stamped_block_ids:
            stamped[block_id] = step_keys[block_id]
    # NOTE: a later step's rows without keys may have cleared a stamp.
    stamp_of = store.stamp_of
    kept = {b: key for b, key in stamped.items() if stamp_of(HIDDEN_STATES, b) == key}
    return Written(kept, len(found), mismatches)


def _decode_order(step: _StagedStep) -> Sequence[str] | None:
    """A decode step's batch order (one row a request); None for another step."""
    return step[4] if len(step[2]) == len(step[4]) else None


def _groups(staged: Sequence[_StagedStep]) -> list[tuple[int, int]]:
    """The staged steps in runs, ``[first, stop)``, each one write (`_group_rows`).

    Two or more decode steps in a row of one batch order are a run, written
    request by request: each block's rows come in order, a run of slots.
    The steps between such runs (prefill chunks, mixed batches, a batch
    order of one step) are one run, written step after step.
    """
    groups: list[tuple[int, int]] = []
    last_decode = False
    start, num = 0, len(staged)
    while start < num:
        order = _decode_order(staged[start])
        stop = start + 1
        while stop < num and _decode_order(staged[stop]) == order:
            stop += 1
        decode = order is not None and stop - start >= 2
        if groups and not decode and not last_decode:
            groups[-1] = (groups[-1][0], stop)
        else:
            groups.append((start, stop))
        last_decode = decode
        start = stop
    return groups


def _group_rows(
    group: list[_StagedStep],
    copies: list[torch.Tensor],
    marks: Callable[[int], torch.Tensor] | None,
) -> tuple[list[int], torch.Tensor]:
    """The slots and rows of a run of staged steps (`_groups`), in one write's order."""
    steps, order = len(group), group[0][4]
    num = len(order)
    if steps > 1 and all(_decode_order(step) == order for step in group):
        # One row a request in every step, one batch order: request by request.
        slots = [slot for own in zip(*(step[2] for step in group), strict=True) for slot in own]
        if marks is not None:
            return slots, marks(len(slots))
        return slots, torch.stack(copies, dim=1).view(num * steps, -1)
    slots = list(chain.from_iterable(step[2] for step in group))
    if marks is not None:
        return slots, marks(len(slots))
    return slots, copies[0] if steps == 1 else torch.cat(copies)
