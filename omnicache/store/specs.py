"""What a caller hands the store and gets back: specs, requests, results, counters, errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from omnicache.block_hash import BlockHash

HIDDEN_STATES = "hidden_states"
"""Entry name of the model's hidden states."""


class StaleBlockError(LookupError):
    """A block expected to hold key ``expected`` for ``name`` holds ``found``.

    Attributes:
        name: Entry name.
        block_id: The block that was read.
        block_index: Position of the block among the blocks read.
        expected: The key the caller expected.
        found: The key the block holds for the entry (None: none).
        req_id: The request whose read failed, when there is one.
    """

    def __init__(
        self,
        name: str,
        block_id: int,
        block_index: int,
        expected: bytes,
        found: bytes | None,
        req_id: str | None = None,
    ) -> None:
        who = "" if req_id is None else f" of request {req_id!r}"
        super().__init__(
            f"entry {name!r}: block {block_id} (block {block_index}{who}) expected key "
            f"{expected.hex()}, found {'no key' if found is None else found.hex()}"
        )
        self.name = name
        self.block_id = block_id
        self.block_index = block_index
        self.expected = expected
        self.found = found
        self.req_id = req_id


class StaleCommitError(ValueError):
    """A commit would write a request's staged rows into a block they were not staged for.

    Nothing is written and the rows stay staged (`TensorStore.discard` drops
    them); the refusal is counted in ``StoreStats.num_refused_commits``.

    Attributes:
        req_id: The request committed.
        name: The entry of the refused row.
        token: Position of the first refused row in the request.
        block_index: Its block's index in the commit's ``block_ids``.
        block_id: The block ``block_ids`` names there.
        staged_block_id: The block the row was staged for (None: not known,
            the row was staged without slots); when it differs from
            ``block_id``, that difference is the refusal.
        owner: Otherwise ``block_id`` changed hands since the row was
            staged: the request whose step wrote into it since, or None
            when the store was told the block was handed out again.
    """

    def __init__(
        self,
        req_id: str,
        name: str,
        token: int,
        block_index: int,
        block_id: int,
        staged_block_id: int | None,
        owner: str | None,
    ) -> None:
        where = f"commit of request {req_id!r}: entry {name!r}, token {token}"
        table = f"block {block_id} (block_ids[{block_index}])"
        if staged_block_id is not None and staged_block_id != block_id:
            message = (
                f"{where}: expected block {staged_block_id} (the block it was staged for), "
                f"found {table}"
            )
        else:
            found = (
                "handed out again since (evicted or invalidated)"
                if owner is None
                else f"in request {owner!r}'s table since"
            )
            message = (
                f"{where}: expected {table} held by the request since the row was staged, "
                f"found it {found}"
            )
        super().__init__(message)
        self.req_id = req_id
        self.name = name
        self.token = token
        self.block_index = block_index
        self.block_id = block_id
        self.staged_block_id = staged_block_id
        self.owner = owner


class StoreCapacityError(ValueError):
    """Registering an entry would exceed the store's ``max_bytes``."""


