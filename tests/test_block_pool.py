"""BlockPool: exact free-queue orders, lazy eviction, events, errors, and a
stateful comparison against a list-based reference model."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from omnicache.block_hash import BlockHash
from omnicache.reference.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheBlock,
)


def key(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def chain(prefix: str, num_blocks: int) -> list[BlockHash]:
    return [key(f"{prefix}{i}") for i in range(num_blocks)]


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def ids(blocks: list[CacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything observable about a pool, for 'rejected call changed nothing'."""
    return (
        free_ids(pool),
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        {k: b.block_id for k, b in pool.hash_to_block.items()},
        pool.num_free_blocks,
        pool.num_evictions,
        list(pool._events),
    )


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, BlockHash]] = []

    def __call__(self, block_id: int, block_hash: BlockHash) -> None:
        self.calls.append((block_id, block_hash))


# -- construction -------------------------------------------------------------


def test_new_pool_has_every_block_free_in_id_order() -> None:
    pool = BlockPool(5, 16)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5
    assert pool.num_cached_blocks == 0
    assert pool.usage == 0.0
    assert [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks] == [
        (i, 0, None) for i in range(5)
    ]
    assert pool.take_events() == []


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 16), ValueError, "num_blocks: expected int >= 1, found 0"),
        ((4, 0), ValueError, "block_size: expected int >= 1, found 0"),
        ((4.0, 16), TypeError, "num_blocks: expected int, found float"),
        ((4, True), TypeError, "block_size: expected int, found bool"),
    ],
)
def test_constructor_rejects_bad_sizes(
    args: tuple[object, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        BlockPool(*args)  # type: ignore[arg-type]


# -- allocate -----------------------------------------------------------------


def test_allocate_takes_front_blocks_with_one_reference() -> None:
    pool = BlockPool(6, 4)
    blocks = pool.allocate(4)
    assert blocks is not None
    assert ids(blocks) == [0, 1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    assert free_ids(pool) == [4, 5]
    assert pool.usage == pytest.approx(4 / 6)
    assert pool.allocate(0) == []
    assert free_ids(pool) == [4, 5]


def test_allocate_without_room_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4, 4)
    held = pool.allocate(2)
    assert held is not None
    pool.cache_full_blocks(held, chain("a", 2), 0, 2)
    pool.free(list(reversed(held)))
    before = snapshot(pool)
    assert pool.allocate(5) is None
    assert snapshot(pool) == before
    # The cached blocks are still findable: a failed allocate evicts nothing.
    assert ids(pool.find_longest_cache_hit(chain("a", 2))) == [0, 1]


@pytest.mark.parametrize(
    ("num_blocks", "error", "message"),
    [
        (-1, ValueError, "expected int >= 0, found -1"),
        (1.5, TypeError, "expected int, found float"),
    ],
)
def test_allocate_rejects_bad_counts(
    num_blocks: object, error: type[Exception], message: str
) -> None:
    pool = BlockPool(4, 4)
    before = snapshot(pool)
    with pytest.raises(error, match=message):
        pool.allocate(num_blocks)  # type: ignore[arg-type]
    assert snapshot(pool) == before


# -- eviction order -------------------------------------------------------------


def test_freed_request_evicts_uncached_first_then_chain_tail_first() -> None:
    pool = BlockPool(8, 4)
    recorder = Recorder()
    pool.add_eviction_listener(recorder)
    keys = chain("a", 3)
    blocks = pool.allocate(4)  # three full blocks and one partial block
    assert blocks is not None
    assert pool.cache_full_blocks(blocks, keys, 0, 3) == 3
    pool.take_events()
    pool.free(list(reversed(blocks)))
    # Uncached block 3 goes to the front; the chain enters the back tail first.
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1, 0]
    # Lazy eviction: the freed chain is still a full hit.
    assert ids(pool.find_longest_cache_hit(keys)) == [0, 1, 2]

    reused = pool.allocate(7)
    assert reused is not None
    assert ids(reused) == [3, 4, 5, 6, 7, 2, 1]
    assert recorder.calls == [(2, keys[2]), (1, keys[1])]
    assert pool.take_events() == [BlockRemoved((keys[2], keys[1]))]
    assert pool.num_evictions == 2
    assert pool.get_block_hash(2) is None
    assert pool.get_block_hash(0) == keys[0]
    assert ids(pool.find_longest_cache_hit(keys)) == [0]
    assert free_ids(pool) == [0]


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(8, 4)
    recorder = Recorder()
    pool.add_eviction_listener(recorder)
    a_keys, b_keys = chain("a", 2), chain("b", 2)
    a_blocks = pool.allocate(2)
    assert a_blocks is not None
    pool.cache_full_blocks(a_blocks, a_keys, 0, 2)
    pool.free(list(reversed(a_blocks)))
    b_blocks = pool.allocate(2)  # uncached blocks 2 and 3 come before cached A
    assert b_blocks is not None
    assert ids(b_blocks) == [2, 3]
    pool.cache_full_blocks(b_blocks, b_keys, 0, 2)
    pool.free(list(reversed(b_blocks)))
    assert free_ids(pool) == [4, 5, 6, 7, 1, 0, 3, 2]

    # A is used again (a hit touches it), so B becomes the least recently used.
    hit = pool.find_longest_cache_hit(a_keys)
    assert ids(hit) == [0, 1]
    pool.touch(hit)
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2]
    assert [b.ref_cnt for b in hit] == [1, 1]
    pool.free(list(reversed(hit)))
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1, 0]

    reused = pool.allocate(6)
    assert reused is not None
    assert ids(reused) == [4, 5, 6, 7, 3, 2]
    assert recorder.calls == [(3, b_keys[1]), (2, b_keys[0])]
    assert pool.find_longest_cache_hit(b_keys) == []
    assert ids(pool.find_longest_cache_hit(a_keys)) == [0, 1]


