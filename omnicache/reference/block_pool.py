"""Block pool: hash→block table, reference counts, LRU eviction, events.

The pool owns ``num_blocks`` fixed-size blocks with ids ``0 .. num_blocks - 1``
(there is no reserved null block). A block is either *in use* (``ref_cnt > 0``,
held by one or more requests) or *free* (``ref_cnt == 0``, linked into the
free queue). A full block that was computed can be registered under its
``BlockHash`` key; from then on a later request with the same prefix finds it
through the hash→block table and shares it instead of recomputing it.

Eviction is lazy: freeing a block keeps its key, so the block stays findable
until ``allocate`` hands it out again. Only then does it lose its key, which
removes it from the table, emits a ``BlockRemoved`` event and calls every
eviction listener with ``(block_id, key)``.

Free queue order (front is reused first)::

    head <-> [uncached free blocks] <-> [cached free blocks, LRU first] <-> tail
              ^ freed without a key     ^ freed with a key: appended at the back
                prepended at the front

``free`` takes blocks in eviction order. A request frees its blocks last block
first, so the tail of its chain is evicted before its head: a chain's head is
shared by more prompts than its tail, and a lookup that lost the head could not
use the tail anyway.

Keys are exactly one block each: a key maps to at most one block and a block
holds at most one key, and ``block.block_hash == key`` holds exactly when the
table maps ``key`` to that block. When two requests compute the same block
concurrently, the second registration of a key that another block already
holds is dropped: the second block stays without a key (it is reused first
once freed) and never appears in an event. A consumer that keeps data per block
(the tensor store) may therefore rely on ``get_block_hash(block_id)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import is_not
from typing import cast

from omnicache.block_hash import BlockHash, block_hash_hex, block_hash_low64
from omnicache.checks import check_int, check_optional_int, type_name

__all__ = ["AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "CacheBlock"]

EvictionListener = Callable[[int, BlockHash], None]
"""Called as ``listener(block_id, key)`` when a block stops holding ``key``."""


@dataclass(slots=True, eq=False)
class CacheBlock:
    """Metadata of one block of the pool.

    NOTE: ``prev_free``/``next_free`` are set exactly while the block is in the
    free queue (``ref_cnt == 0``); only ``FreeBlockQueue`` touches them.
    """

    # Index of the block, 0 .. num_blocks - 1 (-1 for the queue's sentinels).
    block_id: int
    # Number of requests holding the block; 0 means it is in the free queue.
    ref_cnt: int = 0
    # Key under which the block is registered in the hash→block table.
    block_hash: BlockHash | None = None
    prev_free: CacheBlock | None = field(default=None, repr=False)
    next_free: CacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked queue of free blocks.

    Every operation is O(1) per block moved and allocates no Python objects
    besides the returned lists: the links live in the blocks themselves, and
    two sentinel blocks make the head and tail cases branch-free.

    Args:
        blocks: The initial free blocks, front first.
    """

    def __init__(self, blocks: Sequence[CacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = CacheBlock(-1)
        self._tail = CacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def popleft_n(self, num_blocks: int) -> list[CacheBlock]:
        """Unlinks and returns the first ``num_blocks`` blocks.

        Args:
            num_blocks: How many blocks to take; at most ``num_free_blocks``.

        Returns:
            The blocks, front first.
        """
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"free queue holds {self.num_free_blocks} blocks, {num_blocks} requested"
            )
        popped: list[CacheBlock] = []
        append = popped.append
        block = self._head.next_free
        for _ in range(num_blocks):
            assert block is not None
            append(block)
            next_block = block.next_free
            block.prev_free = block.next_free = None
            block = next_block
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return popped

    def remove(self, block: CacheBlock) -> None:
        """Unlinks ``block`` from anywhere in the queue."""
        prev_block = block.prev_free
        next_block = block.next_free
        if prev_block is None or next_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def prepend_n(self, blocks: Sequence[CacheBlock]) -> None:
        """Links ``blocks`` in front of the queue, ``blocks[0]`` first."""
        if not blocks:
            return
        first = self._head.next_free
        assert first is not None
        prev_block = self._head
        for block in blocks:
            block.prev_free = prev_block
            prev_block.next_free = block
            prev_block = block
        prev_block.next_free = first
        first.prev_free = prev_block
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: Sequence[CacheBlock]) -> None:
        """Links ``blocks`` at the back of the queue, ``blocks[-1]`` last."""
        if not blocks:
            return
        prev_block = self._tail.prev_free
        assert prev_block is not None
        for block in blocks:
            block.prev_free = prev_block
            prev_block.next_free = block
            prev_block = block
        prev_block.next_free = self._tail
        self._tail.prev_free = prev_block
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[CacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Keys that entered the hash→block table, in chain order.

    ``parent_block_hash`` is the key of the block before ``block_hashes[0]`` in
    the chain (None for the first block of a prompt); it need not be cached.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    # Tokens covered by ``block_hashes``: ``len(block_hashes) * block_size``.
    num_tokens: int
    block_size: int

    @property
    def block_hashes_hex(self) -> list[str]:
        return [block_hash_hex(key) for key in self.block_hashes]

    @property
    def block_hashes_low64(self) -> list[int]:
        return [block_hash_low64(key) for key in self.block_hashes]

    @property
    def parent_block_hash_hex(self) -> str | None:
        parent = self.parent_block_hash
        return None if parent is None else block_hash_hex(parent)

    @property
    def parent_block_hash_low64(self) -> int | None:
        parent = self.parent_block_hash
        return None if parent is None else block_hash_low64(parent)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Keys that left the hash→block table because their blocks were reused."""

    block_hashes: tuple[BlockHash, ...]

    @property
    def block_hashes_hex(self) -> list[str]:
        return [block_hash_hex(key) for key in self.block_hashes]

    @property
    def block_hashes_low64(self) -> list[int]:
        return [block_hash_low64(key) for key in self.block_hashes]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every key left the table at once (``BlockPool.reset``)."""


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Fixed set of blocks with prefix caching by ``BlockHash`` key.

    Args:
        num_blocks: Number of blocks, at least 1.
        block_size: Tokens per block, at least 1 (used for event token counts).
        enable_events: Whether to queue events for ``take_events``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_events: bool = True) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        check_int("block_size", block_size, minimum=1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_events = enable_events
        self.blocks: list[CacheBlock] = [CacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.hash_to_block: dict[BlockHash, CacheBlock] = {}
        # Keys lost on reuse since construction (``reset`` is not an eviction).
        self.num_evictions = 0
        self._events: list[PoolEvent] = []
        self._eviction_listeners: list[EvictionListener] = []
        # NOTE: C-level predicate for ``takewhile`` in the lookup hot path.
        self._is_block = partial(is_not, None)

    # -- lookup -------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> CacheBlock | None:
        """Returns the block registered under ``block_hash``, or None."""
        return self.hash_to_block.get(block_hash)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int | None = None
    ) -> list[CacheBlock]:
        """Returns the cached blocks of the longest prefix of ``block_hashes``.

        The walk stops at the first miss: keys are chained, so every later
        block of the same prompt misses too. The blocks are not touched.

        Args:
            block_hashes: Keys of consecutive full blocks from the first block.
            max_num_blocks: Stop after this many blocks (None: no cap).

        Returns:
            ``blocks`` with ``blocks[i].block_hash == block_hashes[i]``.
        """
        if max_num_blocks is None:
            max_num_blocks = len(block_hashes)
        else:
            check_optional_int("max_num_blocks", max_num_blocks, minimum=0)
        if max_num_blocks == 0 or not block_hashes:
            return []
        get = self.hash_to_block.get
        # A cold prompt misses on its first key: answer without building iterators.
        if get(block_hashes[0]) is None:
            return []
        hits = itertools.takewhile(
            self._is_block, map(get, itertools.islice(block_hashes, max_num_blocks))
        )
        return cast(list[CacheBlock], list(hits))

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        """Returns the key that block ``block_id`` holds now, or None."""
        check_int("block_id", block_id, minimum=0, maximum=self.num_blocks - 1)
        return self.blocks[block_id].block_hash

    # -- allocation ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out (cached ones included)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a key, in use or free."""
        return len(self.hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[CacheBlock] | None:
        """Takes ``num_blocks`` blocks from the front of the free queue.

        A taken block that still holds a key loses it here (lazy eviction):
        the key leaves the table, a ``BlockRemoved`` event lists it, and every
        eviction listener is called with ``(block_id, key)`` once the pool is
        consistent again.

        Args:
            num_blocks: Number of blocks, >= 0.

        Returns:
            The blocks, each with ``ref_cnt == 1`` and no key, or None when
            fewer than ``num_blocks`` blocks are free; the pool is then
            unchanged. Running out of room is an expected outcome under load
            (the caller waits or preempts), so it is a value, not an error.
        """
        check_int("num_blocks", num_blocks, minimum=0)
        if num_blocks > self.free_block_queue.num_free_blocks:
            return None
        blocks = self.free_block_queue.popleft_n(num_blocks)
        hash_to_block = self.hash_to_block
        evicted: list[tuple[int, BlockHash]] = []
        for block in blocks:
            block.ref_cnt = 1
            key = block.block_hash
            if key is not None:
                del hash_to_block[key]
                block.block_hash = None
                evicted.append((block.block_id, key))
        if evicted:
            self.num_evictions += len(evicted)
            if self.enable_events:
                self._events.append(BlockRemoved(tuple(key for _, key in evicted)))
            self._notify(evicted)
        return blocks

    def touch(self, blocks: Sequence[CacheBlock]) -> None:
        """Adds a reference to each block (a cache hit shares them).

        A free block leaves the free queue, so it cannot be evicted while the
        new holder uses it.

        Args:
            blocks: Blocks of this pool, each in use or holding a key; a block
                listed twice gains two references.
        """
        for index, block in enumerate(blocks):
            self._check_own(index, block)
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(
                    f"blocks[{index}]: expected a block in use or holding a key, "
                    f"found free block {block.block_id} without a key"
                )
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free(self, ordered_blocks: Iterable[CacheBlock]) -> None:
        """Drops one reference from each block, in eviction order.

        Blocks whose count reaches zero enter the free queue: those without a
        key at the front (reused first, in the given order), those with a key
        at the back (the given order among them is their LRU order). A request
        passes its blocks last block first.

        Args:
            ordered_blocks: Blocks of this pool, the first to be evicted first.

        Raises:
            RuntimeError: A block would drop below zero references (a double
                free); no count changes.
        """
        blocks = ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks)
        own = self.blocks
        num_blocks = self.num_blocks
        to_front: list[CacheBlock] = []
        to_back: list[CacheBlock] = []
        index = 0
        try:
            for index, block in enumerate(blocks):
                block_id = block.block_id
                ref_cnt = block.ref_cnt
                if ref_cnt <= 0 or not 0 <= block_id < num_blocks or own[block_id] is not block:
                    self._check_own(index, block)
                    raise RuntimeError(
                        f"ordered_blocks[{index}]: block {block_id} freed more often than "
                        f"allocated or touched (ref_cnt would drop below 0)"
                    )
                block.ref_cnt = ref_cnt - 1
                if ref_cnt == 1:
                    if block.block_hash is None:
                        to_front.append(block)
                    else:
                        to_back.append(block)
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            for done in itertools.islice(blocks, index):
                done.ref_cnt += 1
            if isinstance(exc, AttributeError):
                self._check_own(index, blocks[index])
            raise
        self.free_block_queue.prepend_n(to_front)
        self.free_block_queue.append_n(to_back)

    # -- registration -------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[CacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> int:
        """Registers ``blocks[num_cached_blocks:num_full_blocks]`` under their keys.

        Block ``i`` gets ``block_hashes[i]``. A block that already holds its
        key is left as it is. A key that another block already holds (the same
        block computed twice) stays with that block and the new block stays
        without a key; see the module docstring.

        Args:
            blocks: The request's blocks, first block first; the blocks to
                register must be in use.
            block_hashes: The request's keys, at least ``num_full_blocks``.
            num_cached_blocks: Blocks already registered for the request.
            num_full_blocks: Full, computed blocks of the request.

        Returns:
            The number of keys that entered the table.
        """
        if not 0 <= num_cached_blocks <= num_full_blocks:
            raise ValueError(
                f"num_cached_blocks: expected 0..{num_full_blocks} (num_full_blocks), "
                f"found {num_cached_blocks}"
            )
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks: expected <= {min(len(blocks), len(block_hashes))} "
                f"(len(blocks)={len(blocks)}, len(block_hashes)={len(block_hashes)}), "
                f"found {num_full_blocks}"
            )
        seen: set[int] = set()
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            self._check_own(index, block)
            if block.ref_cnt == 0:
                raise ValueError(
                    f"blocks[{index}]: expected a block in use, found free block {block.block_id}"
                )
            key = block_hashes[index]
            if not isinstance(key, bytes):
                # NOTE: a non-bytes key would enter the table while the block
                # holds none, so reuse could never evict it: a stale hit.
                raise TypeError(
                    f"block_hashes[{index}]: expected bytes, found {type(key).__name__}"
                )
            if block.block_hash is not None and block.block_hash != block_hashes[index]:
                raise ValueError(
                    f"blocks[{index}]: block {block.block_id} holds key "
                    f"{block_hash_hex(block.block_hash)}, cannot take "
                    f"{block_hash_hex(block_hashes[index])}"
                )
            if block.block_id in seen:
                raise ValueError(f"blocks[{index}]: block {block.block_id} listed twice")
            seen.add(block.block_id)

        hash_to_block = self.hash_to_block
        # Indices [start, stop) of a run of keys that entered the table.
        runs: list[tuple[int, int]] = []
        run_start = -1
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            key = block_hashes[index]
            if block.block_hash is None and key not in hash_to_block:
                hash_to_block[key] = block
                block.block_hash = key
                if run_start < 0:
                    run_start = index
            elif run_start >= 0:
                runs.append((run_start, index))
                run_start = -1
        if run_start >= 0:
            runs.append((run_start, num_full_blocks))

        if self.enable_events:
            block_size = self.block_size
            for start, stop in runs:
                self._events.append(
                    BlockStored(
                        block_hashes=tuple(block_hashes[start:stop]),
                        parent_block_hash=block_hashes[start - 1] if start > 0 else None,
                        num_tokens=(stop - start) * block_size,
                        block_size=block_size,
                    )
                )
        return sum(stop - start for start, stop in runs)

    # -- reset, events, listeners --------------------------------------------

    def reset(self) -> bool:
        """Drops every key, e.g. after a weight update made cached data stale.

        Returns:
            True when the keys were dropped (an ``AllBlocksCleared`` event is
            queued and every listener hears of each keyed block); False, with
            nothing changed, while any block is in use.
        """
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        cleared = [(block.block_id, key) for key, block in self.hash_to_block.items()]
        for key in self.hash_to_block:
            self.hash_to_block[key].block_hash = None
        self.hash_to_block = {}
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        self._notify(cleared)
        return True

    def take_events(self) -> list[PoolEvent]:
        """Returns the queued events, oldest first, and empties the queue."""
        events = self._events
        self._events = []
        return events

    def add_eviction_listener(self, callback: EvictionListener) -> None:
        """Calls ``callback(block_id, key)`` whenever a block loses its key.

        That happens when ``allocate`` reuses a cached block and, for every
        keyed block, on ``reset``. Calls are synchronous, once per block, made
        after the pool is consistent. A listener must not raise: the pool has
        already changed and the caller would lose the call's result.
        """
        if not callable(callback):
            raise TypeError(f"callback: expected a callable, found {type_name(callback)}")
        self._eviction_listeners.append(callback)

    def remove_eviction_listener(self, callback: EvictionListener) -> None:
        """Stops calling ``callback``; ValueError if it was not added."""
        for index, listener in enumerate(self._eviction_listeners):
            if listener == callback:
                del self._eviction_listeners[index]
                return
        raise ValueError(f"callback: expected a registered eviction listener, found {callback!r}")

    # -- helpers ------------------------------------------------------------

    def _notify(self, lost: list[tuple[int, BlockHash]]) -> None:
        # NOTE: a snapshot, so a listener may remove itself while being called.
        for listener in tuple(self._eviction_listeners):
            for block_id, key in lost:
                listener(block_id, key)

    def _check_own(self, index: int, block: CacheBlock) -> None:
        if not isinstance(block, CacheBlock):
            raise TypeError(f"[{index}]: expected CacheBlock, found {type_name(block)}")
        block_id = block.block_id
        if not 0 <= block_id < self.num_blocks or self.blocks[block_id] is not block:
            raise ValueError(f"[{index}]: block {block_id} does not belong to this pool")
