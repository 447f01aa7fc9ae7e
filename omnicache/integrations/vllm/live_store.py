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
5. every prefix hit that starts in this step is *verified*: a hit block not
   stamped with its key counts as stale (`LiveStoreStats.num_stale_hit_blocks`)
   and is never served; requests that asked for their prompt's hidden states
   get the hit blocks' rows from the store and the rest from the step's rows;
   requests that asked for prompt logprobs get those of the hit's positions
   computed from the hit's rows, and requests that asked for per-token
   embeddings the hit's rows (`PromptOutputs`), before vLLM's model runner
   computes the rest when it samples or pools the step.

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

import hmac
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, check_str, type_name
from omnicache.integrations.vllm.common import CONNECTOR_NAME
from omnicache.integrations.vllm.plan import (
    PlannedRequest,
    StepPlan,
    batch_requests,
    planned_slots,
)
from omnicache.integrations.vllm.staged_steps import (
    MAX_DEFERRED_STEPS,
    MAX_HOST_STEP_BYTES,
    MAX_STAGED_BYTES,
    Staged,
    staged_slots,
    write_staged,
)
from omnicache.integrations.vllm.tier import WorkerTier
from omnicache.store import HIDDEN_STATES, TensorStore

__all__ = [
    "FOLLOWER_DTYPE",
    "LiveStore",
    "LiveStoreStats",
    "PromptScorer",
    "ScoredPrompt",
    "follower_store",
]

FOLLOWER_DTYPE = torch.uint8
"""A follower's store (`follower_store`) keeps one value of this type a row."""

_LOG = logging.getLogger(__name__)


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


@dataclass(slots=True)
class _Prompt:
    """The rows one request asked for, gathered chunk by chunk."""

    # Its prompt's tokens; None: every position, until the request finishes.
    num_tokens: int | None
    # The secret that takes the result (`connector.OmniStoreConnector`'s).
    key: str
    # (first position, rows), in position order.
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, start: int, rows: torch.Tensor) -> torch.Tensor | None:
        """Adds rows from position ``start``; returns the whole prompt once complete.

        A chunk replaces every chunk from its start on: a request recomputed
        after preemption starts over. A request of every position is never
        complete here: it ends when it finishes (`rows`).
        """
        self.chunks = [chunk for chunk in self.chunks if chunk[0] < start]
        if self.num_tokens is None:
            self.chunks.append((start, rows))
            return None
        self.chunks.append((start, rows[: self.num_tokens - start]))
        return self.rows(self.num_tokens)

    def rows(self, num_rows: int | None = None) -> torch.Tensor | None:
        """The first ``num_rows`` rows (None: all gathered); None while they have a gap."""
        position = 0
        for first, part in self.chunks:
            if first != position:
                return None
            position += len(part)
        if num_rows is not None and position < num_rows:
            return None
        if not self.chunks:
            return None
        if len(self.chunks) == 1:
            # NOTE: a chunk is the store's own copy: no need for another.
            return self.chunks[0][1][:num_rows]
        return torch.cat([part for _, part in self.chunks])[:num_rows]


def _alone(
    item: PlannedRequest, prompt: _Prompt | None, scores: bool, uses: Mapping[int, int]
) -> bool:
    """Whether a verified hit is read straight into its prompt's result (`LiveStore._read`):
    a prompt's, not scored, in blocks no other request of the step needs."""
    return prompt is not None and not scores and all(uses[b] == 1 for b in item.hit_block_ids)


def _nbytes(rows: torch.Tensor) -> int:
    return rows.numel() * rows.element_size()


class ScoredPrompt(NamedTuple):
    """A request whose hit positions are scored in a step (see `PromptScorer`)."""

    req_id: str
    # The hit's tokens: its first positions.
    num_tokens: int
    # The hit's blocks, as indices into the step's rows of hit blocks; None
    # when the hit's rows could not be read (a block lost its key).
    blocks: tuple[int, ...] | None