def test_uncached_blocks_are_reused_before_any_cached_block() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.cache_full_blocks(blocks, chain("a", 2), 0, 2)
    # Freed in eviction order 3, 1, 2, 0: uncached 3 and 2 go to the front in
    # that order, cached 1 and 0 to the back in that order.
    pool.free([blocks[3], blocks[1], blocks[2], blocks[0]])
    assert free_ids(pool) == [3, 2, 1, 0]
    more = pool.allocate(1)
    assert more is not None
    pool.free(more)
    assert free_ids(pool) == [3, 2, 1, 0]


def test_shared_block_stays_in_use_until_its_last_reference_is_freed() -> None:
    pool = BlockPool(4, 4)
    keys = chain("a", 2)
    first = pool.allocate(2)
    assert first is not None
    pool.cache_full_blocks(first, keys, 0, 2)
    hit = pool.find_longest_cache_hit(keys)
    pool.touch(hit)
    assert [b.ref_cnt for b in first] == [2, 2]
    pool.free(list(reversed(first)))
    assert [b.ref_cnt for b in first] == [1, 1]
    assert free_ids(pool) == [2, 3]
    pool.free(list(reversed(hit)))
    assert free_ids(pool) == [2, 3, 1, 0]


# -- lookup ---------------------------------------------------------------------


def test_lookup_stops_at_first_miss_and_respects_the_cap() -> None:
    pool = BlockPool(8, 4)
    keys = chain("a", 4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.cache_full_blocks(blocks, keys, 0, 4)
    assert ids(pool.find_longest_cache_hit(keys)) == [0, 1, 2, 3]
    assert ids(pool.find_longest_cache_hit(keys, 2)) == [0, 1]
    assert pool.find_longest_cache_hit(keys, 0) == []
    assert pool.find_longest_cache_hit([]) == []
    assert ids(pool.find_longest_cache_hit([*keys[:2], key("x"), keys[3]])) == [0, 1]
    assert pool.find_longest_cache_hit([key("x"), *keys]) == []
    assert pool.get_cached_block(keys[3]) is blocks[3]
    assert pool.get_cached_block(key("x")) is None
    with pytest.raises(ValueError, match="max_num_blocks: expected int >= 0 or None, found -1"):
        pool.find_longest_cache_hit(keys, -1)


def test_get_block_hash_rejects_unknown_ids() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(ValueError, match=re.escape("block_id: expected int in [0, 1], found 2")):
        pool.get_block_hash(2)


# -- touch and free errors --------------------------------------------------------


def test_touch_rejects_free_uncached_and_foreign_blocks_without_changes() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"blocks\[1\]: expected a block in use or holding a key"):
        pool.touch([blocks[0], pool.blocks[3]])
    with pytest.raises(ValueError, match=r"\[1\]: block 0 does not belong to this pool"):
        pool.touch([blocks[1], BlockPool(4, 4).blocks[0]])
    with pytest.raises(TypeError, match=r"\[0\]: expected CacheBlock, found int"):
        pool.touch([0])  # type: ignore[list-item]
    assert snapshot(pool) == before


