"""TensorStore writes: rows into slots, fill counts and stamps, and rejected writes.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from helpers import DEVICE_CONFIGS, DeviceConfig, block_slots, cpu, key
from store_helpers import SCATTERED, assert_same, make, rows, snapshot

from omnicache.store import StaleBlockError, TensorStore, WriteResult

# -- writes and stamps --------------------------------------------------------


def test_write_full_keyed_blocks_stamps_them_and_reads_back_exactly(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 12, 3)
    result = store.write(
        "h", data, block_slots([5, 2, 7], 4), block_keys={5: key(5), 2: key(2), 7: key(7)}
    )
    assert result == WriteResult("h", 12, (5, 2, 7), ())
    assert [store.stamp_of("h", b) for b in range(8)] == [
        None,
        None,
        key(2),
        None,
        None,
        key(5),
        None,
        key(7),
    ]
    got = store.read_blocks("h", [2, 7, 5], [key(2), key(7), key(5)])
    assert got.device.type == cfg.store_device
    expected = torch.cat([cpu(data)[4:8], cpu(data)[8:12], cpu(data)[0:4]])
    assert torch.equal(cpu(got), expected)


def test_partial_write_leaves_block_unstamped_until_it_is_full(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 4, 3)
    # Chunked prefill: offsets 0..2 of block 3 now, offset 3 in the next step.
    first = store.write("h", data[:3], [12, 13, 14], block_keys={3: key(3)})
    assert first == WriteResult("h", 3, (), (3,))
    assert store.stamp_of("h", 3) is None
    with pytest.raises(StaleBlockError):
        store.read_blocks("h", [3], [key(3)])
    second = store.write("h", data[3:], [15], block_keys={3: key(3)})
    assert second == WriteResult("h", 1, (3,), ())
    assert torch.equal(cpu(store.read_blocks("h", [3], [key(3)])), cpu(data))
    stats = store.stats
    assert (stats.num_stamped_blocks, stats.num_incomplete_blocks, stats.num_stale_reads) == (
        1,
        1,
        1,
    )


def test_a_gap_breaks_the_run_until_the_next_offset_zero_write(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 4, 3)
    store.write("h", data[:1], [4])  # offset 0
    store.write("h", data[2:3], [6])  # offset 2: offset 1 was skipped
    result = store.write("h", data[1:2], [5])  # offset 1 after 2: out of order
    assert result.stamped_block_ids == ()
    assert store.write("h", data[3:], [7], block_keys={1: key(1)}) == WriteResult("h", 1, (), (1,))
    assert store.stamp_of("h", 1) is None
    # Every row is written now, but never in order: still no stamp. A fresh
    # run from offset 0 completes it.
    assert store.write(
        "h", data, block_slots([1], 4), block_keys={1: key(1)}
    ).stamped_block_ids == (1,)


def test_full_block_without_key_stays_unstamped_and_any_touch_clears_a_stamp(
    cfg: DeviceConfig,
) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 4, 3)
    assert store.write("h", data, block_slots([6], 4)) == WriteResult("h", 4, (), ())
    assert store.stamp_of("h", 6) is None
    store.write("h", data, block_slots([6], 4), block_keys={6: key(6)})
    assert store.stamp_of("h", 6) == key(6)
    # Rewriting one row without the key: the block's rows changed, so no stamp.
    store.write("h", rows(cfg, 1, 3, seed=9), [25])
    assert store.stamp_of("h", 6) is None
    with pytest.raises(
        StaleBlockError,
        match=r"entry 'h': block 6 \(block 0\) expected key " + key(6).hex() + ", found no key",
    ):
        store.read_blocks("h", [6], [key(6)])


def test_stamp_is_per_entry(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    store.register("codes", 2, torch.int64)
    store.write("h", rows(cfg, 4, 3), block_slots([1], 4), block_keys={1: key(1)})
    assert store.stamp_of("h", 1) == key(1)
    assert store.stamp_of("codes", 1) is None
    assert store.probe([1], [key(1)], names=["h"]) == 1
    assert store.probe([1], [key(1)]) == 0
    assert store.probe([1], [key(2)], names=["h"]) == 0
    assert store.stats.num_stale_reads == 0  # probing only looks


def test_write_rows_are_moved_bit_exactly(cfg: DeviceConfig) -> None:
    # bf16 bit patterns of every kind, NaN payloads included, through the
    # wide (complex128) indexed copies (by slot and by block) and gathers.
    store = make(cfg, num_blocks=16, block_size=2)
    store.register("h", 8, torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**15), 2**15, (32, 8), dtype=torch.int16, generator=gen)
    bits[0] = torch.tensor([0x7FC1, 0x7F81, -1, -32768, 0x7F80, 0, 1, -0x7F], dtype=torch.int16)
    data = bits.view(torch.bfloat16).to(cfg.source_device)
    keys = {b: key(b) for b in SCATTERED}
    # Offset 0 of every block (by slot), then offset 1 completes them.
    first = store.write("h", data[0::2], [2 * b for b in SCATTERED], block_keys=keys)
    assert first.stamped_block_ids == () and first.incomplete_block_ids == tuple(SCATTERED)
    second = store.write("h", data[1::2], [2 * b + 1 for b in SCATTERED], block_keys=keys)
    assert second.stamped_block_ids == tuple(SCATTERED)
    got = store.read_blocks("h", SCATTERED, [key(b) for b in SCATTERED])
    assert torch.equal(cpu(got).view(torch.int16), bits)
    # Whole blocks by block id, in another order.
    order = sorted(SCATTERED)
    store.write("h", data, block_slots(order, 2), block_keys=keys)
    got = store.read_blocks("h", order, [key(b) for b in order])
    assert torch.equal(cpu(got).view(torch.int16), bits)


@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [
        (torch.float32, (3,)),
        (torch.uint8, (5,)),
        (torch.int64, (2, 2)),
        (torch.bool, (7,)),
        (torch.float16, (4,)),
    ],
)
def test_odd_row_sizes_and_dtypes_round_trip(
    cfg: DeviceConfig, dtype: torch.dtype, row_shape: tuple[int, ...]
) -> None:
    store = make(cfg, num_blocks=16, block_size=2)
    store.register("e", row_shape, dtype)
    data = (
        (torch.arange(32 * int(np.prod(row_shape))) % 251)
        .to(dtype)
        .view(32, *row_shape)
        .to(cfg.source_device)
    )
    store.write("e", data, block_slots(SCATTERED, 2), block_keys={b: key(b) for b in SCATTERED})
    got = store.read_blocks("e", SCATTERED, [key(b) for b in SCATTERED])
    assert got.shape == (32, *row_shape) and got.dtype == dtype
    assert torch.equal(cpu(got), cpu(data))
    # Few runs take the copy_ path: blocks 0..3 in order are one run.
    store.write(
        "e", data[:8], block_slots([0, 1, 2, 3], 2), block_keys={b: key(b) for b in range(4)}
    )
    assert torch.equal(
        cpu(store.read_blocks("e", [0, 1, 2, 3], [key(b) for b in range(4)])), cpu(data)[:8]
    )


def test_write_blocks(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 8, 3)
    assert store.write_blocks("h", data, [4, 1], block_keys=[key(4), key(1)]) == WriteResult(
        "h", 8, (4, 1), ()
    )
    assert torch.equal(cpu(store.read_blocks("h", [1], [key(1)])), cpu(data)[4:])
    with pytest.raises(ValueError, match=r"block_keys: expected 2 keys \(one per block\), found 1"):
        store.write_blocks("h", data, [4, 1], block_keys=[key(4)])
    with pytest.raises(ValueError, match=r"block_ids: expected distinct blocks, found \[4, 4\]"):
        store.write_blocks("h", data, [4, 4])
    with pytest.raises(IndexError, match=r"block_ids\[1\]: expected 0..7, found 8"):
        store.write_blocks("h", data, [4, 8])


# -- rejected writes change nothing --------------------------------------------


def rejected_write_cases(
    cfg: DeviceConfig,
) -> Iterator[tuple[str, type[Exception], str, Callable[[TensorStore], object]]]:
    ok = rows(cfg, 4, 3)
    slots = block_slots([2], 4)
    yield (
        "unknown entry",
        ValueError,
        r"name: expected a registered entry \['h'\], found 'x'",
        lambda s: s.write("x", ok, slots),
    )
    yield (
        "dim",
        ValueError,
        r"entry 'h': expected rows of shape \(n, 3\), found \(4, 5\)",
        lambda s: s.write("h", rows(cfg, 4, 5), slots),
    )
    yield (
        "ndim",
        ValueError,
        r"entry 'h': expected rows of shape \(n, 3\), found \(4, 3, 1\)",
        lambda s: s.write("h", ok[..., None], slots),
    )
    yield (
        "dtype",
        ValueError,
        r"entry 'h': expected dtype torch.float32, found torch.float64",
        lambda s: s.write("h", ok.double(), slots),
    )
    yield (
        "too few rows",
        ValueError,
        r"entry 'h': expected at least 4 rows, found 3",
        lambda s: s.write("h", ok[:3], slots),
    )
    yield (
        "slot high",
        IndexError,
        r"slot_mapping\[2\]: expected 0..31, found 32",
        lambda s: s.write("h", ok, [8, 9, 32, 10]),
    )
    yield (
        "slot negative",
        IndexError,
        r"slot_mapping\[0\]: expected 0..31, found -1",
        lambda s: s.write("h", ok, [-1, 9, 10, 11]),
    )
    yield (
        "duplicate slot",
        ValueError,
        r"slot_mapping: expected distinct slots, found slot 9 at rows \[0, 2\]",
        lambda s: s.write("h", ok, [9, 10, 9, 11]),
    )
    yield (
        "float slots",
        TypeError,
        r"slot_mapping: expected an integer tensor, found dtype torch.float32",
        lambda s: s.write("h", ok, torch.zeros(4)),
    )
    yield (
        "num_tokens",
        ValueError,
        r"num_tokens: expected int in \[0, 4\] or None, found 5",
        lambda s: s.write("h", ok, slots, num_tokens=5),
    )
    yield (
        "key type",
        TypeError,
        r"block_keys\[2\]: expected bytes, found str",
        lambda s: s.write("h", ok, slots, block_keys={2: "k"}),  # type: ignore[dict-item]
    )
    yield (
        "key block",
        IndexError,
        r"block_keys: expected block ids 0..7, found 9",
        lambda s: s.write("h", ok, slots, block_keys={9: key(9)}),
    )
    yield (
        "outputs dtype",
        ValueError,
        r"entry 'h': expected dtype torch.float32, found torch.float16",
        lambda s: s.write_outputs(
            slots, multimodal_outputs={"new": rows(cfg, 4, 2), "h": ok.half()}
        ),
    )
    yield (
        "outputs slots",
        IndexError,
        r"slot_mapping\[3\]: expected 0..31, found 40",
        lambda s: s.write_outputs([0, 1, 2, 40], hidden_states=rows(cfg, 4, 6)),
    )
    yield (
        "outputs duplicate",
        ValueError,
        r"expected distinct slots",
        lambda s: s.write_outputs([0, 1, 0, 3], hidden_states=rows(cfg, 4, 6)),
    )


CASE_NAMES = [c[0] for c in rejected_write_cases(DEVICE_CONFIGS[0])]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_rejected_write_changes_nothing(cfg: DeviceConfig, case: str) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    store.write(
        "h", rows(cfg, 8, 3, seed=1), block_slots([2, 3], 4), block_keys={2: key(2), 3: key(3)}
    )
    store.write("h", rows(cfg, 2, 3, seed=2), [20, 21], block_keys={5: key(5)})
    [(_, exc, pattern, call)] = [c for c in rejected_write_cases(cfg) if c[0] == case]
    before = snapshot(store)
    with pytest.raises(exc, match=pattern):
        call(store)
    assert_same(before, snapshot(store))
