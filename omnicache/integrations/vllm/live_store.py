"""`LiveStore`: a worker's store of hidden states, kept in step with the scheduler's plans.

The worker side the connector hands each step's plan to (`plan.WorkerSide`);
the vLLM worker (`omnicache.integrations.vllm.worker`) builds it once the KV
cache is allocated and applies each step's rows to it right after the
forward pass. It needs torch and the plan, not vLLM: the GPU check runs it
with torch alone.

How `LiveStore` applies a step's plan, in the plan's order:

1. ``reset`` and ``cleared_block_ids``: stamps of blocks vLLM handed out again;
2. ``loads``: blocks filled from the tier (KV and rows, stamped), of
   requests vLLM holds back until the load is done: a load stops at the first
   block gone or damaged, and vLLM recomputes the request from there (vLLM
   starts asynchronous loads, omnicache's, after the forward pass: after
   the step's rows, which are in other blocks, so the order changes nothing);
3. the step's rows, written at the forward pass's own slot mapping (the KV
   cache's slots), stamped with the plan's keys when the slots are those the
   scheduler planned (otherwise written without keys: nothing stamped);
4. ``invalidated_block_ids``;
5. every prefix hit that starts in this step is verified and served
   (`hits.HitReader`: prompt hidden states, prompt logprobs, per-token
   embeddings from the hit's rows); the rows of prompts asked for go to
   the results kept for callers (`prompt_results.PromptResults`).

Writes come before reads because vLLM caches a block as soon as it is
allocated: a request scheduled in the same step as the one computing a block
can hit it, and its rows exist once the step's rows are written.

A step's rows may wait to be written (`staged_steps`: which steps, what they
keep, their write): those of a step that neither loads nor invalidates,
whose hits are in no block a staged step or the step itself writes; a
steady decode step's (`StepPlan.decode`) by its plan alone, its slots found
later. The staged rows are written before anything that reads or clears
their blocks, so whatever reads the store finds what writing each step
would have left.

Under tensor parallelism, ranks but the first keep a follower's store
(`follower_store`): the same stamps, one byte a row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, type_name
from omnicache.integrations.vllm.common import CONNECTOR_NAME
from omnicache.integrations.vllm.hits import HitLogprobs, HitReader
from omnicache.integrations.vllm.kv_tier import WorkerTier
from omnicache.integrations.vllm.plan import (
    MAX_STAGED_STEPS,
    PlannedRequest,
    StepPlan,
    batch_requests,
    planned_slots,
)
from omnicache.integrations.vllm.prompt_results import PromptResults
from omnicache.integrations.vllm.staged_steps import (
    MAX_STAGED_BYTES,
    StagedSteps,
    staged_slots,
    write_staged,
)
from omnicache.store import HIDDEN_STATES, TensorStore

__all__ = [
    "LiveStore",
    "LiveStoreStats",
    "follower_store",
]

FOLLOWER_DTYPE = torch.uint8
"""A follower's store (`follower_store`) keeps one value of this type a row."""


# -- the store of a step's plans ------------------------------------------------------


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
    # Steady decode steps staged by their plans alone (`StepPlan.decode`),
    # counted once their slots are found (when the staged rows are written,
    # or before a step that is not one).
    num_decode_steps: int = 0
    num_prompt_results: int = 0
    num_prompt_failures: int = 0
    # Requests whose hit positions got their outputs from the store (prompt
    # logprobs, per-token embeddings), those positions, and hits that could
    # not be read (their outputs NaN).
    num_scored_requests: int = 0
    num_scored_tokens: int = 0
    num_score_failures: int = 0
    num_results_dropped: int = 0
    num_incomplete_dropped: int = 0
    num_pending_results: int = 0


def follower_store(num_blocks: int, block_size: int) -> TensorStore:
    """The store of a tensor-parallel rank but the first: the same stamps, one byte a row.

    Every rank applies the same plan to the same slots, so a follower's
    stamps equal the first rank's: it verifies the same hits and stamps the
    same blocks for the tier, keeping none of the rows (the first rank's
    store keeps them, and shares a scored hit's rows: `LiveStore`'s ``share``).
    """
    return TensorStore(num_blocks, block_size, hidden_size=1, hidden_dtype=FOLLOWER_DTYPE)