def test_double_free_raises_and_restores_every_count() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(3)
    assert blocks is not None
    before = snapshot(pool)
    with pytest.raises(RuntimeError, match=r"ordered_blocks\[2\]: block 0 freed more often"):
        pool.free([blocks[0], blocks[1], blocks[0]])
    assert snapshot(pool) == before
    pool.free([blocks[2]])
    after_one = snapshot(pool)
    with pytest.raises(RuntimeError, match=r"ordered_blocks\[1\]: block 2 freed more often"):
        pool.free([blocks[1], blocks[2]])
    assert snapshot(pool) == after_one


def test_free_rejects_foreign_and_non_blocks_without_changes() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    other = BlockPool(4, 4).allocate(1)
    assert other is not None
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"\[1\]: block 0 does not belong to this pool"):
        pool.free([blocks[1], other[0]])
    with pytest.raises(TypeError, match=r"\[1\]: expected CacheBlock, found str"):
        pool.free([blocks[0], "block"])  # type: ignore[list-item]
    assert snapshot(pool) == before


# -- registration and events -----------------------------------------------------


def test_cache_full_blocks_emits_chained_stored_events() -> None:
    pool = BlockPool(8, 4)
    keys = chain("a", 5)
    blocks = pool.allocate(5)
    assert blocks is not None
    assert pool.cache_full_blocks(blocks, keys, 0, 2) == 2
    assert pool.cache_full_blocks(blocks, keys, 2, 2) == 0
    assert pool.cache_full_blocks(blocks, keys, 2, 5) == 3
    events = pool.take_events()
    assert events == [
        BlockStored(tuple(keys[:2]), None, 8, 4),
        BlockStored(tuple(keys[2:]), keys[1], 12, 4),
    ]
    assert pool.take_events() == []
    assert [pool.get_block_hash(i) for i in range(6)] == [*keys, None]
    assert pool.num_cached_blocks == 5
    # Registering blocks that already hold their keys is a no-op.
    assert pool.cache_full_blocks(blocks, keys, 0, 5) == 0
    assert pool.take_events() == []


def test_event_keys_are_offered_as_hex_and_low_64_bits() -> None:
    k0 = BlockHash(bytes(range(32)))
    k1 = BlockHash(bytes(range(100, 132)))
    stored = BlockStored((k0, k1), k0, 32, 16)
    assert stored.block_hashes_hex == [bytes(range(32)).hex(), bytes(range(100, 132)).hex()]
    assert stored.block_hashes_low64 == [0x18191A1B1C1D1E1F, 0x7C7D7E7F80818283]
    assert stored.parent_block_hash_hex == bytes(range(32)).hex()
    assert stored.parent_block_hash_low64 == 0x18191A1B1C1D1E1F
    root = BlockStored((k0,), None, 16, 16)
    assert root.parent_block_hash_hex is None
    assert root.parent_block_hash_low64 is None
    removed = BlockRemoved((k1,))
    assert removed.block_hashes_hex == [bytes(range(100, 132)).hex()]
    assert removed.block_hashes_low64 == [0x7C7D7E7F80818283]