class EntrySpec(NamedTuple):
    """What an entry holds: ``row_shape`` values of ``dtype`` per token."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    deferred: bool
    # Bytes of the entry's cache tensor.
    nbytes: int


def describe(spec: EntrySpec) -> str:
    """The spec as an error message names it."""
    kind = "deferred " if spec.deferred else ""
    return f"{kind}rows {spec.row_shape} of {spec.dtype}"


class ScheduledRequest(NamedTuple):
    """One request's part of a step, in batch order.

    The step's outputs hold ``num_new_tokens`` consecutive rows for each
    request, requests in the order given. A request with hit blocks is the
    step that starts right after its hit: its ``num_computed_tokens`` must be
    ``len(hit_block_ids) * block_size`` (`TensorStore.read_merged` refuses
    it otherwise). Without hit blocks it may start anywhere (a later chunk
    of a prompt, a decode step).
    """

    req_id: str
    # Rows this step computed for the request.
    num_new_tokens: int
    # Position of the first of them in the request's sequence.
    num_computed_tokens: int = 0
    # Blocks of the request's prefix hit, first block first (reads only).
    hit_block_ids: Sequence[int] = ()
    # The key each hit block is expected to hold, aligned with hit_block_ids.
    hit_block_keys: Sequence[BlockHash] = ()


class WriteResult(NamedTuple):
    """What one write into one entry did."""

    name: str
    num_rows: int
    # Blocks this write completed and stamped with their key.
    stamped_block_ids: tuple[int, ...]
    # Blocks given a key whose rows are not complete: left without a stamp.
    incomplete_block_ids: tuple[int, ...]


def merge_results(a: WriteResult, b: WriteResult) -> WriteResult:
    """Two writes into one entry as one: ``b``'s outcome for a block wins."""
    stamped = dict.fromkeys(a.stamped_block_ids)
    for block in b.incomplete_block_ids:
        stamped.pop(block, None)
    stamped.update(dict.fromkeys(b.stamped_block_ids))
    incomplete = dict.fromkeys(x for x in a.incomplete_block_ids if x not in stamped)
    incomplete.update(dict.fromkeys(b.incomplete_block_ids))
    return WriteResult(a.name, a.num_rows + b.num_rows, tuple(stamped), tuple(incomplete))


class ReadMiss(NamedTuple):
    """A request whose hit blocks did not all hold their expected keys."""

    req_id: str
    num_hit_blocks: int
    # Leading hit blocks that held their keys for every entry read.
    num_valid_blocks: int
    # An entry whose stamp failed at block ``num_valid_blocks``.
    name: str


@dataclass(frozen=True, slots=True)
class MergedRead:
    """Result of `TensorStore.read_merged`.

    ``tensors[name][req_id]`` holds the rows of the request's hit blocks
    followed by this step's rows; views into one output buffer per entry.
    Requests listed in ``misses`` have no rows: nothing stale is returned.
    """

    tensors: dict[str, dict[str, torch.Tensor]]
    # Outputs that are not cached entries (1-D metadata, ...), unchanged.
    passthrough: dict[str, object]
    misses: tuple[ReadMiss, ...]

    @property
    def hidden_states(self) -> dict[str, torch.Tensor]:
        return self.tensors.get(HIDDEN_STATES, {})


@dataclass(slots=True)
class StoreStats:
    """Counters since construction (``num_staged_bytes``: now)."""

    num_writes: int = 0
    num_rows_written: int = 0
    num_stamped_blocks: int = 0
    # Blocks given a key by a write that could not stamp them.
    num_incomplete_blocks: int = 0
    num_read_requests: int = 0
    num_hit_blocks_read: int = 0
    # Requests (read_merged) or calls (read_blocks) that found a stale block;
    # probe only looks and counts nothing.
    num_stale_reads: int = 0
    num_evicted_stamps: int = 0
    num_staged_bytes: int = 0
    # Stamped blocks offered to the tier (one per block and entry).
    num_tier_offered: int = 0
    # Blocks `read_through` filled from the tier, and blocks it asked for.
    num_tier_hit_blocks: int = 0
    num_tier_queried_blocks: int = 0
    # Tier calls that raised, or returned rows the store cannot take (of the
    # wrong shape, dtype, layout or device, or requiring grad): a broken tier
    # is counted, logged and treated as a miss.
    num_tier_errors: int = 0
    # Commits refused because a block changed hands since its rows were
    # staged, or is not the block they were staged for (`StaleCommitError`).
    num_refused_commits: int = 0
    # Outputs of a padded step that looked per-token (a tensor of 2 or more
    # dims with at least the step's rows, fewer than its padded rows) but
    # were no entry: neither cached nor created one. Logged once per name.
    num_unplaced_outputs: int = 0