class LiveStore:
    """A worker's store of hidden states, kept in step with the scheduler's plans.

    The connector's worker side (`plan.WorkerSide`): `start_step` before the
    forward pass, then `apply` after it (see the module for the order).

    Args:
        store: a store with the KV cache's number of blocks and block size,
            and a `HIDDEN_STATES` entry.
        max_results: prompt results kept until taken.
        tier: the tier blocks are loaded from and saved to (None: none).
        hit_logprobs: gives the hit positions of requests that ask for prompt
            logprobs or per-token embeddings their outputs, from the hit's
            rows (None: none asks).
        share: under tensor parallelism, the rank group's broadcast from the
            first rank (`LiveStore` on it keeps the rows; on the others, a
            follower's store keeps one byte a row: the same stamps, no rows).
            A step whose hits are scored hands every rank the first rank's
            hit rows through it, since vLLM's vocabulary-parallel LM head
            scores them on every rank. None: one rank.
        keeps_results: whether this store gathers the prompt results callers
            take (only the first rank's does under tensor parallelism: its
            results are the ones taken).
        max_staged_bytes: the most bytes the staged steps' rows take (the
            model's rows, counted alike on every rank; the write rule is
            `StagedSteps`'s; 0: no step waits).
        copy_steps: whether a staged step keeps copies of its rows and slot
            mapping, made on their device, or the model's rows themselves and
            its slots' values (see `_stage`). None: copies of a device's,
            the CPU's themselves.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        max_results: int,
        tier: WorkerTier | None = None,
        hit_logprobs: HitLogprobs | None = None,
        share: Callable[[torch.Tensor], torch.Tensor] | None = None,
        keeps_results: bool = True,
        max_staged_bytes: int = MAX_STAGED_BYTES,
        copy_steps: bool | None = None,
    ) -> None:
        if not isinstance(store, TensorStore):
            raise TypeError(f"store: expected a TensorStore, found {type_name(store)}")
        if HIDDEN_STATES not in store.entries:
            raise ValueError(
                f"store: expected an entry {HIDDEN_STATES!r}, found {sorted(store.entries)}"
            )
        self.keeps_rows = store.entries[HIDDEN_STATES].dtype != FOLLOWER_DTYPE
        if not self.keeps_rows and (share is None or keeps_results):
            raise ValueError(
                "store: a follower's store (one byte a row) expected with a share and without "
                f"results, found share={share!r}, keeps_results={keeps_results!r}"
            )
        self._mark_rows = torch.zeros((0, 1), dtype=FOLLOWER_DTYPE)
        # Steps whose rows wait to be written (`_stage`). And the blocks a
        # write in `begin` stamped (saved to the tier by `apply`).
        self._staged = StagedSteps(
            store.block_size, check_int("max_staged_bytes", max_staged_bytes, minimum=0)
        )
        self._flushed: dict[int, BlockHash] = {}
        # The model's bytes a row (`start_forward`), as the last staged step's;
        # the same when that step kept its rows as they are, else 0
        # (`decode_slot_values`).
        self._row_bytes = 0
        self._host_row_bytes = 0
        self.store = store
        self.tier = tier
        self.keeps_results = keeps_results
        # The results kept for callers; the hits verified and served.
        self.results = PromptResults(max_results)
        self.hits = HitReader(store, keeps_rows=self.keeps_rows, logprobs=hit_logprobs, share=share)
        if copy_steps is not None and not isinstance(copy_steps, bool):
            raise TypeError(f"copy_steps: expected a bool or None, found {type_name(copy_steps)}")
        self.copy_steps = copy_steps
        self._stats = LiveStoreStats()
        self._begun: StepPlan | None = None

    @property
    def max_staged_bytes(self) -> int:
        """The most bytes the staged steps' rows take (`StagedSteps.max_bytes`)."""
        return self._staged.max_bytes

    @property
    def stats(self) -> LiveStoreStats:
        """A snapshot of the counters, the hits' and the results' among them."""
        hits, results = self.hits, self.results
        return replace(
            self._stats,
            num_hit_requests=hits.num_hit_requests,
            num_hit_blocks=hits.num_hit_blocks,
            num_stale_hit_blocks=hits.num_stale_hit_blocks,
            num_scored_requests=hits.num_scored_requests,
            num_scored_tokens=hits.num_scored_tokens,
            num_score_failures=hits.num_score_failures,
            num_prompt_results=results.num_prompt_results,
            num_prompt_failures=results.num_prompt_failures,
            num_results_dropped=results.num_results_dropped,
            num_incomplete_dropped=results.num_incomplete_dropped,
            num_pending_results=len(results),
        )

    def begin(self, plan: StepPlan, rows: torch.Tensor | None = None) -> None:
        """Applies the start of a step's plan: cleared stamps, new prompt requests.

        Once per plan: `start_step` and `apply` both begin the step, in either
        order (vLLM starts a step's loads after its forward pass, which is
        where the store applies the step). ``rows``: the step's rows, when
        they are computed and not yet staged (checked to be none of the
        staged rows before those are written, `StagedSteps.fresh_rows`).
        """
        if self._begun is plan:
            return
        self._begun = plan
        staged = self._staged
        if plan.decode:
            # NOTE: such a plan asks for nothing, and clears no block that rows
            # of the `MAX_STAGED_STEPS` plans before it were written to
            # (`StepPlan.decode`): only staged rows of older plans are written
            # first, and the staged decode steps need not be resolved.
            if plan.cleared_block_ids:
                if staged.holds_plan_up_to(plan.number - MAX_STAGED_STEPS):
                    self._flushed.update(self._write_pending(rows))
                self._clear(plan.cleared_block_ids)
            return
        if staged.decode:
            self._resolve(rows)
        if staged.steps and (
            staged_slots(plan, None, self.store.block_size, staged.blocks) is None
            or staged.holds(plan.cleared_block_ids)
        ):
            # NOTE: the staged rows were written before anything this plan does.
            self._flushed.update(self._write_pending(rows))
        if plan.reset:
            self.store.invalidate_all()
            self._flushed.clear()
        if plan.cleared_block_ids:
            self._clear(plan.cleared_block_ids)
        if self.keeps_results:
            self.results.expect(plan)

    def _clear(self, block_ids: Sequence[int]) -> None:
        """Clears the stamps of blocks vLLM handed out again; the tier gets none of them.

        A block the staged rows stamped when written first (`begin`) holds
        them no more: it leaves the blocks saved to the tier after the step.
        """
        self.store.invalidate(block_ids)
        self._stats.num_cleared_blocks += len(block_ids)
        if self._flushed:
            for block_id in block_ids:
                self._flushed.pop(block_id, None)

    def start_forward(self, plan: StepPlan) -> None:
        """`begin`, before the step's forward pass, writing first the staged rows the
        step would write after it.

        The worker calls it on a device (a GPU), where writing staged rows
        reads their slots: before the forward pass that read waits for the
        steps before this one, after it for this one's forward pass too.
        Besides `begin`'s reasons (a step that cannot wait, or clears a block
        holding staged rows), the staged rows are written when staging this
        step would write them (`StagedSteps.writes_with`, the model's bytes a
        row as the staged steps'), as `apply` would. What only the step's rows show (a batch
        of other requests than planned, slots read at other places) is left
        to `apply`, after the forward pass. On the CPU, where reading waits
        for nothing, the worker does not call it and leaves it all to
        `apply`: it would cost each step a second look at its plan (with
        staged steps, `begin` here and `apply` after both run `staged_slots`).
        """
        staged = self._staged
        if (
            (staged.steps or staged.decode)
            and self._begun is not plan
            and staged.writes_with(sum(item.num_new for item in plan.requests) * self._row_bytes)
        ):
            self._flushed.update(self._write_pending())
        self.begin(plan)

    def start_step(self, plan: StepPlan) -> set[int]:
        """`begin`, then the plan's tier loads (of waiting requests, none in this step).

        Returns:
            The blocks vLLM must take as not loaded: in each load, those from
            the first block that did not verify on (vLLM recomputes its
            request from there under ``kv_load_failure_policy="recompute"``).
        """
        # NOTE: cleared stamps first: a block handed out again and filled now
        # must keep the stamp its load gives it.
        self.begin(plan)
        if not plan.loads:
            return set()
        if self.tier is None:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: a step orders tier loads, found no tier in the worker"
            )
        errors: set[int] = set()
        for order in plan.loads:
            num = self.tier.load(self.store, order)
            errors.update(order.block_ids[num:])
        return errors

    def flush(self) -> dict[int, BlockHash]:
        """Writes the rows of staged steps now (stamping, and saving to the tier).

        The store writes them itself before any step that hits or clears
        their blocks, loads, invalidates or cannot wait, and by the write
        rule (`StagedSteps`); a caller between steps calls this too
        (counters, the tier's flush, shutdown).

        Returns:
            Block id -> key of the blocks stamped since the last step that
            returned them (saved to the tier, with one).
        """
        return self._flush(None)

    def _flush(self, rows: torch.Tensor | None) -> dict[int, BlockHash]:
        """`flush` while a step's ``rows`` are computed and not yet staged (`begin`)."""
        stamped = self._flushed
        self._flushed = {}
        stamped.update(self._write_pending(rows))
        if self.tier is not None:
            self.tier.save(self.store, stamped)
        return stamped

    def close(self) -> None:
        self.flush()
        if self.tier is not None:
            self.tier.close()

    def decode_slot_values(self, plan: StepPlan, slot_mapping: torch.Tensor) -> list[int] | None:
        """The values of a steady decode step's slots, if its rows will wait as they are; else None.

        The worker reads them before the step's forward pass, where vLLM has
        just written them (after it, the host's caches are cold), and
        hands them to `apply`, which then only stages the step (its rows and
        these values, its plan and batch order): every check that needs no
        rows is made here, before the forward pass, where each costs less.
        Such a step is a decode step (`StepPlan.decode`) while no
        prompt is being gathered, once the staged steps keep the model's rows
        themselves and their slots' values (on the CPU, unless
        ``copy_steps``: `_stage`; learned from an earlier step's rows), whose
        rows may wait (within ``max_staged_bytes`` and `MAX_HOST_STEP_BYTES`).
        The rows' count is checked when the staged rows are written
        (`staged_steps.StagedSteps.take`).
        """
        row_bytes = self._host_row_bytes
        if not (row_bytes and plan.decode) or self.results.gathering:
            return None
        num = len(plan.requests)
        if not self._staged.admits(num * row_bytes, on_cpu=True):
            return None
        # NOTE: the whole mapping, then the list cut: a slice and a shape are
        # two more calls into torch.
        values: list[int] = slot_mapping.tolist()
        if len(values) == num:
            return values
        return values[:num] if len(values) > num else None

    def apply(
        self,
        plan: StepPlan,
        batch_order: Sequence[str] = (),
        hidden_states: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        *,
        slot_values: list[int] | None = None,
    ) -> dict[int, BlockHash]:
        """Applies one step: its plan, and the rows the model produced for it.

        Args:
            plan: the scheduler's plan of the step.
            batch_order: the step's request ids in the order of the rows.
            hidden_states: ``(>= num scheduled tokens, hidden)`` rows (None:
                no forward pass this step).
            slot_mapping: the forward pass's slot of each row (padding after
                the scheduled tokens).
            slot_values: `decode_slot_values` of the step, read before its
                forward pass: the step is then only staged (None: the step
                is applied as its plan and rows say).

        Returns:
            Block id -> key of the blocks the step's rows stamped (saved to
            the tier, with one).

        Raises:
            RuntimeError: the rows' requests are not the plan's.
        """
        if slot_values is not None and hidden_states is not None:
            # NOTE: a steady decode step whose rows wait as they are
            # (`decode_slot_values` checked the rest before the forward pass):
            # its clears (`begin`), then staged, nothing else. Right after the
            # forward pass, each statement costs several times what it does
            # before it or later.
            if plan.cleared_block_ids:
                self.begin(plan, hidden_states)
            waiting = self._staged
            self._stats.num_steps += 1
            self._begun = plan
            nbytes = len(slot_values) * self._host_row_bytes
            stamped = self._flush(hidden_states) if waiting.write_before(nbytes) else {}
            waiting.add(hidden_states, slot_values, None, plan, batch_order, nbytes)
            if waiting.write_after():
                stamped.update(self.flush())
            # NOTE: its finished requests end no gathering: no prompt is gathered.
            return stamped
        store = self.store
        self._stats.num_steps += 1
        if hidden_states is not None and slot_mapping is not None:
            staged: tuple[list[int], list[int], bool] | None = None
            if plan.decode and not self.results.gathering:
                # NOTE: staged by its plan alone: its requests are read later,
                # with the other staged steps' (`StagedSteps.resolve`).
                num = len(plan.requests)
            else:
                if self._staged.decode:
                    self._resolve(hidden_states)
                staged = staged_slots(plan, batch_order, store.block_size, self._staged.blocks)
                num = -1 if staged is None else len(staged[0])
            if num >= 0:
                # NOTE: each of the tensors' attributes read once: right after the
                # forward pass, every call into torch is cold.
                shape = hidden_states.shape
                num_given, width = shape[0], shape[-1]
                self._row_bytes = row_bytes = width * hidden_states.element_size()
                nbytes = num * row_bytes
                num_slots = slot_mapping.shape[0]
                on_cpu = hidden_states.is_cpu
                copy = not on_cpu if self.copy_steps is None else self.copy_steps
                self._host_row_bytes = 0 if copy or not on_cpu else row_bytes
                if self._staged.admits(nbytes, on_cpu) and num_given >= num and num_slots >= num:
                    stamped = self._stage(
                        plan,
                        staged,
                        nbytes,
                        copy,
                        batch_order,
                        hidden_states if num_given == num else hidden_states[:num],
                        slot_mapping if num_slots == num else slot_mapping[:num],
                    )
                    if staged is not None and (staged[2] or self.results.gathering):
                        self._read(batch_requests(plan, batch_order), hidden_states)
                    if plan.finished_req_ids:
                        self.results.finish_requests(plan.finished_req_ids)
                    return stamped
        if hidden_states is not None and (self._staged.steps or self._staged.decode):
            # NOTE: before `begin`, which may write the staged rows.
            self._staged.fresh_rows(hidden_states)
        self.begin(plan)
        if self._staged.steps or self._staged.decode:
            # NOTE: rows of other requests than planned, without their slots, or
            # too many to wait: written (or refused) below, after the staged rows.
            self._flushed.update(self._write_pending())
        batch = []
        stamped = self._flushed
        self._flushed = {}
        if hidden_states is not None and plan.requests:
            batch = batch_requests(plan, batch_order)
            stamped.update(self._write(plan, batch, hidden_states, slot_mapping))
        if plan.invalidated_block_ids:
            store.invalidate(plan.invalidated_block_ids)
            for block_id in plan.invalidated_block_ids:
                stamped.pop(block_id, None)
        if batch and hidden_states is not None:
            self._read(batch, hidden_states)
        self.results.finish_requests(plan.finished_req_ids)
        if self.tier is not None:
            self.tier.save(store, stamped)
        return stamped

    def _stage(
        self,
        plan: StepPlan,
        planned: tuple[list[int], list[int], bool] | None,
        nbytes: int,
        copy: bool,
        batch_order: Sequence[str],
        hidden_states: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> dict[int, BlockHash]:
        """The write of `apply` for a step whose rows may wait; the blocks stamped.

        ``planned``: the rows' slots and blocks (`staged_steps.staged_slots`),
        or None for a steady decode step, staged by its plan alone
        (`StepPlan.decode`: its slots are found when the staged steps are
        resolved, `staged_steps.StagedSteps.resolve`, and the decode steps are
        the last staged: a step staged with its slots resolves them first);
        ``nbytes``: the bytes of the model's rows of the step (on every rank,
        a follower's too, so that every rank writes at the same step);
        ``hidden_states`` and ``slot_mapping``: the step's, padding left out
        (whole tensors when the step has none: a slice is one more op);
        ``copy``: whether the step keeps copies (below: ``copy_steps``, or
        whether the rows are on a device). `staged_steps.write_staged`
        compares the slots with the plan's. (A steady decode step whose rows
        wait as they are is staged by `apply` itself: `decode_slot_values`.)

        On a device the step keeps a copy of its rows and of its slot
        mapping, made there: reading a value of either would make the step
        wait for the forward pass, and vLLM reuses both buffers (a graph
        replays into the same output). On the CPU reading waits for nothing:
        the step keeps its slots' values, and the model's rows themselves,
        which are new memory each step there (vLLM's CPU backend replays no
        graph), so a copy would only be work. Were they not new memory, a
        later step's rows would start where a staged step's do: the staged
        rows are refused before anything writes them, and so is a step
        written at once whose rows start where a staged step's do
        (`StagedSteps.fresh_rows`).
        """
        staged = self._staged
        rows: torch.Tensor | None = None
        if self.keeps_rows:
            rows = hidden_states.clone() if copy else hidden_states
        # NOTE: `begin` of such a plan clears stamps (before its rows, as always;
        # writing the staged rows first if any is in a cleared block) and takes
        # new prompts (a decode step's plan takes none).
        if plan.cleared_block_ids or (planned is not None and plan.prompt_requests):
            self.begin(plan, hidden_states)
        self._begun = plan
        stamped: dict[int, BlockHash] = {}
        if staged.write_before(nbytes):
            stamped = self._flush(hidden_states)
        mapping: torch.Tensor | list[int] = slot_mapping.clone() if copy else slot_mapping.tolist()
        staged.add(rows, mapping, planned, plan, batch_order, nbytes)
        if staged.write_after():
            stamped.update(self.flush())
        return stamped

    def _resolve(self, rows: torch.Tensor | None = None) -> None:
        """Resolves the decode steps staged by their plans (`staged_steps.StagedSteps.resolve`);
        ``rows`` as `begin`'s.

        Raises:
            RuntimeError: a step's rows are not its plan's requests, or its
                plan is not a steady decode step's: the staged steps before
                it are written first (as when it was computed, with its
                slots), it and those after it dropped, unwritten.
        """
        staged = self._staged
        before = len(staged.steps)
        try:
            staged.resolve()
        except RuntimeError as error:
            self._stats.num_decode_steps += len(staged.steps) - before
            self._flushed.update(self._write_pending(rows))
            raise RuntimeError(f"{error} (a decode step staged by its plan)") from None
        self._stats.num_decode_steps += len(staged.steps) - before

    def _write_pending(self, rows: torch.Tensor | None = None) -> dict[int, BlockHash]:
        """Writes the staged steps' rows (`staged_steps.write_staged`); the blocks stamped.

        ``rows`` as `begin`'s.
        """
        if self._staged.decode:
            self._resolve(rows)
        steps = self._staged.take(rows)
        if not steps:
            return {}
        written = write_staged(self.store, steps, None if self.keeps_rows else self._marks)
        self._stats.num_rows_written += written.num_rows
        self._stats.num_slot_mismatches += written.num_slot_mismatches
        return written.stamped

    def _write(
        self,
        plan: StepPlan,
        batch: list[PlannedRequest],
        hidden_states: torch.Tensor,
        slot_mapping: torch.Tensor | None,
    ) -> dict[int, BlockHash]:
        if not plan.caching:
            return {}
        if slot_mapping is None:
            raise RuntimeError("step: expected the forward pass's slot mapping, found none")
        num_rows = sum(item.num_new for item in batch)
        slots = slot_mapping[:num_rows].to("cpu", torch.int64).numpy()
        planned = planned_slots(batch, self.store.block_size)
        keys = plan.block_keys
        if planned != slots.tolist():
            # NOTE: rows written without keys clear the stamps of every block
            # they touch. The scheduler's mirror does so too for a step with a
            # request planned without blocks (`StoreMirror.plan`); for slots
            # otherwise not the planned ones, it may promise a hit the worker
            # cannot serve, which the read check counts.
            self._stats.num_slot_mismatches += 1
            keys = {}
        rows = hidden_states if self.keeps_rows else self._marks(num_rows)
        result = self.store.write(HIDDEN_STATES, rows, slots, block_keys=keys, num_tokens=num_rows)
        self._stats.num_rows_written += num_rows
        return {block_id: keys[block_id] for block_id in result.stamped_block_ids}

    def _marks(self, num_rows: int) -> torch.Tensor:
        """A follower's rows: one byte each, stamps being what its store keeps."""
        if len(self._mark_rows) < num_rows:
            self._mark_rows = torch.zeros((num_rows, 1), dtype=FOLLOWER_DTYPE)
        return self._mark_rows

    def _read(self, batch: list[PlannedRequest], hidden_states: torch.Tensor) -> None:
        """The step's hits verified and served (`hits.HitReader.read`); the rows of gathered
        prompts handed to the results."""
        results = self.results
        for req_id, start, rows in self.hits.read(batch, hidden_states, results.gathering):
            results.add(req_id, start, rows)