def test_duplicate_key_stays_with_its_first_block() -> None:
    pool = BlockPool(8, 4)
    keys = chain("a", 3)
    first = pool.allocate(3)
    second = pool.allocate(3)
    assert first is not None and second is not None
    # Two requests computed the same first two blocks concurrently.
    assert pool.cache_full_blocks(first, keys, 0, 2) == 2
    assert pool.cache_full_blocks(second, keys, 0, 3) == 1
    assert pool.take_events() == [
        BlockStored(tuple(keys[:2]), None, 8, 4),
        BlockStored((keys[2],), keys[1], 4, 4),
    ]
    held_keys = [pool.get_block_hash(i) for i in range(6)]
    assert held_keys == [keys[0], keys[1], None, None, None, keys[2]]
    assert ids(pool.find_longest_cache_hit(keys)) == [0, 1, 5]
    # The duplicates hold no key, so they are reused first once freed.
    pool.free(list(reversed(second)))
    assert free_ids(pool) == [4, 3, 6, 7, 5]


def test_duplicate_in_the_middle_splits_the_stored_events() -> None:
    pool = BlockPool(8, 4)
    keys = chain("a", 3)
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert first is not None and second is not None
    assert pool.cache_full_blocks(first, keys, 1, 2) == 1
    assert pool.cache_full_blocks(second, keys, 0, 3) == 2
    assert pool.take_events() == [
        BlockStored((keys[1],), keys[0], 4, 4),
        BlockStored((keys[0],), None, 4, 4),
        BlockStored((keys[2],), keys[1], 4, 4),
    ]
    assert ids(pool.find_longest_cache_hit(keys)) == [2, 1, 4]


def test_cache_full_blocks_rejects_bad_calls_without_changes() -> None:
    pool = BlockPool(8, 4)
    keys = chain("a", 3)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks, keys, 0, 1)
    pool.take_events()
    free_block = pool.blocks[7]
    before = snapshot(pool)
    cases: list[tuple[tuple[object, ...], str]] = [
        ((blocks, keys, 2, 1), r"num_cached_blocks: expected 0\.\.1 \(num_full_blocks\), found 2"),
        ((blocks, keys, -1, 1), r"num_cached_blocks: expected 0\.\.1"),
        ((blocks, keys[:2], 0, 3), r"num_full_blocks: expected <= 2 .* found 3"),
        ((blocks[:2], keys, 0, 3), r"num_full_blocks: expected <= 2 .* found 3"),
        (([*blocks[:2], free_block], keys, 1, 3), r"blocks\[2\]: expected a block in use"),
        (([blocks[0], blocks[1], blocks[1]], keys, 1, 3), r"blocks\[2\]: block 1 listed twice"),
        ((blocks, [key("z"), *keys[1:]], 0, 3), r"blocks\[0\]: block 0 holds key"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            pool.cache_full_blocks(*args)  # type: ignore[arg-type]
        assert snapshot(pool) == before


def test_events_can_be_disabled() -> None:
    pool = BlockPool(2, 4, enable_events=False)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, chain("a", 2), 0, 2)
    pool.free(list(reversed(blocks)))
    assert pool.allocate(2) is not None
    assert pool.num_evictions == 2
    assert pool.take_events() == []


# -- reset and listeners ----------------------------------------------------------


def test_reset_refuses_while_blocks_are_in_use_then_clears_every_key() -> None:
    pool = BlockPool(4, 4)
    recorder = Recorder()
    pool.add_eviction_listener(recorder)
    keys = chain("a", 3)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks, keys, 0, 3)
    pool.take_events()
    before = snapshot(pool)
    assert pool.reset() is False
    assert snapshot(pool) == before
    assert recorder.calls == []

    pool.free(list(reversed(blocks)))
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert sorted(recorder.calls) == sorted(zip([0, 1, 2], keys, strict=True))
    assert pool.num_cached_blocks == 0
    assert pool.find_longest_cache_hit(keys) == []
    assert [b.block_hash for b in pool.blocks] == [None] * 4
    assert pool.num_evictions == 0
    # Reusing a block after reset evicts nothing.
    assert pool.allocate(4) is not None
    assert pool.take_events() == []
    assert len(recorder.calls) == 3


