"""TensorStore: hidden states and per-token multimodal outputs by block, stamped.

A prefix hit lets a request skip the forward pass for its cached tokens, but a
multi-stage model still needs those tokens' hidden states and per-token
multimodal outputs (codec codes, embeddings, ...) for the next stage. The store
keeps them per KV block, in the same slots the KV cache uses, so a hit on
blocks ``[b0, b1, ...]`` finds its rows at the same block ids.

Layout of one entry (``dim`` values of ``dtype`` per token)::

    cache (num_blocks, block_size, dim)        flat (num_blocks * block_size, dim)
    block 0  [row 0 .. row block_size - 1]     slot = block_id * block_size + offset
    block 1  [row 0 .. row block_size - 1]
    ...
    per block, per entry:
      stamps[block_id]   the key whose rows the block holds, or None
      filled[block_id]   rows written in token order from offset 0 (-1: broken run)

Stamps. A block is stamped with key K for an entry only by a write that
completes the block (``filled`` reaches ``block_size``) while the caller names
K as the block's key; any other write that touches the block clears its stamp.
A read that expects K from a block not stamped K is a counted miss or a
`StaleBlockError`, never wrong data. When the block pool reuses a keyed block
it calls `TensorStore.on_block_evicted`, which clears the block's stamps and
fill counts for every entry.

Fill counts. A write at offset 0 starts a block's run (a new owner always
writes its first token there); a write that starts exactly at ``filled``
extends it; any other write (a gap, a rewrite in the middle) breaks the run
until the next offset-0 write, so such a block is never stamped.

NOTE: a block freed *without* a key and handed to a new owner produces no
eviction call. If the new owner skips an entry for the first rows of such a
block and starts it exactly where the previous owner stopped, the run would
continue across owners. Owners that write every entry for every token, from
offset 0, never do that; a caller that writes an entry for only some tokens
calls `TensorStore.invalidate` with each step's newly allocated block ids.

Small writes (a decode step: up to a few hundred rows) compute runs, fill
counts and stamps over Python ints instead of numpy arrays; they have the same
effects, results and errors as the general path, which handles every input the
small path declines (including every bad one, so that errors come from one
place).

Deferred entries are staged per request (on the device the rows came from)
and written into their blocks once, when the request finishes and its block
table is still known (`TensorStore.commit`), or dropped on abort
(`TensorStore.discard`).

A second tier (`BlockTier`: another process's memory, Redis, ...) sits beside
the store and knows blocks only by key. Every block a write stamps, and every
block `TensorStore.commit` stamps, is offered to the tier (write-behind: the
tier copies the rows and returns); `TensorStore.read_through` fills newly
allocated blocks with the rows the tier holds for their keys and stamps them
(read-through on a local miss). The store knows nothing of how a tier keeps
its blocks, and a tier that fails costs misses, never an exception.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from omnicache.block_hash import BlockHash

__all__ = [
    "HIDDEN_STATES",
    "BlockTier",
    "EntrySpec",
    "MergedRead",
    "ReadMiss",
    "ScheduledRequest",
    "StaleBlockError",
    "StoreCapacityError",
    "StoreStats",
    "TensorStore",
    "TierBlock",
    "WriteResult",
]

_log = logging.getLogger(__name__)

HIDDEN_STATES = "hidden_states"
"""Entry name of the model's hidden states."""

# Fill count of a block whose rows did not arrive in order from offset 0.
_BROKEN = -1

# Writes of at most this many rows take the small-write path: runs, fill
# counts and stamps over Python ints, then one copy op. A decode step writes
# one row per request, and numpy's per-call cost on such tiny arrays made the
# general path cost several times the copy. On CPU (bf16 rows of 64 and 4096
# values, scattered rows or whole blocks) the small path took 0.2-1.0x the
# general path's time up to 256 rows, 0.9-1.2x at 512 and up to 1.6x at 1024.
_SMALL_WRITE_MAX_ROWS = 256

# Slot tensor dtypes `TensorStore.write` accepts.
_SLOT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)

# Widest element types to move rows with, by size in bytes. Scatter and
# gather kernels move one element per step, so viewing a bf16 row as
# complex128 moves 8 values per step: a scattered whole-block write of 64 MiB
# of bf16 rows on CPU ran at 0.33 of a plain copy_ as bf16 and 0.96 as
# complex128. The bits are moved, never converted.
_WIDE_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


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


class ScheduledRequest(NamedTuple):
    """One request's part of a step, in batch order.

    The step's outputs hold ``num_new_tokens`` consecutive rows for each
    request, requests in the order given.
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


class ReadMiss(NamedTuple):
    """A request whose hit blocks did not all hold their expected keys."""

    req_id: str
    num_hit_blocks: int
    # Leading hit blocks that held their keys for every entry read.
    num_valid_blocks: int
    # An entry whose stamp failed at block ``num_valid_blocks``.
    name: str


class TierBlock(NamedTuple):
    """One stamped block of one entry, offered to a `BlockTier`."""

    key: BlockHash
    name: str
    # (block_size, *row_shape) rows on the store's device: a view into the
    # cache, valid only during the `BlockTier.put` call.
    rows: torch.Tensor


class BlockTier(Protocol):
    """What the store asks of a second tier that keeps blocks by key.

    Implementations: `omnicache.tiers.memory.MemoryTier` (in process) and
    `omnicache.tiers.redis.RedisTier`. Neither method raises for a fault of
    the tier itself (unreachable, slow, evicted, corrupt): a fault is a
    counted miss or a counted lost write.
    """

    def put(self, blocks: Sequence[TierBlock]) -> None:
        """Takes blocks to keep; copies their rows before returning."""
        ...

    def get(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> Sequence[Mapping[str, torch.Tensor]]:
        """The rows of the leading ``keys`` the tier holds for every entry.

        Returns:
            One mapping per leading block found whole, first block first (so
            ``len(result) <= len(keys)``): entry name -> ``(block_size,
            *row_shape)`` CPU rows of the entry's dtype, verified to be the
            rows stored under that block key.
        """
        ...


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
    # Tier calls that raised, or returned rows of the wrong shape or dtype
    # (a broken tier: counted, logged, treated as a miss).
    num_tier_errors: int = 0


class _EvictionSource(Protocol):
    num_blocks: int
    block_size: int

    def add_eviction_listener(self, callback: Any) -> None: ...

    def remove_eviction_listener(self, callback: Any) -> None: ...


IntArray = npt.NDArray[np.int64]


@dataclass(slots=True, eq=False)
class _Entry:
    spec: EntrySpec
    dim: int
    cache: torch.Tensor
    flat: torch.Tensor
    # Element type that moves whole rows (see _WIDE_DTYPES).
    wide_dtype: torch.dtype
    filled: npt.NDArray[np.int32]
    # Object array of BlockHash or None: vectorized stamping and checks.
    stamps: npt.NDArray[np.object_]
    # CUDA events of asynchronous copies into ``cache`` not yet waited for.
    pending: list[torch.cuda.Event] = field(default_factory=list)


class _Segments(NamedTuple):
    """A write's slots cut into runs of consecutive slots inside one block."""

    slots: IntArray
    # The slots as a tensor on the caller's device, when one was given.
    slots_tensor: torch.Tensor | None
    # Block, offset in the block and length of each run.
    blocks: IntArray
    offsets: IntArray
    lens: IntArray
    # Whether a block appears in more than one run.
    repeated_blocks: bool
    # Whether every run is one whole block (then ``blocks`` are the targets).
    whole_blocks: bool


class _SmallSegments(NamedTuple):
    """A small write's slots cut into runs, as Python ints (see `_Segments`)."""

    slots: list[int]
    # The caller's slot mapping (tensor or ndarray), for the copy's index;
    # None for a list.
    source: torch.Tensor | IntArray | None
    # Block of each run, and (block, offset in the block, length) of each.
    blocks: list[int]
    runs: list[tuple[int, int, int]]
    repeated_blocks: bool
    # Whether the slots are consecutive: one copy_ moves them all.
    one_run: bool


class _Plan(NamedTuple):
    """A validated write of one entry: applying it cannot fail."""

    entry: _Entry
    rows: torch.Tensor
    segs: _Segments | _SmallSegments


class _MergeLayout(NamedTuple):
    """Index tensors of a merged read, on the store's device (see `_merge_layout`)."""

    # Slot each output row is gathered from (None: no cached rows).
    gather: torch.Tensor | None
    # Output row of each new row read (None: none).
    new_dst: torch.Tensor | None
    # Row of the step's outputs for each of them (None: the first num_new).
    new_src: torch.Tensor | None
    num_new: int
    # Rows of each request read, in batch order.
    num_rows: list[int]


