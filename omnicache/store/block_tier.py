"""A second tier that keeps blocks by key (`BlockTier`), and the store's bridge to it.

Every block a write stamps is offered to the tier (write-behind: the tier
copies the rows and returns); `TierBridge.read_through` fills newly allocated
blocks with the rows the tier holds for their keys and stamps them
(read-through on a local miss). The store knows nothing of how a tier keeps
its blocks, and a tier that fails in any way costs misses, never an exception
and never a store left in a state it cannot read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import type_name
from omnicache.store.copies import sync
from omnicache.store.entries import Entry, Layout, clear_blocks
from omnicache.store.slots import IntArray
from omnicache.store.specs import EntrySpec, StoreStats

# NOTE: the package's logger, whichever module logs: the name users configure.
_log = logging.getLogger("omnicache.store")
# A tier's own failures: its connection (OSError), its state (RuntimeError),
# rows that do not fit what was asked (ValueError).
_TIER_FAULTS = (OSError, RuntimeError, ValueError)


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


def check_tier(tier: object) -> None:
    """A tier argument: None, or an object with ``put`` and ``get`` methods."""
    if tier is not None and not (
        callable(getattr(tier, "put", None)) and callable(getattr(tier, "get", None))
    ):
        raise TypeError(
            f"tier: expected a BlockTier (put and get methods) or None, found {type_name(tier)}"
        )


class TierBridge:
    """Offers stamped blocks to a tier and fills blocks from it, counting in ``stats``."""

    def __init__(self, layout: Layout, stats: StoreStats) -> None:
        self._layout = layout
        self._stats = stats

    def offer(self, tier: BlockTier, entry: Entry, block_ids: Sequence[int]) -> None:
        """Offers blocks that a write just stamped to the tier (write-behind)."""
        # NOTE: the tier copies the rows: asynchronous copies into them must land.
        sync(entry)
        name = entry.spec.name
        shape = (self._layout.block_size, *entry.spec.row_shape)
        blocks = [
            TierBlock(entry.stamps[block_id], name, entry.cache[block_id].view(shape))
            for block_id in block_ids
        ]
        self._stats.num_tier_offered += len(blocks)
        try:
            tier.put(blocks)
        except _TIER_FAULTS as exc:
            # NOTE: the write itself happened; a tier that fails loses only
            # its copy. Any other exception is a bug, and raises.
            self._stats.num_tier_errors += 1
            _log.warning(
                "tier %s failed to take %d blocks of %r: %r",
                type_name(tier),
                len(blocks),
                name,
                exc,
            )

    def read_through(
        self,
        tier: BlockTier,
        entries: Sequence[Entry],
        all_entries: Iterable[Entry],
        ids: IntArray,
        block_keys: Sequence[BlockHash],
    ) -> int:
        """Fills the leading blocks the tier holds whole (see `TensorStore.read_through`).

        Args:
            tier: The tier to ask.
            entries: Entries to fill (at least one).
            all_entries: Every entry: each loses the given blocks' stamps and
                fill counts.
            ids: Distinct blocks, one per key (at least one).
            block_keys: The keys to look up, first block first.

        Returns:
            How many leading blocks were filled.
        """
        bs = self._layout.block_size
        specs = [entry.spec for entry in entries]
        self._stats.num_tier_queried_blocks += len(ids)
        try:
            found = list(tier.get(list(block_keys), specs, bs))
            blocks = _checked_tier_rows(found, specs, bs, len(ids), self._layout.device)
        except _TIER_FAULTS as exc:
            # NOTE: a tier promises not to raise; one that fails (or answers
            # rows that do not fit: ValueError) costs a miss, never a failed
            # request. Any other exception is a bug, and raises.
            self._stats.num_tier_errors += 1
            _log.warning("tier %s failed a read, served as a miss: %r", type_name(tier), exc)
            blocks = []
        # NOTE: every row was checked before any block lost its stamp, so
        # that the copies below cannot fail (nor bring autograd into a cache).
        clear_blocks(all_entries, ids)
        for index, rows_by_name in enumerate(blocks):
            block_id = int(ids[index])
            key = block_keys[index]
            for entry in entries:
                rows = rows_by_name[entry.spec.name].reshape(bs, entry.dim)
                sync(entry)
                entry.cache[block_id].copy_(rows)
                entry.stamps[block_id] = key
                entry.filled[block_id] = bs
        self._stats.num_tier_hit_blocks += len(blocks)
        return len(blocks)


def _checked_tier_rows(
    found: list[Mapping[str, torch.Tensor]],
    specs: Sequence[EntrySpec],
    block_size: int,
    num_keys: int,
    device: torch.device,
) -> list[Mapping[str, torch.Tensor]]:
    """What a tier returned, or ValueError when the store cannot take it.

    Beyond `BlockTier.get`'s contract (at most ``num_keys`` blocks of rows of
    each spec's shape and dtype), the rows must be dense, on the CPU or the
    store's ``device``, and free of autograd: rows that require grad would
    leave the cache tracking autograd, and every later read of it would fail.
    """
    if len(found) > num_keys:
        raise ValueError(f"tier: expected at most {num_keys} blocks, found {len(found)}")
    devices = "cpu" if device.type == "cpu" else f"cpu or {device}"
    for index, rows_by_name in enumerate(found):
        for spec in specs:
            rows = rows_by_name.get(spec.name)
            what = f"tier: block {index}, entry {spec.name!r}"
            shape = (block_size, *spec.row_shape)
            if (
                not isinstance(rows, torch.Tensor)
                or tuple(rows.shape) != shape
                or rows.dtype != spec.dtype
            ):
                found_as = (
                    f"{tuple(rows.shape)} {rows.dtype}"
                    if isinstance(rows, torch.Tensor)
                    else type_name(rows)
                )
                raise ValueError(f"{what}: expected {shape} {spec.dtype}, found {found_as}")
            if rows.layout != torch.strided:
                raise ValueError(f"{what}: expected dense rows, found {rows.layout}")
            if not (rows.is_cpu or rows.device == device):
                raise ValueError(f"{what}: expected rows on {devices}, found {rows.device}")
            if rows.requires_grad:
                raise ValueError(
                    f"{what}: expected rows that do not require grad, found requires_grad=True"
                )
    return found