def test_listener_sees_a_consistent_pool_and_can_be_removed() -> None:
    pool = BlockPool(2, 4)
    seen: list[tuple[int, bool, bool]] = []

    def check(block_id: int, block_hash: BlockHash) -> None:
        seen.append(
            (block_id, pool.get_block_hash(block_id) is None, block_hash in pool.hash_to_block)
        )

    recorder = Recorder()
    pool.add_eviction_listener(check)
    pool.add_eviction_listener(recorder)
    keys = chain("a", 2)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, keys, 0, 2)
    pool.free(list(reversed(blocks)))
    again = pool.allocate(1)
    assert again is not None
    assert seen == [(1, True, False)]
    pool.remove_eviction_listener(check)
    with pytest.raises(ValueError, match="expected a registered eviction listener"):
        pool.remove_eviction_listener(check)
    with pytest.raises(TypeError, match="callback: expected a callable, found int"):
        pool.add_eviction_listener(3)  # type: ignore[arg-type]
    assert pool.allocate(1) is not None
    assert seen == [(1, True, False)]
    assert recorder.calls == [(1, keys[1]), (0, keys[0])]


# -- stateful comparison with a reference model ----------------------------------


@dataclass
class ModelPool:
    """The pool's rules restated with plain lists and dicts."""

    num_blocks: int
    free_order: list[int]
    ref_cnt: list[int]
    block_key: list[BlockHash | None]
    key_to_block: dict[BlockHash, int] = field(default_factory=dict)
    events: list[object] = field(default_factory=list)
    lost: list[tuple[int, BlockHash]] = field(default_factory=list)
    num_evictions: int = 0

    @classmethod
    def new(cls, num_blocks: int) -> ModelPool:
        return cls(num_blocks, list(range(num_blocks)), [0] * num_blocks, [None] * num_blocks)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_order):
            return None
        taken, self.free_order = self.free_order[:n], self.free_order[n:]
        removed = []
        for block_id in taken:
            self.ref_cnt[block_id] = 1
            old = self.block_key[block_id]
            if old is not None:
                del self.key_to_block[old]
                self.block_key[block_id] = None
                removed.append(old)
                self.lost.append((block_id, old))
        if removed:
            self.num_evictions += len(removed)
            self.events.append(BlockRemoved(tuple(removed)))
        return taken

    def lookup(self, keys: list[BlockHash], cap: int) -> list[int]:
        found = []
        for k in keys[:cap]:
            if k not in self.key_to_block:
                break
            found.append(self.key_to_block[k])
        return found

    def touch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                self.free_order.remove(block_id)
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        front: list[int] = []
        back: list[int] = []
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                (back if self.block_key[block_id] is not None else front).append(block_id)
        self.free_order = front + self.free_order + back

    def cache(self, block_ids: list[int], keys: list[BlockHash], start: int, stop: int) -> None:
        stored: list[int] = []
        for i in range(start, stop):
            block_id, k = block_ids[i], keys[i]
            if self.block_key[block_id] is None and k not in self.key_to_block:
                self.key_to_block[k] = block_id
                self.block_key[block_id] = k
                stored.append(i)
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = keys[run[0] - 1] if run[0] > 0 else None
            self.events.append(BlockStored(tuple(keys[i] for i in run), parent, 4 * len(run), 4))

    def reset(self) -> bool:
        if len(self.free_order) != self.num_blocks:
            return False
        self.lost.extend((b, k) for k, b in self.key_to_block.items())
        self.key_to_block.clear()
        self.block_key = [None] * self.num_blocks
        self.events.append(AllBlocksCleared())
        return True


@dataclass
class Held:
    blocks: list[CacheBlock]
    keys: list[BlockHash]
    num_cached: int


NUM_POOL_BLOCKS = 12
PROMPTS = [chain(prefix, 6) for prefix in ("p", "q", "r")]
# Prompts sharing a prefix with PROMPTS[0], so chains fork in the table.
PROMPTS.append([*PROMPTS[0][:2], *chain("s", 4)])