class TensorStore:
    """Per-block tensors for named entries, stamped with the key they hold.

    Args:
        num_blocks: Number of blocks, as in the block pool.
        block_size: Tokens per block, as in the block pool.
        device: ``"cpu"`` or a CUDA device for the cache tensors.
        pin_memory: Pin CPU cache tensors so that copies from CUDA run
            asynchronously; None pins when CUDA is available.
        hidden_size: Declares `HIDDEN_STATES` up front with this many values
            per token (otherwise it is created by its first write).
        hidden_dtype: Its dtype; required with ``hidden_size``.
        max_bytes: Cap on the bytes of all cache tensors together (None: no
            cap); `register` raises `StoreCapacityError` beyond it.
        tier: A second tier: stamped blocks are offered to it, and
            `read_through` fills blocks from it (None: no tier).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
        hidden_size: int | None = None,
        hidden_dtype: torch.dtype | None = None,
        max_bytes: int | None = None,
        tier: BlockTier | None = None,
    ) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        dev = _parse_device(device)
        if pin_memory is None:
            pin = dev.type == "cpu" and torch.cuda.is_available()
        elif type(pin_memory) is not bool:
            raise TypeError(f"pin_memory: expected bool or None, found {type(pin_memory).__name__}")
        else:
            pin = pin_memory
        if pin and dev.type != "cpu":
            raise ValueError(f"pin_memory: expected False for device {dev}, found True")
        if pin and not torch.cuda.is_available():
            raise ValueError("pin_memory: expected False or None without CUDA, found True")
        if max_bytes is not None:
            if type(max_bytes) is not int:
                raise TypeError(
                    f"max_bytes: expected int or None, found {type(max_bytes).__name__}"
                )
            if max_bytes < 0:
                raise ValueError(f"max_bytes: expected >= 0, found {max_bytes}")
        if (hidden_size is None) != (hidden_dtype is None):
            raise ValueError(
                "hidden_size and hidden_dtype: expected both or neither, found "
                f"hidden_size={hidden_size}, hidden_dtype={hidden_dtype}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.device = dev
        self._on_cpu = dev.type == "cpu"
        self.pin_memory = pin
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        # req_id -> entry name -> chunks (first token position, rows) in staging order.
        self._staged: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
        self._stats = StoreStats()
        if tier is not None and not (
            callable(getattr(tier, "put", None)) and callable(getattr(tier, "get", None))
        ):
            raise TypeError(
                f"tier: expected a BlockTier (put and get methods) or None, "
                f"found {type(tier).__name__}"
            )
        self.tier = tier
        if hidden_size is not None and hidden_dtype is not None:
            self.register(HIDDEN_STATES, hidden_size, hidden_dtype)

    # -- entries ------------------------------------------------------------

    def register(
        self,
        name: str,
        dim: int | Sequence[int],
        dtype: torch.dtype,
        *,
        deferred: bool = False,
    ) -> EntrySpec:
        """Declares an entry of ``dim`` values of ``dtype`` per token.

        Registering the same spec again returns it unchanged.

        Args:
            name: Entry name.
            dim: Values per token, or the per-token shape.
            dtype: Element type.
            deferred: Rows are staged per request and written by `commit`.

        Returns:
            The entry's spec.

        Raises:
            ValueError: A bad argument, or ``name`` registered differently.
            StoreCapacityError: The entry does not fit under ``max_bytes``.
        """
        spec = self._make_spec(name, dim, dtype, deferred)
        existing = self._entries.get(name)
        if existing is not None:
            if existing.spec != spec:
                raise ValueError(
                    f"entry {name!r}: already registered as {_describe(existing.spec)}, "
                    f"found {_describe(spec)}"
                )
            return spec
        self._check_capacity([spec])
        self._create(spec)
        return spec

    @property
    def entries(self) -> dict[str, EntrySpec]:
        """Registered entries by name, in registration order."""
        return {name: entry.spec for name, entry in self._entries.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of all cache tensors (what ``max_bytes`` caps)."""
        return sum(entry.spec.nbytes for entry in self._entries.values())

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    def stamp_of(self, name: str, block_id: int) -> BlockHash | None:
        """Returns the key block ``block_id`` holds for entry ``name``, or None."""
        entry = self._entry(name)
        self._check_block_id("block_id", block_id)
        stamp: BlockHash | None = entry.stamps[block_id]
        return stamp

    # -- block pool ----------------------------------------------------------

    def attach(self, pool: _EvictionSource) -> None:
        """Subscribes `on_block_evicted` to ``pool``'s evictions.

        Raises:
            ValueError: The pool's geometry differs from the store's.
        """
        if pool.num_blocks != self.num_blocks or pool.block_size != self.block_size:
            raise ValueError(
                f"pool: expected {self.num_blocks} blocks of {self.block_size} tokens, found "
                f"{pool.num_blocks} blocks of {pool.block_size} tokens"
            )
        pool.add_eviction_listener(self.on_block_evicted)

    def detach(self, pool: _EvictionSource) -> None:
        """Stops listening to ``pool``'s evictions."""
        pool.remove_eviction_listener(self.on_block_evicted)

    def on_block_evicted(self, block_id: int, key: BlockHash) -> None:
        """Eviction listener: block ``block_id`` lost ``key`` and gets a new owner.

        Its stamps and fill counts are cleared for every entry, whatever key
        they held: the next owner's rows start a new run.
        """
        self._check_block_id("block_id", block_id)
        for entry in self._entries.values():
            if entry.stamps[block_id] is not None:
                entry.stamps[block_id] = None
                self._stats.num_evicted_stamps += 1
            entry.filled[block_id] = 0

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Clears stamps and fill counts of ``block_ids`` for every entry."""
        ids = self._block_id_array("block_ids", list(block_ids), distinct=False)
        for entry in self._entries.values():
            entry.stamps[ids] = None
            entry.filled[ids] = 0

    def invalidate_all(self) -> None:
        """Clears every stamp and fill count (staged rows stay)."""
        for entry in self._entries.values():
            entry.stamps[:] = None
            entry.filled[:] = 0

    # -- writes -------------------------------------------------------------

    def write(
        self,
        name: str,
        rows: torch.Tensor,
        slot_mapping: object,
        *,
        block_keys: Mapping[int, BlockHash] | None = None,
        num_tokens: int | None = None,
    ) -> WriteResult:
        """Writes ``rows[i]`` into slot ``slot_mapping[i]`` of entry ``name``.

        Args:
            name: A registered entry.
            rows: ``(n, *row_shape)`` rows of the entry's dtype, n >= num_tokens.
            slot_mapping: ``block_id * block_size + offset`` per row: an
                integer tensor (a CPU one avoids a device sync), ndarray or
                sequence.
            block_keys: Keys of blocks this write may complete (block id ->
                key); a touched block whose rows become complete is stamped
                with its key. Keys of untouched blocks have no effect.
            num_tokens: Rows to write (default: all of ``slot_mapping``);
                later slots and rows are padding.

        Returns:
            The stamped blocks and the keyed blocks left incomplete.

        Raises:
            ValueError, IndexError, TypeError: Bad input; nothing is written.
        """
        entry = self._entry(name)
        segs: _Segments | _SmallSegments | None = self._small_segments(slot_mapping, num_tokens)
        if segs is None:
            segs = self._segments(*self._slots(slot_mapping, num_tokens))
        _check_rows(entry.spec, rows, len(segs.slots))
        keys = _check_block_keys(block_keys, self.num_blocks)
        if type(segs) is _SmallSegments and not (rows.is_cuda and self._on_cpu):
            return self._apply_small(entry, rows, segs, keys)
        return self._apply(_Plan(entry, rows, segs), keys)

    def write_blocks(
        self,
        name: str,
        rows: torch.Tensor,
        block_ids: Sequence[int],
        *,
        block_keys: Sequence[BlockHash] | None = None,
    ) -> WriteResult:
        """Writes whole blocks: ``rows[i * block_size + j]`` to offset j of ``block_ids[i]``.

        Args:
            name: A registered entry.
            rows: ``(len(block_ids) * block_size, *row_shape)`` rows.
            block_ids: Distinct blocks.
            block_keys: The key of each block, aligned with ``block_ids``
                (None: the blocks stay unstamped).

        Returns:
            As `write`.
        """
        ids = self._block_id_array("block_ids", block_ids)
        if block_keys is not None and len(block_keys) != len(ids):
            raise ValueError(
                f"block_keys: expected {len(ids)} keys (one per block), found {len(block_keys)}"
            )
        slots = (ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        keys = None if block_keys is None else dict(zip(ids.tolist(), block_keys, strict=True))
        return self.write(name, rows, slots, block_keys=keys)

    def write_outputs(
        self,
        slot_mapping: object,
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        block_keys: Mapping[int, BlockHash] | None = None,
        num_tokens: int | None = None,
        num_tokens_padded: int | None = None,
    ) -> dict[str, WriteResult]:
        """Writes one step's hidden states and per-token multimodal outputs.

        A multimodal output is per-token, and cached, when it is a registered
        entry or a tensor with 2 or more dims whose first dim is
        ``num_tokens_padded``; such a tensor of an unknown name creates its
        entry. Everything else (1-D per-request metadata, lists, ...) is not
        cached. Deferred entries are skipped here (see `stage_outputs`).

        Args:
            slot_mapping: Slot per scheduled token (see `write`).
            hidden_states: ``(>= num_tokens, hidden)`` rows.
            multimodal_outputs: The model's multimodal outputs by name.
            block_keys: As in `write`, for every entry.
            num_tokens: Tokens to write (default: all of ``slot_mapping``).
            num_tokens_padded: Rows the model produced, padding included
                (default: ``num_tokens``).

        Returns:
            The result of each entry written, by name.

        Raises:
            ValueError, IndexError, TypeError, StoreCapacityError: Bad input or
                no room for a new entry; nothing is created or written.
        """
        segs: _Segments | _SmallSegments | None = self._small_segments(slot_mapping, num_tokens)
        if segs is None:
            segs = self._segments(*self._slots(slot_mapping, num_tokens))
        num_rows = len(segs.slots)
        padded = num_rows if num_tokens_padded is None else num_tokens_padded
        if type(padded) is not int or padded < num_rows:
            raise ValueError(f"num_tokens_padded: expected int >= {num_rows}, found {padded}")
        outputs = _merge_outputs(hidden_states, multimodal_outputs)
        new_specs: list[EntrySpec] = []
        todo: list[tuple[EntrySpec, torch.Tensor]] = []
        for name, value in outputs.items():
            existing = self._entries.get(name)
            if existing is not None:
                if existing.spec.deferred:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"outputs[{name!r}]: expected torch.Tensor for a cached entry, "
                        f"found {type(value).__name__}"
                    )
                todo.append((existing.spec, value))
            elif name == HIDDEN_STATES or _is_per_token(value, padded):
                # NOTE: hidden states are always cached: anything but a tensor
                # here is an error, never passed through as metadata.
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"outputs[{name!r}]: expected torch.Tensor, found {type(value).__name__}"
                    )
                if value.ndim < 2:
                    raise ValueError(
                        f"outputs[{name!r}]: expected (tokens, hidden) rows, found "
                        f"shape {tuple(value.shape)}"
                    )
                spec = self._make_spec(name, tuple(value.shape[1:]), value.dtype, False)
                new_specs.append(spec)
                todo.append((spec, value))
        for spec, value in todo:
            _check_rows(spec, value, num_rows)
        keys = _check_block_keys(block_keys, self.num_blocks)
        self._check_capacity(new_specs)
        # Every check passed: create the new entries, then write.
        for spec in new_specs:
            self._create(spec)
        return {
            spec.name: self._apply(_Plan(self._entries[spec.name], value, segs), keys)
            for spec, value in todo
        }

    # -- deferred entries ----------------------------------------------------

    def stage(self, req_id: str, name: str, rows: torch.Tensor, *, token_start: int) -> None:
        """Keeps rows of deferred entry ``name`` for tokens ``token_start ..`` of a request.

        The rows are copied on their own device (the model may reuse its
        output buffers); `commit` writes them, `discard` drops them.
        """
        entry = self._entry(name)
        if not entry.spec.deferred:
            raise ValueError(f"entry {name!r}: expected a deferred entry, found a direct one")
        if not isinstance(req_id, str):
            raise TypeError(f"req_id: expected str, found {type(req_id).__name__}")
        if type(token_start) is not int or token_start < 0:
            raise ValueError(f"token_start: expected int >= 0, found {token_start}")
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows: expected torch.Tensor, found {type(rows).__name__}")
        _check_rows(entry.spec, rows, int(rows.shape[0]) if rows.ndim else 0)
        if rows.shape[0] == 0:
            return
        chunk = rows.detach().clone()
        self._staged.setdefault(req_id, {}).setdefault(name, []).append((token_start, chunk))
        self._stats.num_staged_bytes += chunk.numel() * chunk.element_size()

    def stage_outputs(
        self,
        requests: Sequence[ScheduledRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
    ) -> None:
        """Stages each request's rows of every deferred entry in the outputs.

        Request i's rows follow those of requests 0 .. i-1 in each output;
        they belong to tokens ``num_computed_tokens ..`` of the request.
        """
        outputs = _merge_outputs(hidden_states, multimodal_outputs)
        spans = self._spans(requests)
        total = spans[-1][1] if spans else 0
        todo: list[tuple[str, torch.Tensor]] = []
        for name, value in outputs.items():
            existing = self._entries.get(name)
            if existing is None or not existing.spec.deferred:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"outputs[{name!r}]: expected torch.Tensor, found {type(value).__name__}"
                )
            _check_rows(existing.spec, value, total)
            todo.append((name, value))
        for name, value in todo:
            for request, (start, stop) in zip(requests, spans, strict=True):
                if stop > start:
                    self.stage(
                        request.req_id,
                        name,
                        value[start:stop],
                        token_start=request.num_computed_tokens,
                    )

    def has_staged(self, req_id: str) -> bool:
        """Whether ``req_id`` has rows waiting for `commit`."""
        return req_id in self._staged

    def commit(
        self,
        req_id: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
    ) -> dict[str, WriteResult]:
        """Writes a finished request's staged rows into its blocks.

        Call it before the request's block table is released.

        Args:
            req_id: A request with staged rows (`has_staged`).
            block_ids: The request's blocks, first block first.
            block_keys: Keys of its full blocks, first block first (at most
                ``len(block_ids)``); completed blocks are stamped with them.

        Returns:
            The merged result of each entry written, by name.

        Raises:
            ValueError: Unknown request, or staged tokens beyond its blocks;
                then nothing is written and the rows stay staged.
        """
        per_entry = self._staged.get(req_id)
        if per_entry is None:
            raise ValueError(
                f"req_id: expected a request with staged rows, found {req_id!r} "
                f"({len(self._staged)} requests staged)"
            )
        ids = self._block_id_array("block_ids", block_ids)
        if len(block_keys) > len(ids):
            raise ValueError(
                f"block_keys: expected at most {len(ids)} keys (one per block), "
                f"found {len(block_keys)}"
            )
        keys = _check_block_keys(dict(zip(ids.tolist(), block_keys, strict=False)), self.num_blocks)
        bs = self.block_size
        num_positions = len(ids) * bs
        plans: list[_Plan] = []
        for name, chunks in per_entry.items():
            entry = self._entries[name]
            for token_start, chunk in chunks:
                stop = token_start + int(chunk.shape[0])
                if stop > num_positions:
                    raise ValueError(
                        f"entry {name!r}: staged tokens {token_start}..{stop - 1} of request "
                        f"{req_id!r}: expected tokens below {num_positions} "
                        f"({len(ids)} blocks of {bs})"
                    )
                positions = np.arange(token_start, stop, dtype=np.int64)
                slots = ids[positions // bs] * bs + positions % bs
                plans.append(_Plan(entry, chunk, self._segments(slots, None)))
        del self._staged[req_id]
        self._stats.num_staged_bytes -= _staged_bytes(per_entry)
        results: dict[str, WriteResult] = {}
        for plan in plans:
            result = self._apply(plan, keys)
            name = plan.entry.spec.name
            prev = results.get(name)
            results[name] = result if prev is None else _merge_results(prev, result)
        return results

    def discard(self, req_id: str) -> int:
        """Drops an aborted request's staged rows.

        Returns:
            The number of bytes dropped.

        Raises:
            ValueError: ``req_id`` has nothing staged.
        """
        per_entry = self._staged.pop(req_id, None)
        if per_entry is None:
            raise ValueError(
                f"req_id: expected a request with staged rows, found {req_id!r} "
                f"({len(self._staged)} requests staged)"
            )
        num_bytes = _staged_bytes(per_entry)
        self._stats.num_staged_bytes -= num_bytes
        return num_bytes

    # -- reads --------------------------------------------------------------

    def probe(
        self,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        names: Iterable[str] | None = None,
    ) -> int:
        """Returns how many leading blocks hold their keys for every entry.

        Args:
            block_ids: Blocks of a prefix hit, first block first.
            block_keys: The key each block is expected to hold.
            names: Entries to check (default: every registered entry).
        """
        entries = self._entries_named(names)
        ids = self._hit_blocks(block_ids, block_keys)
        num_valid, _ = _num_valid(entries, ids, block_keys)
        return num_valid

    def read_blocks(
        self,
        name: str,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the rows of whole blocks that must hold the given keys.

        Args:
            name: A registered entry.
            block_ids: Blocks to read, in order.
            block_keys: The key each block must hold.
            out: Optional ``(>= len(block_ids) * block_size, *row_shape)``
                buffer of the entry's dtype on the store's device.

        Returns:
            ``(len(block_ids) * block_size, *row_shape)`` rows.

        Raises:
            StaleBlockError: A block does not hold its key (counted).
        """
        entry = self._entry(name)
        ids = self._hit_blocks(block_ids, block_keys)
        num_rows = len(ids) * self.block_size
        if out is not None:
            _check_out(entry.spec, out, num_rows, self.device, "out")
        num_valid, missed = _num_valid([entry], ids, block_keys)
        if missed is not None:
            block_id = missed[1]
            self._stats.num_stale_reads += 1
            raise StaleBlockError(
                name, block_id, num_valid, block_keys[num_valid], entry.stamps[block_id]
            )
        buf = out if out is not None else self._empty(entry, num_rows)
        flat_out = buf.view(-1, entry.dim)[:num_rows]
        self._sync(entry)
        self._gather_blocks(entry, ids, flat_out)
        self._stats.num_hit_blocks_read += len(ids)
        return flat_out.view(num_rows, *entry.spec.row_shape)

    def read_through(
        self,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        names: Iterable[str] | None = None,
    ) -> int:
        """Fills newly allocated blocks from the tier with the rows of their keys.

        Call it on a local miss, with blocks just allocated for the keys that
        follow the local hit: the tier's leading run of blocks held whole
        (every entry of ``names``) is copied in and stamped, as if computed
        here. When the tier is asked, every given block loses its previous
        stamps and fill counts for every entry, filled or not; without a tier,
        or with no entry to fill, nothing changes.

        Args:
            block_ids: Distinct blocks, one per key, first block first.
            block_keys: The chained keys to look up, first block first.
            names: Entries to fill (default: every registered entry); other
                entries of the filled blocks stay unstamped.

        Returns:
            How many leading blocks were filled (0 without a tier, or when the
            tier misses, is down or fails).
        """
        entries = self._entries_named(names)
        ids = self._hit_blocks(block_ids, block_keys, distinct=True)
        tier = self.tier
        if tier is None or not len(ids) or not entries:
            return 0
        specs = [entry.spec for entry in entries]
        self._stats.num_tier_queried_blocks += len(ids)
        try:
            found = list(tier.get(list(block_keys), specs, self.block_size))
            blocks = _checked_tier_rows(found, specs, self.block_size, len(ids))
        except Exception as exc:
            # NOTE: a tier promises not to raise; one that does costs a miss,
            # never a failed request.
            self._stats.num_tier_errors += 1
            _log.warning("tier %s failed a read, served as a miss: %r", type(tier).__name__, exc)
            blocks = []
        self.invalidate(ids)
        num_found = len(blocks)
        bs = self.block_size
        for index, rows_by_name in enumerate(blocks):
            block_id = int(ids[index])
            key = block_keys[index]
            for entry in entries:
                rows = rows_by_name[entry.spec.name].reshape(bs, entry.dim)
                self._sync(entry)
                entry.cache[block_id].copy_(rows)
                entry.stamps[block_id] = key
                entry.filled[block_id] = bs
        self._stats.num_tier_hit_blocks += num_found
        return num_found

    def new_read_buffers(
        self, num_rows: int, names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Allocates ``out`` buffers for `read_merged` (reuse them across steps).

        Args:
            num_rows: Rows per buffer: at least the cached plus new rows of
                every request read at once.
            names: Entries (default: every registered entry).
        """
        if type(num_rows) is not int or num_rows < 0:
            raise ValueError(f"num_rows: expected int >= 0, found {num_rows}")
        return {
            entry.spec.name: self._empty(entry, num_rows).view(num_rows, *entry.spec.row_shape)
            for entry in self._entries_named(names)
        }

    def read_merged(
        self,
        requests: Sequence[ScheduledRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        strict: bool = False,
    ) -> MergedRead:
        """Per request, the rows of its hit blocks followed by this step's rows.

        Every output that is a registered entry is merged; other outputs are
        returned unchanged in ``passthrough``. Rows are gathered into one
        buffer per entry (``out[name]`` when given, else a new one).

        Args:
            requests: The step's requests in batch order (see
                `ScheduledRequest`); a request without hit blocks gets its
                new rows only.
            hidden_states: This step's hidden states, requests' rows in order.
            multimodal_outputs: This step's multimodal outputs by name.
            out: Buffers by entry name, each ``(>= total rows, *row_shape)``
                of the entry's dtype on the store's device.
            strict: Raise `StaleBlockError` on a stale block instead of
                reporting the request in ``misses``.

        Returns:
            The merged rows, passthrough outputs and misses.
        """
        outputs = _merge_outputs(hidden_states, multimodal_outputs)
        spans = self._spans(requests)
        total_new = spans[-1][1] if spans else 0
        hit_ids = [self._hit_block_list(r.hit_block_ids, r.hit_block_keys) for r in requests]
        entries: list[tuple[_Entry, torch.Tensor]] = []
        passthrough: dict[str, object] = {}
        for name, value in outputs.items():
            entry = self._entries.get(name)
            if entry is None:
                passthrough[name] = value
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"outputs[{name!r}]: expected torch.Tensor for a cached entry, "
                    f"found {type(value).__name__}"
                )
            _check_rows(entry.spec, value, total_new)
            entries.append((entry, value))
        live = [entry for entry, _ in entries]
        misses: list[ReadMiss] = []
        # Output row offset of each request that is read, None for a miss.
        offsets: list[int | None] = []
        total_rows = 0
        for request, ids in zip(requests, hit_ids, strict=True):
            num_valid, missed = _num_valid_list(live, ids, request.hit_block_keys)
            if missed is not None:
                entry, block_id = missed
                if strict:
                    self._stats.num_stale_reads += 1
                    raise StaleBlockError(
                        entry.spec.name,
                        block_id,
                        num_valid,
                        request.hit_block_keys[num_valid],
                        entry.stamps[block_id],
                        request.req_id,
                    )
                misses.append(ReadMiss(request.req_id, len(ids), num_valid, entry.spec.name))
                offsets.append(None)
                continue
            offsets.append(total_rows)
            total_rows += len(ids) * self.block_size + request.num_new_tokens
        if out is not None:
            for entry, _ in entries:
                name = entry.spec.name
                if name not in out:
                    raise ValueError(f"out: expected a buffer for entry {name!r}, found none")
                _check_out(entry.spec, out[name], total_rows, self.device, f"out[{name!r}]")
        # Every check passed.
        self._stats.num_read_requests += len(requests)
        self._stats.num_stale_reads += len(misses)
        self._stats.num_hit_blocks_read += sum(
            len(ids) for ids, offset in zip(hit_ids, offsets, strict=True) if offset is not None
        )
        layout = self._merge_layout(hit_ids, spans, offsets, total_new, total_rows)
        read_ids = [
            r.req_id for r, offset in zip(requests, offsets, strict=True) if offset is not None
        ]
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for entry, value in entries:
            self._sync(entry)
            buf = out[entry.spec.name] if out is not None else self._empty(entry, total_rows)
            flat_out = buf.view(-1, entry.dim)[:total_rows]
            self._merge_into(entry, flat_out, value, layout, spans, offsets, hit_ids)
            # NOTE: one split makes every request's view; the requests read
            # lie back to back in the buffer, in batch order.
            shaped = flat_out.view(total_rows, *entry.spec.row_shape)
            views = shaped.split_with_sizes(layout.num_rows) if read_ids else ()
            tensors[entry.spec.name] = dict(zip(read_ids, views, strict=True))
        if self.pin_memory and any(v.is_cuda for _, v in entries):
            # NOTE: new rows were copied from CUDA asynchronously; the caller
            # reads the buffers on the CPU right away.
            torch.cuda.current_stream().synchronize()
        return MergedRead(tensors, passthrough, tuple(misses))

    def _merge_layout(
        self,
        hit_ids: Sequence[list[int]],
        spans: Sequence[tuple[int, int]],
        offsets: Sequence[int | None],
        total_new: int,
        total_rows: int,
    ) -> _MergeLayout:
        """Where a merged read's rows come from, shared by its entries.

        NOTE: the cached rows of every request are one gather, and the new
        rows one indexed copy, not one op per request: each parallel op wakes
        the thread pool, which on a loaded host costs more than a small copy,
        and per-request work was most of a decode step's read. Rows that will
        take this step's rows gather slot 0 and are overwritten.
        """
        bs = self.block_size
        cached_ids: list[int] = []
        # Per request read: output offset, cached rows, new rows, first new row.
        read_offsets: list[int] = []
        num_cached: list[int] = []
        num_new: list[int] = []
        new_starts: list[int] = []
        for ids, (start, stop), offset in zip(hit_ids, spans, offsets, strict=True):
            if offset is None:
                continue
            cached_ids += ids
            read_offsets.append(offset)
            num_cached.append(len(ids) * bs)
            num_new.append(stop - start)
            new_starts.append(start)
        num_rows = [c + n for c, n in zip(num_cached, num_new, strict=True)]
        gather: torch.Tensor | None = None
        if cached_ids:
            block_slots = (
                np.array(cached_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)
            ).reshape(-1)
            positions = _ranges(
                np.array(read_offsets, dtype=np.int64), np.array(num_cached, dtype=np.int64)
            )
            index = np.zeros(total_rows, dtype=np.int64)
            index[positions] = block_slots
            gather = self._to_device(torch.from_numpy(index))
        new_dst: torch.Tensor | None = None
        new_src: torch.Tensor | None = None
        num_new_read = sum(num_new)
        if num_new_read:
            counts = np.array(num_new, dtype=np.int64)
            first_new = np.array(read_offsets, dtype=np.int64) + np.array(
                num_cached, dtype=np.int64
            )
            new_dst = self._to_device(torch.from_numpy(_ranges(first_new, counts)))
            if num_new_read != total_new:
                # Requests that missed leave their rows out.
                new_src = self._to_device(
                    torch.from_numpy(_ranges(np.array(new_starts, dtype=np.int64), counts))
                )
        return _MergeLayout(gather, new_dst, new_src, num_new_read, num_rows)

    def _merge_into(
        self,
        entry: _Entry,
        flat_out: torch.Tensor,
        value: torch.Tensor,
        layout: _MergeLayout,
        spans: Sequence[tuple[int, int]],
        offsets: Sequence[int | None],
        hit_ids: Sequence[list[int]],
    ) -> None:
        if layout.gather is not None:
            dst_w, src_w = _widen_pair(entry, flat_out, entry.flat)
            torch.index_select(src_w, 0, layout.gather, out=dst_w)
        if layout.new_dst is None:
            return
        new_rows = value.detach().reshape(value.shape[0], entry.dim)
        dst_w, src_w = _widen_pair(entry, flat_out, new_rows)
        if new_rows.device == flat_out.device:
            src = (
                src_w[: layout.num_new]
                if layout.new_src is None
                else src_w.index_select(0, layout.new_src)
            )
            dst_w.index_copy_(0, layout.new_dst, src)
            return
        # NOTE: across devices each request's rows are one (asynchronous) DMA copy.
        bs = self.block_size
        for ids, (start, stop), offset in zip(hit_ids, spans, offsets, strict=True):
            if offset is not None and stop > start:
                first = offset + len(ids) * bs
                dst_w[first : first + stop - start].copy_(
                    src_w[start:stop], non_blocking=self.pin_memory
                )

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        return index if self._on_cpu else index.to(self.device)

    def synchronize(self) -> None:
        """Waits for every asynchronous copy into the cache tensors."""
        for entry in self._entries.values():
            self._sync(entry)

    # -- internals ----------------------------------------------------------

    def _make_spec(
        self, name: str, dim: int | Sequence[int], dtype: torch.dtype, deferred: bool
    ) -> EntrySpec:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, found {name!r}")
        if isinstance(dim, int) and not isinstance(dim, bool):
            row_shape: tuple[int, ...] = (dim,)
        elif isinstance(dim, Sequence) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in dim
        ):
            row_shape = tuple(dim)
        else:
            raise TypeError(f"dim: expected int or sequence of int, found {type(dim).__name__}")
        if not row_shape or any(d < 1 for d in row_shape):
            raise ValueError(f"dim: expected positive sizes, found {row_shape}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected torch.dtype, found {type(dtype).__name__}")
        if type(deferred) is not bool:
            raise TypeError(f"deferred: expected bool, found {type(deferred).__name__}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = self.num_slots * math.prod(row_shape) * itemsize
        return EntrySpec(name, row_shape, dtype, deferred, nbytes)

    def _check_capacity(self, specs: Sequence[EntrySpec]) -> None:
        if self.max_bytes is None or not specs:
            return
        used = self.nbytes
        need = sum(spec.nbytes for spec in specs)
        if used + need > self.max_bytes:
            names = ", ".join(repr(spec.name) for spec in specs)
            raise StoreCapacityError(
                f"entries {names}: need {need} bytes, {self.max_bytes - used} available "
                f"(max_bytes={self.max_bytes}, {used} used by {list(self._entries)})"
            )

    def _create(self, spec: EntrySpec) -> None:
        dim = math.prod(spec.row_shape)
        cache = torch.zeros(
            (self.num_blocks, self.block_size, dim),
            dtype=spec.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        )
        row_bytes = dim * cache.element_size()
        wide_dtype, wide_size = spec.dtype, cache.element_size()
        for size, candidate in _WIDE_DTYPES:
            if size > wide_size and row_bytes % size == 0:
                wide_dtype, wide_size = candidate, size
                break
        self._entries[spec.name] = _Entry(
            spec=spec,
            dim=dim,
            cache=cache,
            flat=cache.view(self.num_slots, dim),
            wide_dtype=wide_dtype,
            filled=np.zeros(self.num_blocks, dtype=np.int32),
            stamps=np.full(self.num_blocks, None, dtype=object),
        )

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(
                f"name: expected a registered entry {list(self._entries)}, found {name!r}"
            )
        return entry

    def _entries_named(self, names: Iterable[str] | None) -> list[_Entry]:
        if names is None:
            return list(self._entries.values())
        if isinstance(names, str):
            raise TypeError("names: expected an iterable of entry names, found str")
        return [self._entry(name) for name in names]

    def _check_block_id(self, what: str, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise TypeError(f"{what}: expected int, found {type(block_id).__name__}")
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"{what}: expected 0..{self.num_blocks - 1}, found {block_id}")

    def _block_id_array(
        self, what: str, block_ids: Sequence[int], *, distinct: bool = True
    ) -> IntArray:
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"{what}: expected a flat sequence of int, found {block_ids!r}")
        if not ids.size:
            return ids.astype(np.int64)
        # NOTE: contiguous, as the gathers index with it (see _slots).
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            index = int(np.flatnonzero((ids < 0) | (ids >= self.num_blocks))[0])
            raise IndexError(
                f"{what}[{index}]: expected 0..{self.num_blocks - 1}, found {int(ids[index])}"
            )
        if distinct and np.bincount(ids).max() > 1:
            raise ValueError(f"{what}: expected distinct blocks, found {ids.tolist()}")
        return ids

    def _hit_blocks(
        self,
        block_ids: Sequence[int],
        block_keys: Sequence[BlockHash],
        *,
        distinct: bool = False,
    ) -> IntArray:
        """The blocks as an id array, checked with their keys.

        A block may repeat unless ``distinct``: reading it twice is harmless,
        filling it twice is not.
        """
        if len(block_ids) != len(block_keys):
            raise ValueError(
                f"block_keys: expected {len(block_ids)} keys (one per block), "
                f"found {len(block_keys)}"
            )
        if not all(issubclass(t, bytes) for t in set(map(type, block_keys))):
            for index, key in enumerate(block_keys):
                if not isinstance(key, bytes):
                    raise TypeError(
                        f"block_keys[{index}]: expected bytes, found {type(key).__name__}"
                    )
        return self._block_id_array("block_ids", block_ids, distinct=distinct)

    def _hit_block_list(
        self, block_ids: Sequence[int], block_keys: Sequence[BlockHash]
    ) -> list[int]:
        """`_hit_blocks` as a list; lists and tuples of a few ints skip numpy.

        NOTE: input the quick checks do not accept goes through `_hit_blocks`,
        which raises the errors.
        """
        if type(block_ids) in (list, tuple) and len(block_ids) == len(block_keys):
            if not block_ids:
                return []
            if (
                set(map(type, block_ids)) == {int}
                and min(block_ids) >= 0
                and max(block_ids) < self.num_blocks
                and all(issubclass(t, bytes) for t in set(map(type, block_keys)))
            ):
                return list(block_ids)
        ids: list[int] = self._hit_blocks(block_ids, block_keys).tolist()
        return ids

    def _spans(self, requests: Sequence[ScheduledRequest]) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        start = 0
        seen: set[str] = set()
        for index, request in enumerate(requests):
            if not isinstance(request, ScheduledRequest):
                raise TypeError(
                    f"requests[{index}]: expected ScheduledRequest, found {type(request).__name__}"
                )
            n = request.num_new_tokens
            if type(n) is not int or n < 0:
                raise ValueError(f"requests[{index}].num_new_tokens: expected int >= 0, found {n}")
            computed = request.num_computed_tokens
            if type(computed) is not int or computed < 0:
                raise ValueError(
                    f"requests[{index}].num_computed_tokens: expected int >= 0, found {computed}"
                )
            if not isinstance(request.req_id, str):
                raise TypeError(
                    f"requests[{index}].req_id: expected str, found {type(request.req_id).__name__}"
                )
            if request.req_id in seen:
                raise ValueError(f"requests[{index}]: request {request.req_id!r} listed twice")
            seen.add(request.req_id)
            spans.append((start, start + n))
            start += n
        return spans

    def _slots(
        self, slot_mapping: object, num_tokens: int | None
    ) -> tuple[IntArray, torch.Tensor | None]:
        """Returns the slots as int64 host array, and as a device tensor if one was given."""
        device_tensor: torch.Tensor | None = None
        if isinstance(slot_mapping, torch.Tensor):
            if slot_mapping.dtype not in (
                torch.int64,
                torch.int32,
                torch.int16,
                torch.uint8,
                torch.int8,
            ):
                raise TypeError(
                    f"slot_mapping: expected an integer tensor, found dtype {slot_mapping.dtype}"
                )
            if slot_mapping.ndim != 1:
                raise ValueError(
                    f"slot_mapping: expected 1 dim, found shape {tuple(slot_mapping.shape)}"
                )
            if slot_mapping.device.type != "cpu":
                device_tensor = slot_mapping
            host = slot_mapping.detach().cpu().numpy()
        elif isinstance(slot_mapping, np.ndarray):
            host = slot_mapping
        elif isinstance(slot_mapping, Sequence) and not isinstance(slot_mapping, (str, bytes)):
            host = np.asarray(slot_mapping)
            if host.size == 0:
                host = host.astype(np.int64)
        else:
            raise TypeError(
                "slot_mapping: expected torch.Tensor, numpy.ndarray or sequence of int, "
                f"found {type(slot_mapping).__name__}"
            )
        if host.ndim != 1:
            raise ValueError(f"slot_mapping: expected 1 dim, found shape {host.shape}")
        if host.dtype.kind not in "iu":
            raise TypeError(f"slot_mapping: expected integers, found dtype {host.dtype}")
        n = len(host) if num_tokens is None else num_tokens
        if type(n) is not int or not 0 <= n <= len(host):
            raise ValueError(f"num_tokens: expected int in 0..{len(host)}, found {num_tokens}")
        # NOTE: contiguous, so that the copy can index with it (a reversed
        # view has negative strides, which torch.from_numpy refuses).
        slots = np.ascontiguousarray(host[:n], dtype=np.int64)
        bad = np.flatnonzero((slots < 0) | (slots >= self.num_slots))
        if bad.size:
            index = int(bad[0])
            raise IndexError(
                f"slot_mapping[{index}]: expected 0..{self.num_slots - 1}, "
                f"found {int(slots[index])}"
            )
        if device_tensor is not None:
            device_tensor = device_tensor[:n]
        return slots, device_tensor

    def _segments(self, slots: IntArray, slots_tensor: torch.Tensor | None) -> _Segments:
        """Cuts ``slots`` into runs; rejects a slot given twice."""
        n = len(slots)
        bs = self.block_size
        if n and n % bs == 0:
            # Fast path for whole blocks (a prefill, a commit, a block load):
            # every row of ``by_block`` is one block's slots in order.
            by_block = slots.reshape(-1, bs)
            first = by_block[:, 0]
            if not (first % bs).any() and (by_block - first[:, None] == np.arange(bs)).all():
                blocks = first // bs
                if int(np.bincount(blocks).max()) > 1:
                    _raise_duplicate_slot(slots)
                num_blocks = len(blocks)
                return _Segments(
                    slots=slots,
                    slots_tensor=slots_tensor,
                    blocks=blocks,
                    offsets=np.zeros(num_blocks, dtype=np.int64),
                    lens=np.full(num_blocks, bs, dtype=np.int64),
                    repeated_blocks=False,
                    whole_blocks=True,
                )
        blocks, offsets = np.divmod(slots, bs)
        if n:
            brk = np.empty(n, dtype=bool)
            brk[0] = True
            np.not_equal(np.diff(slots), 1, out=brk[1:])
            brk[1:] |= offsets[1:] == 0
            starts = np.flatnonzero(brk)
        else:
            starts = np.zeros(0, dtype=np.int64)
        seg_blocks = blocks[starts]
        # NOTE: runs hold distinct slots of one block each, so a slot can
        # repeat only where a block starts more than one run.
        repeated = bool(n) and int(np.bincount(seg_blocks).max()) > 1
        if repeated and len(np.unique(slots)) != n:
            _raise_duplicate_slot(slots)
        return _Segments(
            slots=slots,
            slots_tensor=slots_tensor,
            blocks=seg_blocks,
            offsets=offsets[starts],
            lens=np.diff(np.append(starts, n)),
            repeated_blocks=repeated,
            whole_blocks=False,
        )

    def _small_segments(
        self, slot_mapping: object, num_tokens: int | None
    ) -> _SmallSegments | None:
        """`_segments` of a small write over Python ints, or None.

        NOTE: None hands the write to the general path, which raises the
        errors: this path accepts only input the general one accepts (valid,
        distinct slots), so both paths reject the same input the same way.
        """
        source: torch.Tensor | IntArray | None
        if isinstance(slot_mapping, np.ndarray):
            if slot_mapping.ndim != 1 or slot_mapping.dtype.kind not in "iu":
                return None
            source = slot_mapping
        elif isinstance(slot_mapping, torch.Tensor):
            if (
                slot_mapping.ndim != 1
                or slot_mapping.dtype not in _SLOT_DTYPES
                or not (slot_mapping.is_cpu or slot_mapping.is_cuda)
            ):
                return None
            source = slot_mapping
        elif type(slot_mapping) is list:
            source = None
        else:
            return None
        size = len(slot_mapping) if source is None else source.shape[0]
        n = size if num_tokens is None else num_tokens
        if type(n) is not int or not 0 < n <= min(size, _SMALL_WRITE_MAX_ROWS):
            return None
        if source is None:
            assert isinstance(slot_mapping, list)
            slots: list[int] = slot_mapping[:n]
            # NOTE: bools, numpy ints and floats go the general way.
            if set(map(type, slots)) != {int}:
                return None
        else:
            slots = (source if n == size else source[:n]).tolist()
        bs = self.block_size
        num_slots = self.num_slots
        prev = slots[0]
        if not 0 <= prev < num_slots:
            return None
        block, offset = divmod(prev, bs)
        length = 1
        blocks = [block]
        runs: list[tuple[int, int, int]] = []
        one_run = True
        for slot in slots[1:]:
            # A slot past its predecessor inside the same block extends the run
            # (and is in range, since the block is).
            if slot == prev + 1 and slot % bs:
                length += 1
            else:
                if not 0 <= slot < num_slots:
                    return None
                if slot != prev + 1:
                    one_run = False
                runs.append((block, offset, length))
                block, offset = divmod(slot, bs)
                length = 1
                blocks.append(block)
            prev = slot
        runs.append((block, offset, length))
        # NOTE: as in `_segments`, a slot can repeat only where a block starts
        # more than one run.
        repeated = len(set(blocks)) != len(blocks)
        if repeated and len(set(slots)) != n:
            return None
        return _SmallSegments(slots, source, blocks, runs, repeated, one_run)

    def _apply(self, plan: _Plan, block_keys: Mapping[int, BlockHash]) -> WriteResult:
        segs = plan.segs
        if isinstance(segs, _SmallSegments):
            if not (plan.rows.is_cuda and self._on_cpu):
                return self._apply_small(plan.entry, plan.rows, segs, block_keys)
            # Rows from the device into a CPU cache move run by run (see _copy_rows).
            source = segs.source
            n = len(segs.slots)
            device_slots = (
                source[:n] if isinstance(source, torch.Tensor) and source.is_cuda else None
            )
            segs = self._segments(np.array(segs.slots, dtype=np.int64), device_slots)
            plan = _Plan(plan.entry, plan.rows, segs)
        entry = plan.entry
        n = len(segs.slots)
        self._stats.num_writes += 1
        if n == 0:
            return WriteResult(entry.spec.name, 0, (), ())
        self._copy_rows(plan)
        bs = self.block_size
        filled = entry.filled
        if segs.repeated_blocks:
            for block, offset, length in zip(
                segs.blocks.tolist(), segs.offsets.tolist(), segs.lens.tolist(), strict=True
            ):
                _advance_fill(filled, block, offset, length)
            touched = np.unique(segs.blocks)
        else:
            prev = filled[segs.blocks]
            filled[segs.blocks] = np.where(
                segs.offsets == 0,
                segs.lens,
                np.where(prev == segs.offsets, segs.offsets + segs.lens, _BROKEN),
            )
            touched = segs.blocks
        # NOTE: every touched block loses its stamp unless this write completes
        # it under its key: its rows changed.
        keys = np.empty(len(touched), dtype=object)
        keys[:] = list(map(block_keys.get, touched.tolist()))
        keyed = keys != None  # noqa: E711 (elementwise on an object array)
        stamp = keyed & (filled[touched] == bs)
        stamped = touched[stamp].tolist()
        incomplete = touched[keyed & ~stamp].tolist()
        keys[~stamp] = None
        entry.stamps[touched] = keys
        self._stats.num_rows_written += n
        self._stats.num_stamped_blocks += len(stamped)
        self._stats.num_incomplete_blocks += len(incomplete)
        if stamped and self.tier is not None:
            self._offer(entry, stamped)
        return WriteResult(entry.spec.name, n, tuple(stamped), tuple(incomplete))

    def _apply_small(
        self,
        entry: _Entry,
        rows: torch.Tensor,
        segs: _SmallSegments,
        block_keys: Mapping[int, BlockHash],
    ) -> WriteResult:
        """`_apply` of a small write: the same effects, over Python ints.

        Rows on the CPU, or on the cache's device; CUDA rows for a CPU cache
        take `_apply`.
        """
        n = len(segs.slots)
        self._stats.num_writes += 1
        src = rows.detach() if rows.requires_grad else rows
        if src.shape[0] != n:
            src = src[:n]
        if src.ndim != 2:
            src = src.reshape(n, entry.dim)
        # NOTE: an earlier asynchronous copy into these slots must land first.
        if entry.pending:
            self._sync(entry)
        if not self._on_cpu and src.device != self.device:
            src = src.to(self.device)
        if segs.one_run:
            first = segs.slots[0]
            entry.flat[first : first + n].copy_(src)
        else:
            # One op for every row: each parallel op may wake the thread pool.
            source = segs.source
            if isinstance(source, torch.Tensor):
                index = (source if source.shape[0] == n else source[:n]).to(
                    self.device, torch.int64
                )
            elif source is not None:
                index = torch.from_numpy(source[:n].astype(np.int64)).to(self.device)
            else:
                index = torch.tensor(segs.slots, dtype=torch.int64, device=self.device)
            dst_w, src_w = _widen_pair(entry, entry.flat, src)
            dst_w.index_put_((index,), src_w)
        bs = self.block_size
        filled = entry.filled
        stamps = entry.stamps
        key_of = block_keys.get
        stamped: list[int] = []
        incomplete: list[int] = []
        # NOTE: the fill rule and the stamp rule of `_apply`; every touched
        # block loses its stamp unless this write completes it under its key.
        if segs.repeated_blocks:
            for block, offset, length in segs.runs:
                _advance_fill(filled, block, offset, length)
            for block in sorted(set(segs.blocks)):
                key = key_of(block)
                if key is None:
                    stamps[block] = None
                elif filled[block] == bs:
                    stamps[block] = key
                    stamped.append(block)
                else:
                    stamps[block] = None
                    incomplete.append(block)
        else:
            for block, offset, length in segs.runs:
                if offset == 0:
                    fill = length
                elif filled[block] == offset:
                    fill = offset + length
                else:
                    fill = _BROKEN
                filled[block] = fill
                key = key_of(block)
                if key is None:
                    stamps[block] = None
                elif fill == bs:
                    stamps[block] = key
                    stamped.append(block)
                else:
                    stamps[block] = None
                    incomplete.append(block)
        stats = self._stats
        stats.num_rows_written += n
        if stamped:
            stats.num_stamped_blocks += len(stamped)
            if self.tier is not None:
                self._offer(entry, stamped)
        if incomplete:
            stats.num_incomplete_blocks += len(incomplete)
        return WriteResult(entry.spec.name, n, tuple(stamped), tuple(incomplete))

    def _copy_rows(self, plan: _Plan) -> None:
        entry = plan.entry
        segs = plan.segs
        assert isinstance(segs, _Segments)
        slots = segs.slots
        n = len(slots)
        src = plan.rows.detach()[:n].reshape(n, entry.dim)
        # NOTE: an earlier asynchronous copy into these slots must land first.
        self._sync(entry)
        if src.is_cuda and self.device.type == "cpu":
            # Each run of consecutive slots is one copy from the device into
            # the (pinned) cache; readers wait for the event.
            for start, stop in _runs(slots):
                first = int(slots[start])
                entry.flat[first : first + stop - start].copy_(
                    src[start:stop], non_blocking=self.pin_memory
                )
            if self.pin_memory:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                entry.pending.append(event)
            return
        if src.device != self.device:
            src = src.to(self.device)
        if self.device.type == "cpu" and _is_one_run(segs):
            for start, stop in _runs(slots):
                first = int(slots[start])
                entry.flat[first : first + stop - start].copy_(src[start:stop])
            return
        dst_w, src_w = _widen_pair(entry, entry.flat, src)
        if segs.whole_blocks:
            # One index per block moves block_size rows at once.
            index = torch.from_numpy(segs.blocks).to(self.device)
            row_w = self.block_size * dst_w.shape[1]
            # NOTE: reshape, not view: strided rows (a column slice of a fused
            # projection) cannot always be viewed as whole blocks, and failing
            # here would leave the entries written before this one changed.
            dst_w.view(self.num_blocks, row_w).index_put_(
                (index,), src_w.reshape(len(segs.blocks), row_w)
            )
            return
        index_t = segs.slots_tensor
        if index_t is None or index_t.device != self.device:
            index_t = torch.from_numpy(slots).to(self.device)
        dst_w.index_put_((index_t.to(torch.int64),), src_w)

    def _offer(self, entry: _Entry, block_ids: Sequence[int]) -> None:
        """Offers blocks that a write just stamped to the tier (write-behind)."""
        tier = self.tier
        assert tier is not None
        # NOTE: the tier copies the rows: asynchronous copies into them must land.
        self._sync(entry)
        name = entry.spec.name
        shape = (self.block_size, *entry.spec.row_shape)
        blocks = [
            TierBlock(entry.stamps[block_id], name, entry.cache[block_id].view(shape))
            for block_id in block_ids
        ]
        self._stats.num_tier_offered += len(blocks)
        try:
            tier.put(blocks)
        except Exception as exc:
            # NOTE: the write itself happened; a tier that raises loses only
            # its copy.
            self._stats.num_tier_errors += 1
            _log.warning(
                "tier %s failed to take %d blocks of %r: %r",
                type(tier).__name__,
                len(blocks),
                name,
                exc,
            )

    def _gather_blocks(self, entry: _Entry, ids: IntArray, flat_out: torch.Tensor) -> None:
        """Copies whole blocks ``ids`` into ``flat_out`` (``len(ids) * block_size`` rows)."""
        index = torch.from_numpy(ids)
        if self.device.type != "cpu":
            index = index.to(self.device)
        dst_w, src_w = _widen_pair(entry, flat_out, entry.flat)
        row_w = self.block_size * dst_w.shape[1]
        torch.index_select(
            src_w.view(self.num_blocks, row_w), 0, index, out=dst_w.view(len(ids), row_w)
        )

    def _empty(self, entry: _Entry, num_rows: int) -> torch.Tensor:
        return torch.empty(
            (num_rows, entry.dim),
            dtype=entry.spec.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def _sync(self, entry: _Entry) -> None:
        if entry.pending:
            for event in entry.pending:
                event.synchronize()
            entry.pending.clear()


# -- helpers -----------------------------------------------------------------


def _check_positive_int(name: str, value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"{name}: expected int, found {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, found {value}")


def _parse_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected str or torch.device, found {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', found {device!r}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', found {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: expected 'cpu' (CUDA is not available), found {device!r}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _describe(spec: EntrySpec) -> str:
    kind = "deferred " if spec.deferred else ""
    return f"{kind}rows {spec.row_shape} of {spec.dtype}"


def _check_rows(spec: EntrySpec, rows: object, num_rows: int) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(
            f"entry {spec.name!r}: expected torch.Tensor rows, found {type(rows).__name__}"
        )
    if rows.shape[1:] != spec.row_shape or rows.ndim != len(spec.row_shape) + 1:
        shape = ", ".join(map(str, spec.row_shape))
        raise ValueError(
            f"entry {spec.name!r}: expected rows of shape (n, {shape}), found {tuple(rows.shape)}"
        )
    if rows.dtype != spec.dtype:
        raise ValueError(f"entry {spec.name!r}: expected dtype {spec.dtype}, found {rows.dtype}")
    if rows.shape[0] < num_rows:
        raise ValueError(
            f"entry {spec.name!r}: expected at least {num_rows} rows, found {rows.shape[0]}"
        )
    # NOTE: is_cpu / is_cuda rather than device.type: this check runs on every write.
    if not (rows.is_cpu or rows.is_cuda):
        raise ValueError(f"entry {spec.name!r}: expected rows on cpu or cuda, found {rows.device}")


def _check_out(
    spec: EntrySpec, buf: object, num_rows: int, device: torch.device, what: str
) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what}: expected torch.Tensor, found {type(buf).__name__}")
    if tuple(buf.shape[1:]) != spec.row_shape or buf.shape[0] < num_rows:
        raise ValueError(
            f"{what}: expected shape (>= {num_rows}, {', '.join(map(str, spec.row_shape))}), "
            f"found {tuple(buf.shape)}"
        )
    if buf.dtype != spec.dtype:
        raise ValueError(f"{what}: expected dtype {spec.dtype}, found {buf.dtype}")
    if buf.device != device:
        raise ValueError(f"{what}: expected device {device}, found {buf.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{what}: expected a contiguous buffer, found strides {buf.stride()}")


def _check_block_keys(
    block_keys: Mapping[int, BlockHash] | None, num_blocks: int
) -> Mapping[int, BlockHash]:
    if block_keys is None:
        return {}
    # NOTE: the exact-type test spares most calls the slower ABC check.
    if type(block_keys) is not dict and not isinstance(block_keys, Mapping):
        raise TypeError(
            f"block_keys: expected a mapping block id -> key, found {type(block_keys).__name__}"
        )
    if not block_keys:
        return block_keys
    # NOTE: type sets are built in C; the per-item loops run only to name an error.
    id_types = set(map(type, block_keys))
    if id_types != {int} or min(block_keys) < 0 or max(block_keys) >= num_blocks:
        for block_id in block_keys:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                raise IndexError(
                    f"block_keys: expected block ids 0..{num_blocks - 1}, found {block_id!r}"
                )
    key_types = set(map(type, block_keys.values()))
    if not all(issubclass(t, bytes) for t in key_types):
        for block_id, key in block_keys.items():
            if not isinstance(key, bytes):
                raise TypeError(
                    f"block_keys[{block_id}]: expected bytes, found {type(key).__name__}"
                )
    return block_keys


def _checked_tier_rows(
    found: list[Mapping[str, torch.Tensor]],
    specs: Sequence[EntrySpec],
    block_size: int,
    num_keys: int,
) -> list[Mapping[str, torch.Tensor]]:
    """What a tier returned, or ValueError when it broke `BlockTier.get`'s contract."""
    if len(found) > num_keys:
        raise ValueError(f"tier: expected at most {num_keys} blocks, found {len(found)}")
    for index, rows_by_name in enumerate(found):
        for spec in specs:
            rows = rows_by_name.get(spec.name)
            shape = (block_size, *spec.row_shape)
            if (
                not isinstance(rows, torch.Tensor)
                or tuple(rows.shape) != shape
                or rows.dtype != spec.dtype
            ):
                found_as = (
                    f"{tuple(rows.shape)} {rows.dtype}"
                    if isinstance(rows, torch.Tensor)
                    else type(rows).__name__
                )
                raise ValueError(
                    f"tier: block {index}, entry {spec.name!r}: expected {shape} "
                    f"{spec.dtype}, found {found_as}"
                )
    return found