class PromptScorer(Protocol):
    """What scores hits' prompt positions from their stored rows (`PromptOutputs`)."""

    def wants(self, req_id: str) -> bool:
        """Whether the request's prompt positions are scored (prompt logprobs or embeddings)."""
        ...

    def score(self, rows: torch.Tensor, block_size: int, prompts: Sequence[ScoredPrompt]) -> None:
        """Scores each prompt's first positions from the step's ``rows`` of hit blocks.

        Args:
            rows: ``(num_blocks * block_size, hidden)``: each hit block of the
                step once, in the order the prompts' ``blocks`` index.
            block_size: tokens per block.
            prompts: the requests, each position ``p`` of one from row
                ``blocks[p // block_size] * block_size + p % block_size``; one
                without blocks gets no value that could pass for one.
        """
        ...


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
        scorer: gives the hit positions of requests that ask for prompt
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
            model's rows, counted alike on every rank): the staged rows are
            written when one more step's would take more, and a step whose
            rows alone would is written at once (0: every step is).
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
        scorer: PromptScorer | None = None,
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
        self.share = share
        self._mark_rows = torch.zeros((0, 1), dtype=FOLLOWER_DTYPE)
        # Steps whose rows wait to be written (`_stage`). And the blocks a
        # write in `begin` stamped (saved to the tier by `apply`).
        self._staged = Staged(store.block_size)
        self._flushed: dict[int, BlockHash] = {}
        # The model's bytes a row (`start_forward`), as the last staged step's;
        # the same when that step kept its rows as they are, else 0
        # (`decode_slot_values`).
        self._row_bytes = 0
        self._host_row_bytes = 0
        self.store = store
        self.tier = tier
        self.scorer = scorer
        self.max_results = check_int("max_results", max_results, minimum=1)
        self.max_staged_bytes = check_int("max_staged_bytes", max_staged_bytes, minimum=0)
        self.keeps_results = keeps_results
        if copy_steps is not None and not isinstance(copy_steps, bool):
            raise TypeError(f"copy_steps: expected a bool or None, found {type_name(copy_steps)}")
        self.copy_steps = copy_steps
        self._prompts: dict[str, _Prompt] = {}
        # Request id -> (its key, its rows or None).
        self._results: OrderedDict[str, tuple[str, torch.Tensor | None]] = OrderedDict()
        self._stats = LiveStoreStats()
        self._begun: StepPlan | None = None

    @property
    def stats(self) -> LiveStoreStats:
        """A snapshot of the counters."""
        return replace(self._stats, num_pending_results=len(self._results))

    def begin(self, plan: StepPlan, rows: torch.Tensor | None = None) -> None:
        """Applies the start of a step's plan: cleared stamps, new prompt requests.

        Once per plan: `start_step` and `apply` both begin the step, in either
        order (vLLM starts a step's loads after its forward pass, which is
        where the store applies the step). ``rows``: the step's rows, when
        they are computed and not yet staged (checked to be none of the
        staged rows before those are written, `Staged.fresh_rows`).
        """
        if self._begun is plan:
            return
        self._begun = plan
        staged = self._staged
        if plan.decode:
            # NOTE: such a plan asks for nothing, and clears no block that rows
            # of the `MAX_DEFERRED_STEPS` plans before it were written to
            # (`StepPlan.decode`): only staged rows of older plans are written
            # first, and the staged decode steps need not be resolved.
            if plan.cleared_block_ids:
                if staged.holds_plan_up_to(plan.number - MAX_DEFERRED_STEPS):
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
        if not self.keeps_results:
            return
        for req_id, num_tokens in plan.prompt_requests.items():
            every = req_id in plan.sequence_requests
            self._prompts[req_id] = _Prompt(None if every else num_tokens, plan.result_keys[req_id])

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
        holding staged rows), the staged rows are written when this step's
        would take them to `MAX_DEFERRED_STEPS` steps or past
        ``max_staged_bytes`` (the model's bytes a row as the staged steps'),
        as `apply` would write them. What only the step's rows show (a batch
        of other requests than planned, slots read at other places) is left
        to `apply`, after the forward pass. On the CPU, where reading waits
        for nothing, the worker does not call it and leaves it all to
        `apply`: it would cost each step a second look at its plan (with
        staged steps, `begin` here and `apply` after both run `staged_slots`).
        """
        staged = self._staged
        if (staged.steps or staged.decode) and self._begun is not plan:
            nbytes = sum(item.num_new for item in plan.requests) * self._row_bytes
            if (
                len(staged.steps) + len(staged.decode) + 1 >= MAX_DEFERRED_STEPS
                or staged.nbytes + nbytes > self.max_staged_bytes
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
        their blocks, loads, invalidates or cannot wait, and when
        `MAX_DEFERRED_STEPS` wait or one more step's rows would take more
        than ``max_staged_bytes``;
        a caller between steps calls this too (counters, the tier's flush,
        shutdown).

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
        just written them (after it, the same read took 8 us against 5), and
        hands them to `apply`, which then only stages the step (its rows and
        these values, its plan and batch order): every check that needs no
        rows is made here, before the forward pass, where each costs about
        half. Such a step is a decode step (`StepPlan.decode`) while no
        prompt is being gathered, once the staged steps keep the model's rows
        themselves and their slots' values (on the CPU, unless
        ``copy_steps``: `_stage`; learned from an earlier step's rows), whose
        rows may wait (within ``max_staged_bytes`` and `MAX_HOST_STEP_BYTES`).
        The rows' count is checked when the staged rows are written
        (`staged_steps.Staged.take`).
        """
        row_bytes = self._host_row_bytes
        if not (row_bytes and plan.decode) or self._prompts:
            return None
        num = len(plan.requests)
        if num * row_bytes > self.max_staged_bytes or num * row_bytes > MAX_HOST_STEP_BYTES:
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
            over = waiting.nbytes + nbytes > self.max_staged_bytes
            stamped = self._flush(hidden_states) if over else {}
            waiting.decode.append((hidden_states, slot_values, plan, batch_order))
            waiting.nbytes += nbytes
            if len(waiting.steps) + len(waiting.decode) >= MAX_DEFERRED_STEPS:
                stamped.update(self.flush())
            # NOTE: its finished requests end no gathering: no prompt is gathered.
            return stamped
        store = self.store
        self._stats.num_steps += 1
        if hidden_states is not None and slot_mapping is not None:
            staged: tuple[list[int], list[int], bool] | None = None
            if plan.decode and not self._prompts:
                # NOTE: staged by its plan alone: its requests are read later,
                # with the other staged steps' (`Staged.resolve`).
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
                if (
                    nbytes <= self.max_staged_bytes
                    and (nbytes <= MAX_HOST_STEP_BYTES or not on_cpu)
                    and num_given >= num
                    and num_slots >= num
                ):
                    stamped = self._stage(
                        plan,
                        staged,
                        nbytes,
                        copy,
                        batch_order,
                        hidden_states if num_given == num else hidden_states[:num],
                        slot_mapping if num_slots == num else slot_mapping[:num],
                    )
                    if staged is not None and (staged[2] or self._prompts):
                        self._read(batch_requests(plan, batch_order), hidden_states)
                    if plan.finished_req_ids:
                        self._finish_requests(plan.finished_req_ids)
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
        self._finish_requests(plan.finished_req_ids)
        if self.tier is not None:
            self.tier.save(store, stamped)
        return stamped

    def _finish_requests(self, req_ids: Sequence[str]) -> None:
        """Ends the gathering of finished requests: every position's rows are a result."""
        for req_id in req_ids:
            prompt = self._prompts.get(req_id)
            if prompt is not None and prompt.num_tokens is None:
                self._finish(req_id, prompt.rows())
            elif self._prompts.pop(req_id, None) is not None:
                self._stats.num_incomplete_dropped += 1

    def take(
        self,
        requests: Mapping[str, str],
        *,
        max_bytes: int | None = None,
        num_positions: Mapping[str, int] | None = None,
    ) -> dict[str, torch.Tensor | int | None]:
        """Removes and returns the results of requests, each given with its key.

        Args:
            requests: request id -> the key of its result (``kv_transfer_params``).
            max_bytes: the largest result taken (None: any); a larger one is
                left in place.
            num_positions: request id -> its rows, for requests that asked for
                every position (``omnicache_num_positions`` of its
                ``kv_transfer_params``). Such a request's result is complete
                when its caller sees it finish, before the engine's next step
                tells the worker: with its count, it is taken then.

        Returns:
            Request id -> ``(num_rows, hidden)`` rows: the prompt's, or every
            position's; None when its hit could not be read (stale), or when
            it has fewer rows than its count; or, for a result over
            ``max_bytes``, its size in bytes (not taken). Requests without a
            result, or given another key, are left out.
        """
        counts = dict(num_positions or {})
        for req_id, number in counts.items():
            check_int(f"num_positions[{req_id!r}]", number, minimum=0)
        found: dict[str, torch.Tensor | int | None] = {}
        for req_id, key in requests.items():
            check_str("request id", req_id)
            check_str(f"requests[{req_id!r}]", key)
            count = counts.get(req_id)
            if req_id not in self._results:
                prompt = self._prompts.get(req_id)
                if (
                    prompt is None
                    or prompt.num_tokens is not None
                    or count is None
                    or not hmac.compare_digest(prompt.key.encode(), key.encode())
                ):
                    continue
                self._finish(req_id, prompt.rows(count))
            kept = self._results.get(req_id)
            if kept is None or not hmac.compare_digest(kept[0].encode(), key.encode()):
                continue
            rows = kept[1]
            if rows is not None and count is not None:
                rows = rows[:count] if len(rows) >= count else None
            if rows is not None and max_bytes is not None and _nbytes(rows) > max_bytes:
                found[req_id] = _nbytes(rows)
                continue
            del self._results[req_id]
            found[req_id] = rows
        return found

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
        resolved, `staged_steps.Staged.resolve`, and the decode steps are
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
        (`Staged.fresh_rows`).
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
        if staged.nbytes + nbytes > self.max_staged_bytes:
            stamped = self._flush(hidden_states)
        mapping: torch.Tensor | list[int] = slot_mapping.clone() if copy else slot_mapping.tolist()
        if planned is None:
            staged.decode.append((rows, mapping, plan, batch_order))
        else:
            staged.steps.append(
                (rows, mapping, planned[0], plan.block_keys, batch_order, plan.number)
            )
            # NOTE: kept as steps come, not gathered when asked: with a large
            # batch and small blocks, most decode steps clear blocks.
            staged.blocks.update(planned[1])
        staged.nbytes += nbytes
        if len(staged.steps) + len(staged.decode) >= MAX_DEFERRED_STEPS:
            stamped.update(self.flush())
        return stamped

    def _resolve(self, rows: torch.Tensor | None = None) -> None:
        """Resolves the decode steps staged by their plans (`staged_steps.Staged.resolve`);
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
        """Verifies the step's hits; gathers prompt rows; scores hits' positions.

        NOTE: the hit blocks of every request that needs their rows are read
        once per step, however many requests share them (a harness sends many
        prompts behind one long prefix). A prompt's hit whose blocks no other
        request of the step needs, and which is not scored, is read straight
        into its result: gathered with the others, its rows would be copied
        twice (in the engine, 16 requests' 448-row hits at hidden 1024 in
        float32: 28 MiB more each step).
        """
        offset = 0
        scorer = self.scorer
        # (request, its step rows, its hit verified, asks, scores) of those needing hit rows.
        needs: list[tuple[PlannedRequest, torch.Tensor, bool, _Prompt | None, bool]] = []
        for item in batch:
            rows = hidden_states[offset : offset + item.num_new]
            offset += item.num_new
            verified = True
            if item.hit_block_ids:
                self._stats.num_hit_requests += 1
                self._stats.num_hit_blocks += len(item.hit_block_ids)
                valid = self.store.probe(item.hit_block_ids, item.hit_block_keys)
                self._stats.num_stale_hit_blocks += len(item.hit_block_ids) - valid
                verified = valid == len(item.hit_block_ids)
            prompt = self._prompts.get(item.req_id)
            limit = None if prompt is None else prompt.num_tokens
            if limit is not None and item.start >= limit:
                prompt = None
            scores = bool(item.hit_block_ids) and scorer is not None and scorer.wants(item.req_id)
            if prompt is not None and not item.hit_block_ids:
                # NOTE: results wait in the store's memory (host memory beside a GPU)
                # until taken, as the hits' rows do: a copy of vLLM's buffer.
                self._add(item.req_id, prompt, item.start, rows.to(self.store.device, copy=True))
            elif prompt is not None or scores:
                needs.append((item, rows, verified, prompt, scores))
        if not needs:
            return
        # Requests per block among the verified hits: a prompt's own blocks
        # (`_alone`) are read into its result.
        uses: dict[int, int] = {}
        for item, _, verified, _, _ in needs:
            if verified:
                for block_id in item.hit_block_ids:
                    uses[block_id] = uses.get(block_id, 0) + 1
        # NOTE: the scored requests' blocks first: under tensor parallelism
        # every rank scores them, from the rows the first rank shares.
        index: dict[int, int] = {}
        keys: list[BlockHash] = []
        num_scored = 0
        for scored_first in (True, False):
            for item, _, verified, prompt, scores in needs:
                if scores != scored_first or not verified or _alone(item, prompt, scores, uses):
                    continue
                for block_id, key in zip(item.hit_block_ids, item.hit_block_keys, strict=True):
                    if block_id not in index:
                        index[block_id] = len(index)
                        keys.append(key)
            if scored_first:
                num_scored = len(index)
        # NOTE: every block read belongs to a hit verified above: none is stale.
        bs, hidden = self.store.block_size, hidden_states.shape[-1]
        if not index:
            hit_rows = hidden_states.new_empty(0, hidden)
        elif self.keeps_rows:
            hit_rows = self.store.read_blocks(HIDDEN_STATES, list(index), keys)
        else:
            # NOTE: a follower has no prompts: every block it needs is scored.
            hit_rows = hidden_states.new_empty(len(index) * bs, hidden)
        scored_rows = hit_rows
        if self.share is not None and num_scored:
            scored_rows = self.share(
                hit_rows[: num_scored * bs].to(hidden_states.device).contiguous()
            )
        blocks = hit_rows.view(-1, bs, hidden)
        scored: list[ScoredPrompt] = []
        dtype, device = self.store.entries[HIDDEN_STATES].dtype, self.store.device
        for item, rows, verified, prompt, scores in needs:
            alone = verified and _alone(item, prompt, scores, uses)
            ids = (
                tuple(index[block_id] for block_id in item.hit_block_ids)
                if verified and not alone
                else None
            )
            if prompt is not None:
                if not verified:
                    self._finish(item.req_id, None)
                else:
                    # The hit's blocks, then the step's rows, in one tensor beside the
                    # store's rows (the step's may be on the model's device).
                    num_hit = len(item.hit_block_ids) * bs
                    whole = torch.empty((num_hit + len(rows), hidden), dtype=dtype, device=device)
                    if ids is None:
                        # Blocks no other request needs: read straight into the result.
                        self.store.read_blocks(
                            HIDDEN_STATES,
                            item.hit_block_ids,
                            item.hit_block_keys,
                            out=whole[:num_hit],
                        )
                    elif ids == tuple(range(ids[0], ids[0] + len(ids))):
                        # The request's blocks were read next to each other: one slice.
                        first = ids[0] * bs
                        whole[:num_hit].copy_(hit_rows[first : first + num_hit])
                    else:
                        torch.index_select(
                            blocks,
                            0,
                            torch.tensor(ids, device=blocks.device),
                            out=whole[:num_hit].view(-1, bs, hidden),
                        )
                    whole[num_hit:].copy_(rows)
                    self._add(item.req_id, prompt, 0, whole)
            if scores:
                scored.append(ScoredPrompt(item.req_id, item.start, ids))
                self._count_scored(item, ids is not None)
        if scored:
            assert scorer is not None
            scorer.score(scored_rows, bs, scored)

    def _add(self, req_id: str, prompt: _Prompt, start: int, rows: torch.Tensor) -> None:
        whole = prompt.add(start, rows)
        if whole is not None:
            self._finish(req_id, whole)

    def _count_scored(self, item: PlannedRequest, read: bool) -> None:
        if read:
            self._stats.num_scored_requests += 1
            self._stats.num_scored_tokens += item.start
            return
        self._stats.num_score_failures += 1
        _LOG.warning(
            "request %s: its prefix hit's rows could not be read; the outputs (prompt "
            "logprobs, embeddings) of its first %d positions are NaN",
            item.req_id,
            item.start,
        )

    def _finish(self, req_id: str, rows: torch.Tensor | None) -> None:
        prompt = self._prompts.pop(req_id)
        if rows is None:
            self._stats.num_prompt_failures += 1
        else:
            self._stats.num_prompt_results += 1
        self._results[req_id] = (prompt.key, rows)
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)
            self._stats.num_results_dropped += 1