class PoolMachine(RuleBasedStateMachine):
    # Pool calls checked against the model, over every example of a run.
    num_operations = 0

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_POOL_BLOCKS, 4)
        self.lost: list[tuple[int, BlockHash]] = []
        self.pool.add_eviction_listener(lambda b, k: self.lost.append((b, k)))
        self.model = ModelPool.new(NUM_POOL_BLOCKS)
        self.held: list[Held] = []

    def _count(self, num_operations: int) -> None:
        PoolMachine.num_operations += num_operations

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        num_blocks=st.integers(1, 6),
        cap=st.integers(0, 6),
        num_full=st.integers(0, 6),
    )
    def start(self, prompt: int, num_blocks: int, cap: int, num_full: int) -> None:
        keys = PROMPTS[prompt][:num_blocks]
        hit = self.pool.find_longest_cache_hit(keys, cap)
        hit_ids = self.model.lookup(keys, cap)
        assert ids(hit) == hit_ids
        self._count(1)
        num_free_after_touch = self.pool.num_free_blocks - sum(b.ref_cnt == 0 for b in hit)
        if num_blocks - len(hit) > num_free_after_touch:
            return  # no room once the hit is touched; the caller would wait
        self.pool.touch(hit)
        self.model.touch(hit_ids)
        new = self.pool.allocate(num_blocks - len(hit))
        assert new is not None
        assert ids(new) == self.model.allocate(num_blocks - len(hit))
        held = Held(hit + new, keys, len(hit))
        self.held.append(held)
        num_full = max(len(hit), min(num_full, num_blocks))
        self.pool.cache_full_blocks(held.blocks, keys, len(hit), num_full)
        self.model.cache(ids(held.blocks), keys, len(hit), num_full)
        held.num_cached = num_full
        self._count(3)

    @rule(num_blocks=st.integers(0, 4))
    def allocate_raw(self, num_blocks: int) -> None:
        got = self.pool.allocate(num_blocks)
        expected = self.model.allocate(num_blocks)
        assert (None if got is None else ids(got)) == expected
        self._count(1)
        if got:
            self.held.append(Held(got, [], 0))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def cache_more(self, data: st.DataObject) -> None:
        held = data.draw(st.sampled_from(self.held))
        stop = data.draw(st.integers(held.num_cached, len(held.keys)))
        self.pool.cache_full_blocks(held.blocks, held.keys, held.num_cached, stop)
        self.model.cache(ids(held.blocks), held.keys, held.num_cached, stop)
        held.num_cached = stop
        self._count(1)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free(list(reversed(held.blocks)))
        self.model.free(list(reversed(ids(held.blocks))))
        self._count(1)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def double_free_is_rejected(self, data: st.DataObject) -> None:
        held = data.draw(st.sampled_from(self.held))
        block = held.blocks[0]
        before = snapshot(self.pool)
        with pytest.raises(RuntimeError):
            self.pool.free([block] * (block.ref_cnt + 1))
        assert snapshot(self.pool) == before
        self._count(1)

    @rule(gate=st.integers(0, 7))
    def reset(self, gate: int) -> None:
        # NOTE: rarely, so that caches grow long enough to be evicted.
        if gate == 0:
            assert self.pool.reset() is self.model.reset()
            self._count(1)

    @invariant()
    def same_state(self) -> None:
        pool, model = self.pool, self.model
        assert free_ids(pool) == model.free_order
        assert [b.ref_cnt for b in pool.blocks] == model.ref_cnt
        assert [b.block_hash for b in pool.blocks] == model.block_key
        assert {k: b.block_id for k, b in pool.hash_to_block.items()} == model.key_to_block
        assert pool.num_evictions == model.num_evictions
        assert pool.take_events() == model.events
        model.events.clear()
        assert self.lost == model.lost
        assert pool.usage == pytest.approx(1 - len(model.free_order) / NUM_POOL_BLOCKS)


def test_pool_matches_reference_model() -> None:
    PoolMachine.num_operations = 0
    run_state_machine_as_test(
        PoolMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=60,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    assert PoolMachine.num_operations >= 10_000
