"""TensorStore's entries: construction, registration, capacity, and what clears their stamps.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DeviceConfig, block_slots, key
from store_helpers import assert_same, make, rows, snapshot

import omnicache
import omnicache.store
from omnicache.reference.block_pool import BlockPool
from omnicache.store import HIDDEN_STATES, EntrySpec, StoreCapacityError, TensorStore
from omnicache.store.blocks import SMALL_BLOCK_IDS

# -- construction and registration -------------------------------------------


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"num_blocks: expected int >= 1, found 0"):
        TensorStore(0, 4)
    with pytest.raises(TypeError, match=r"block_size: expected int, found float"):
        TensorStore(4, 4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device: expected 'cpu' or 'cuda\[:N\]', found 'meta'"):
        TensorStore(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"hidden_size and hidden_dtype: expected both or neither"):
        TensorStore(4, 4, hidden_size=8)
    with pytest.raises(ValueError, match=r"max_bytes: expected int >= 0 or None, found -1"):
        TensorStore(4, 4, max_bytes=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"CUDA is not available"):
            TensorStore(4, 4, device="cuda")
        with pytest.raises(ValueError, match=r"pin_memory: expected False or None without CUDA"):
            TensorStore(4, 4, pin_memory=True)
        assert TensorStore(4, 4).pin_memory is False


def test_register_declares_entries_with_exact_sizes(cfg: DeviceConfig) -> None:
    store = make(cfg, hidden_size=6, hidden_dtype=torch.bfloat16)
    codes = store.register("codes", (2, 3), torch.int32)
    audio = store.register("audio", 5, torch.float64, deferred=True)
    assert store.entries == {
        HIDDEN_STATES: EntrySpec(HIDDEN_STATES, (6,), torch.bfloat16, False, 8 * 4 * 6 * 2),
        "codes": EntrySpec("codes", (2, 3), torch.int32, False, 8 * 4 * 6 * 4),
        "audio": EntrySpec("audio", (5,), torch.float64, True, 8 * 4 * 5 * 8),
    }
    assert codes == store.entries["codes"] and audio.deferred
    assert store.nbytes == 384 + 768 + 1280
    # The same spec again is a no-op; a different one is an error.
    assert store.register("codes", (2, 3), torch.int32) == codes
    with pytest.raises(
        ValueError,
        match=r"entry 'codes': already registered as rows \(2, 3\) of torch.int32, "
        r"found rows \(6,\) of torch.int32",
    ):
        store.register("codes", 6, torch.int32)
    with pytest.raises(TypeError, match=r"dtype: expected torch.dtype, found str"):
        store.register("x", 4, "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dim: expected positive sizes, found \(0,\)"):
        store.register("x", 0, torch.float32)
    with pytest.raises(ValueError, match=r"name: expected a non-empty str, found ''"):
        store.register("", 4, torch.float32)
    assert list(store.entries) == [HIDDEN_STATES, "codes", "audio"]


def test_capacity_is_an_explicit_error_at_register(cfg: DeviceConfig) -> None:
    # 8 blocks x 4 tokens x 4 values x 4 bytes = 512 bytes per float32 entry of dim 4.
    store = make(cfg, max_bytes=1000)
    store.register("a", 4, torch.float32)
    before = snapshot(store)
    with pytest.raises(
        StoreCapacityError,
        match=r"entries 'b': need 512 bytes, 488 available \(max_bytes=1000, 512 used by \['a'\]\)",
    ):
        store.register("b", 4, torch.float32)
    assert_same(before, snapshot(store))
    assert isinstance(StoreCapacityError("x"), ValueError)
    store.register("c", 3, torch.float32)  # 384 bytes fit.
    assert store.nbytes == 896


def test_capacity_error_on_lazy_creation_creates_and_writes_nothing(cfg: DeviceConfig) -> None:
    store = make(cfg, max_bytes=700)
    hs = rows(cfg, 4, 4)
    before = snapshot(store)
    with pytest.raises(
        StoreCapacityError,
        match=r"entries 'hidden_states', 'codes': need 1024 bytes, 700 available",
    ):
        store.write_outputs(
            block_slots([1], 4), hidden_states=hs, multimodal_outputs={"codes": rows(cfg, 4, 4)}
        )
    assert_same(before, snapshot(store))
    assert store.entries == {}


# -- block pool ---------------------------------------------------------------


def test_pool_reuse_clears_stamps_through_the_eviction_listener(cfg: DeviceConfig) -> None:
    pool = BlockPool(4, 4)
    store = make(cfg, num_blocks=4)
    store.attach(pool)
    blocks = pool.allocate(2)
    assert blocks is not None
    ids = [b.block_id for b in blocks]
    keys = [key(10), key(11)]
    store.write_outputs(
        block_slots(ids, 4),
        hidden_states=rows(cfg, 8, 3),
        block_keys=dict(zip(ids, keys, strict=True)),
    )
    pool.cache_full_blocks(blocks, keys, 0, 2)
    pool.free(blocks[::-1])
    assert store.probe(ids, keys) == 2
    # Two blocks were never used; the third allocation reuses the chain's tail.
    reused = pool.allocate(3)
    assert reused is not None
    assert [b.block_id for b in reused] == [2, 3, ids[1]]
    assert store.stamp_of(HIDDEN_STATES, ids[1]) is None
    assert store.probe(ids, keys) == 1
    assert store.stats.num_evicted_stamps == 1
    pool.free(reused)
    assert pool.reset()
    assert store.probe(ids, keys) == 0
    assert store.stats.num_evicted_stamps == 2
    store.detach(pool)
    with pytest.raises(
        ValueError, match=r"pool: expected 4 blocks of 4 tokens, found 4 blocks of 2 tokens"
    ):
        store.attach(BlockPool(4, 2))


def test_eviction_resets_the_fill_count(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 4, 3)
    store.write("h", data[:2], [8, 9])
    store.on_block_evicted(2, key(2))
    # A new owner continuing at offset 2 does not complete the old owner's run.
    assert store.write("h", data[2:], [10, 11], block_keys={2: key(2)}).stamped_block_ids == ()
    with pytest.raises(IndexError, match=r"block_id: expected 0..7, found 8"):
        store.on_block_evicted(8, key(8))


def test_invalidate(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.write_outputs(
        block_slots([1, 2], 4), hidden_states=rows(cfg, 8, 3), block_keys={1: key(1), 2: key(2)}
    )
    store.write_outputs([12, 13], hidden_states=rows(cfg, 2, 3))
    store.invalidate([2, 3])
    assert store.probe([1, 2], [key(1), key(2)]) == 1
    # Block 3's run was reset: finishing it from offset 2 stamps nothing.
    assert (
        store.write(
            HIDDEN_STATES, rows(cfg, 2, 3), [14, 15], block_keys={3: key(3)}
        ).stamped_block_ids
        == ()
    )
    # More ids than the small path takes, or ids of numpy's type: the general
    # path, to the same effect.
    store.write_outputs(
        block_slots([1, 2], 4), hidden_states=rows(cfg, 8, 3), block_keys={1: key(1), 2: key(2)}
    )
    store.invalidate([2] * (SMALL_BLOCK_IDS + 1))
    assert store.probe([1, 2], [key(1), key(2)]) == 1
    store.invalidate((np.int64(1),))
    assert store.probe([1], [key(1)]) == 0
    store.write_outputs(block_slots([1], 4), hidden_states=rows(cfg, 4, 3), block_keys={1: key(1)})
    store.invalidate_all()
    assert store.probe([1], [key(1)]) == 0
    with pytest.raises(IndexError, match=r"block_ids\[1\]: expected 0..7, found -1"):
        store.invalidate([0, -1])
    with pytest.raises(
        TypeError, match=r"block_ids: expected a flat sequence of int, found \[1.5\]"
    ):
        store.invalidate([1.5])  # type: ignore[list-item]


def test_every_store_name_is_exported_from_omnicache() -> None:
    assert set(omnicache.store.__all__) <= set(omnicache.__all__)
    for name in omnicache.store.__all__:
        assert getattr(omnicache, name) is getattr(omnicache.store, name), name