def _advance_fill(filled: npt.NDArray[np.int32], block: int, offset: int, length: int) -> None:
    """The fill rule for a run of ``length`` rows written at ``offset`` of ``block``.

    A run from offset 0 restarts the block, a run that continues its fill
    extends it, and any other run breaks it until the next offset-0 write.
    """
    if offset == 0:
        filled[block] = length
    elif filled[block] == offset:
        filled[block] = offset + length
    else:
        filled[block] = _BROKEN


def _is_per_token(value: object, num_tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == num_tokens


def _merge_outputs(
    hidden_states: torch.Tensor | None, multimodal_outputs: Mapping[str, object] | None
) -> dict[str, object]:
    outputs: dict[str, object] = {}
    if multimodal_outputs is not None and not isinstance(multimodal_outputs, Mapping):
        raise TypeError(
            f"multimodal_outputs: expected a mapping, found {type(multimodal_outputs).__name__}"
        )
    if hidden_states is not None:
        if multimodal_outputs is not None and HIDDEN_STATES in multimodal_outputs:
            raise ValueError(
                f"multimodal_outputs: expected no {HIDDEN_STATES!r} key when hidden_states is given"
            )
        outputs[HIDDEN_STATES] = hidden_states
    if multimodal_outputs is not None:
        outputs.update(multimodal_outputs)
    return outputs


def _num_valid(
    entries: Sequence[_Entry], ids: IntArray, keys: Sequence[BlockHash]
) -> tuple[int, tuple[_Entry, int] | None]:
    """Leading blocks holding their keys for every entry, and the first failure."""
    best = len(ids)
    failure: tuple[_Entry, int] | None = None
    if not best:
        return best, failure
    expected = np.empty(best, dtype=object)
    expected[:] = list(keys)
    for entry in entries:
        bad = np.flatnonzero(entry.stamps[ids[:best]] != expected[:best])
        if bad.size:
            best = int(bad[0])
            failure = (entry, int(ids[best]))
    return best, failure


def _num_valid_list(
    entries: Sequence[_Entry], ids: list[int], keys: Sequence[BlockHash]
) -> tuple[int, tuple[_Entry, int] | None]:
    """`_num_valid` over a list: a request's few blocks cost less than numpy calls."""
    best = len(ids)
    failure: tuple[_Entry, int] | None = None
    for entry in entries:
        stamps = entry.stamps
        for index in range(best):
            block_id = ids[index]
            if stamps[block_id] != keys[index]:
                best = index
                failure = (entry, block_id)
                break
    return best, failure


def _ranges(starts: IntArray, counts: IntArray) -> IntArray:
    """``starts[i] .. starts[i] + counts[i] - 1`` for each i, concatenated."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    ranges: IntArray = np.arange(total, dtype=np.int64) + np.repeat(
        starts - (ends - counts), counts
    )
    return ranges


def _widen_pair(
    entry: _Entry, dst: torch.Tensor, src: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views two ``(rows, dim)`` tensors as rows of the entry's wide type, if both allow."""
    if entry.wide_dtype != entry.spec.dtype:
        try:
            return dst.view(entry.wide_dtype), src.view(entry.wide_dtype)
        except RuntimeError:
            pass
    return dst, src


def _runs(slots: IntArray) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges whose slots are consecutive."""
    starts = np.concatenate(([0], np.flatnonzero(np.diff(slots) != 1) + 1))
    stops = np.append(starts[1:], len(slots))
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def _is_one_run(segs: _Segments) -> bool:
    """Whether the slots are consecutive: one copy_ moves them all."""
    slots = segs.slots
    if not len(slots) or int(slots[-1]) - int(slots[0]) != len(slots) - 1:
        return False
    if segs.whole_blocks:
        return bool((np.diff(segs.blocks) == 1).all())
    return bool((np.diff(slots) == 1).all())


def _raise_duplicate_slot(slots: IntArray) -> None:
    uniq, counts = np.unique(slots, return_counts=True)
    dup = int(uniq[np.flatnonzero(counts > 1)[0]])
    where = np.flatnonzero(slots == dup)[:2].tolist()
    raise ValueError(f"slot_mapping: expected distinct slots, found slot {dup} at rows {where}")


def _staged_bytes(per_entry: Mapping[str, list[tuple[int, torch.Tensor]]]) -> int:
    return sum(
        chunk.numel() * chunk.element_size() for chunks in per_entry.values() for _, chunk in chunks
    )


def _merge_results(a: WriteResult, b: WriteResult) -> WriteResult:
    stamped = dict.fromkeys(a.stamped_block_ids)
    for block in b.incomplete_block_ids:
        stamped.pop(block, None)
    stamped.update(dict.fromkeys(b.stamped_block_ids))
    incomplete = dict.fromkeys(x for x in a.incomplete_block_ids if x not in stamped)
    incomplete.update(dict.fromkeys(b.incomplete_block_ids))
    return WriteResult(a.name, a.num_rows + b.num_rows, tuple(stamped), tuple(incomplete))
