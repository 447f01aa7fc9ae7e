"""Contract tests for TensorStore, run on every device configuration present.

Configurations: a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnicache.block_hash import BlockHash
from omnicache.block_pool import BlockPool
from omnicache.store import (
    HIDDEN_STATES,
    EntrySpec,
    MergedRead,
    ReadMiss,
    ScheduledRequest,
    StaleBlockError,
    StoreCapacityError,
    TensorStore,
    WriteResult,
    _is_one_run,
    _Segments,
)


class Config(NamedTuple):
    name: str
    store_device: str
    source_device: str


CONFIGS = [Config("cpu", "cpu", "cpu")]
if torch.cuda.is_available():
    CONFIGS += [Config("cuda", "cuda", "cuda"), Config("pinned-from-cuda", "cpu", "cuda")]


@pytest.fixture(params=CONFIGS, ids=[c.name for c in CONFIGS])
def cfg(request: pytest.FixtureRequest) -> Config:
    config: Config = request.param
    return config


def make(cfg: Config, num_blocks: int = 8, block_size: int = 4, **kwargs: Any) -> TensorStore:
    return TensorStore(num_blocks, block_size, device=cfg.store_device, **kwargs)


def rows(
    cfg: Config, n: int, *row_shape: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    """Distinct values per row: row i holds seed * 1000 + i * 10 + column."""
    shape = row_shape or (3,)
    width = int(np.prod(shape))
    base = torch.arange(n * width, dtype=torch.float64).view(n, width) % width
    base += torch.arange(n, dtype=torch.float64)[:, None] * 10 + seed * 1000
    return base.to(dtype).view(n, *shape).to(cfg.source_device)


def key(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


def block_slots(block_ids: Sequence[int], block_size: int = 4) -> list[int]:
    return [b * block_size + o for b in block_ids for o in range(block_size)]


def cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def snapshot(store: TensorStore) -> Any:
    """Everything a rejected call must leave unchanged."""
    store.synchronize()
    entries = store._entries
    return (
        {name: cpu(e.cache).clone() for name, e in entries.items()},
        {name: list(e.stamps) for name, e in entries.items()},
        {name: e.filled.copy() for name, e in entries.items()},
        store.entries,
        store.stats,
        {
            r: {n: [(s, cpu(c).clone()) for s, c in ch] for n, ch in per.items()}
            for r, per in store._staged.items()
        },
    )


def assert_same(a: Any, b: Any) -> None:
    caches_a, stamps_a, filled_a, entries_a, stats_a, staged_a = a
    caches_b, stamps_b, filled_b, entries_b, stats_b, staged_b = b
    assert caches_a.keys() == caches_b.keys()
    for name in caches_a:
        assert torch.equal(caches_a[name], caches_b[name]), name
        assert stamps_a[name] == stamps_b[name], name
        assert np.array_equal(filled_a[name], filled_b[name]), name
    assert entries_a == entries_b
    assert stats_a == stats_b
    assert staged_a.keys() == staged_b.keys()
    for req in staged_a:
        for name in staged_a[req]:
            for (s1, c1), (s2, c2) in zip(staged_a[req][name], staged_b[req][name], strict=True):
                assert s1 == s2 and torch.equal(c1, c2)


# -- construction and registration -------------------------------------------


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"num_blocks: expected >= 1, found 0"):
        TensorStore(0, 4)
    with pytest.raises(TypeError, match=r"block_size: expected int, found float"):
        TensorStore(4, 4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device: expected 'cpu' or 'cuda\[:N\]', found 'meta'"):
        TensorStore(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"hidden_size and hidden_dtype: expected both or neither"):
        TensorStore(4, 4, hidden_size=8)
    with pytest.raises(ValueError, match=r"max_bytes: expected >= 0, found -1"):
        TensorStore(4, 4, max_bytes=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"CUDA is not available"):
            TensorStore(4, 4, device="cuda")
        with pytest.raises(ValueError, match=r"pin_memory: expected False or None without CUDA"):
            TensorStore(4, 4, pin_memory=True)
        assert TensorStore(4, 4).pin_memory is False


def test_register_declares_entries_with_exact_sizes(cfg: Config) -> None:
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


def test_capacity_is_an_explicit_error_at_register(cfg: Config) -> None:
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


def test_capacity_error_on_lazy_creation_creates_and_writes_nothing(cfg: Config) -> None:
    store = make(cfg, max_bytes=700)
    hs = rows(cfg, 4, 4)
    before = snapshot(store)
    with pytest.raises(
        StoreCapacityError,
        match=r"entries 'hidden_states', 'codes': need 1024 bytes, 700 available",
    ):
        store.write_outputs(
            block_slots([1]), hidden_states=hs, multimodal_outputs={"codes": rows(cfg, 4, 4)}
        )
    assert_same(before, snapshot(store))
    assert store.entries == {}


# -- writes and stamps --------------------------------------------------------


def test_write_full_keyed_blocks_stamps_them_and_reads_back_exactly(cfg: Config) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 12, 3)
    result = store.write(
        "h", data, block_slots([5, 2, 7]), block_keys={5: key(5), 2: key(2), 7: key(7)}
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


def test_partial_write_leaves_block_unstamped_until_it_is_full(cfg: Config) -> None:
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


def test_a_gap_breaks_the_run_until_the_next_offset_zero_write(cfg: Config) -> None:
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
    assert store.write("h", data, block_slots([1]), block_keys={1: key(1)}).stamped_block_ids == (
        1,
    )


def test_full_block_without_key_stays_unstamped_and_any_touch_clears_a_stamp(cfg: Config) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 4, 3)
    assert store.write("h", data, block_slots([6])) == WriteResult("h", 4, (), ())
    assert store.stamp_of("h", 6) is None
    store.write("h", data, block_slots([6]), block_keys={6: key(6)})
    assert store.stamp_of("h", 6) == key(6)
    # Rewriting one row without the key: the block's rows changed, so no stamp.
    store.write("h", rows(cfg, 1, 3, seed=9), [25])
    assert store.stamp_of("h", 6) is None
    with pytest.raises(
        StaleBlockError,
        match=r"entry 'h': block 6 \(block 0\) expected key " + "06" * 16 + ", found no key",
    ):
        store.read_blocks("h", [6], [key(6)])


def test_stamp_is_per_entry(cfg: Config) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    store.register("codes", 2, torch.int64)
    store.write("h", rows(cfg, 4, 3), block_slots([1]), block_keys={1: key(1)})
    assert store.stamp_of("h", 1) == key(1)
    assert store.stamp_of("codes", 1) is None
    assert store.probe([1], [key(1)], names=["h"]) == 1
    assert store.probe([1], [key(1)]) == 0
    assert store.probe([1], [key(2)], names=["h"]) == 0
    assert store.stats.num_stale_reads == 0  # probing only looks


# No two neighbours adjacent: every block is a run of its own.
SCATTERED = [14, 3, 9, 0, 12, 6, 1, 10, 4, 15, 7, 2, 13, 8, 11, 5]


def test_write_paths_are_chosen_from_the_slot_layout() -> None:
    store = TensorStore(16, 2)

    def segments(slots: list[int]) -> _Segments:
        return store._segments(np.array(slots, dtype=np.int64), None)

    # Scattered whole blocks: one indexed copy by block id.
    whole = segments(block_slots(SCATTERED, 2))
    assert whole.whole_blocks and not _is_one_run(whole)
    assert whole.blocks.tolist() == SCATTERED
    # One row per block: indexed copy by slot.
    firsts = segments([2 * b for b in SCATTERED])
    assert not firsts.whole_blocks and not _is_one_run(firsts)
    assert (firsts.blocks.tolist(), firsts.lens.tolist()) == (SCATTERED, [1] * 16)
    # Consecutive slots: one copy_, whole blocks or not.
    assert _is_one_run(segments(block_slots([0, 1, 2, 3], 2)))
    assert _is_one_run(segments([3, 4, 5, 6, 7]))
    # The same slots out of order are not one run.
    assert not _is_one_run(segments(block_slots([1, 0, 2, 3], 2)))
    assert not _is_one_run(segments([3, 5, 4, 6, 7]))


def test_write_rows_are_moved_bit_exactly(cfg: Config) -> None:
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
    cfg: Config, dtype: torch.dtype, row_shape: tuple[int, ...]
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


def test_write_blocks(cfg: Config) -> None:
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
    cfg: Config,
) -> Iterator[tuple[str, type[Exception], str, Callable[[TensorStore], object]]]:
    ok = rows(cfg, 4, 3)
    slots = block_slots([2])
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
        r"num_tokens: expected int in 0..4, found 5",
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


CASE_NAMES = [c[0] for c in rejected_write_cases(CONFIGS[0])]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_rejected_write_changes_nothing(cfg: Config, case: str) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    store.write(
        "h", rows(cfg, 8, 3, seed=1), block_slots([2, 3]), block_keys={2: key(2), 3: key(3)}
    )
    store.write("h", rows(cfg, 2, 3, seed=2), [20, 21], block_keys={5: key(5)})
    [(_, exc, pattern, call)] = [c for c in rejected_write_cases(cfg) if c[0] == case]
    before = snapshot(store)
    with pytest.raises(exc, match=pattern):
        call(store)
    assert_same(before, snapshot(store))


# -- write_outputs ------------------------------------------------------------


def test_write_outputs_caches_per_token_outputs_and_skips_metadata(cfg: Config) -> None:
    store = make(cfg)
    hs = rows(cfg, 6, 5, dtype=torch.bfloat16)  # 4 real tokens + 2 padding rows
    codes = rows(cfg, 6, 2, 2, dtype=torch.int32, seed=1)
    outputs: dict[str, object] = {
        "codes": codes,
        "ref_len": torch.arange(6),  # 1-D per-request metadata
        "summary": rows(cfg, 2, 3),  # first dim != scheduled token count
        "names": ["a", "b"],
    }
    results = store.write_outputs(
        [4, 5, 6, 7, -1, -1],
        hidden_states=hs,
        multimodal_outputs=outputs,
        num_tokens=4,
        num_tokens_padded=6,
        block_keys={1: key(1)},
    )
    assert results == {
        HIDDEN_STATES: WriteResult(HIDDEN_STATES, 4, (1,), ()),
        "codes": WriteResult("codes", 4, (1,), ()),
    }
    assert store.entries == {
        HIDDEN_STATES: EntrySpec(HIDDEN_STATES, (5,), torch.bfloat16, False, 8 * 4 * 5 * 2),
        "codes": EntrySpec("codes", (2, 2), torch.int32, False, 8 * 4 * 4 * 4),
    }
    assert torch.equal(cpu(store.read_blocks("codes", [1], [key(1)])), cpu(codes)[:4])
    assert torch.equal(cpu(store.read_blocks(HIDDEN_STATES, [1], [key(1)])), cpu(hs)[:4])


def test_write_outputs_takes_strided_rows_of_whole_blocks(cfg: Config) -> None:
    # Column slices of one fused projection (q, k, v) are strided views: the
    # whole-block fast path must move them exactly, and a later entry must
    # never fail after an earlier one was written.
    store = make(cfg)
    fused = rows(cfg, 8, 24)
    q, k, v = fused[:, :8], fused[:, 8:16], fused[:, 16:]
    assert not k.is_contiguous()
    results = store.write_outputs(
        block_slots([2, 5]),
        hidden_states=q,
        multimodal_outputs={"k": k, "v": v},
        block_keys={2: key(2), 5: key(5)},
    )
    assert {name: r.stamped_block_ids for name, r in results.items()} == {
        HIDDEN_STATES: (2, 5),
        "k": (2, 5),
        "v": (2, 5),
    }
    for name, expected in ((HIDDEN_STATES, q), ("k", k), ("v", v)):
        got = store.read_blocks(name, [2, 5], [key(2), key(5)])
        assert torch.equal(cpu(got), cpu(expected)), name


def test_write_outputs_skips_deferred_entries(cfg: Config) -> None:
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    results = store.write_outputs(
        block_slots([3]),
        hidden_states=rows(cfg, 4, 3),
        multimodal_outputs={"audio": rows(cfg, 4, 2)},
        block_keys={3: key(3)},
    )
    assert list(results) == [HIDDEN_STATES]
    assert store.stamp_of("audio", 3) is None


def test_write_outputs_rejects_hidden_states_twice(cfg: Config) -> None:
    store = make(cfg)
    with pytest.raises(
        ValueError, match=r"expected no 'hidden_states' key when hidden_states is given"
    ):
        store.write_outputs(
            [0], hidden_states=rows(cfg, 1, 3), multimodal_outputs={HIDDEN_STATES: rows(cfg, 1, 3)}
        )
    with pytest.raises(
        ValueError,
        match=r"outputs\['hidden_states'\]: expected \(tokens, hidden\) rows, found shape \(1,\)",
    ):
        store.write_outputs([0], hidden_states=torch.zeros(1))
    assert store.entries == {}


# -- merged reads ---------------------------------------------------------------


def test_read_merged_equals_recompute(cfg: Config) -> None:
    store = make(cfg, num_blocks=16)
    # Request "a" computed earlier into blocks 9, 4, 12 (12 tokens), "b" into 2.
    full_a = rows(cfg, 15, 6, dtype=torch.bfloat16, seed=1)
    full_b = rows(cfg, 6, 6, dtype=torch.bfloat16, seed=2)
    codes_a = rows(cfg, 15, 2, dtype=torch.int64, seed=3)
    store.write_outputs(
        block_slots([9, 4, 12]),
        hidden_states=full_a[:12],
        multimodal_outputs={"codes": codes_a[:12]},
        block_keys={9: key(9), 4: key(4), 12: key(12)},
    )
    store.write_outputs(
        block_slots([2]),
        hidden_states=full_b[:4],
        multimodal_outputs={"codes": rows(cfg, 4, 2, dtype=torch.int64)},
        block_keys={2: key(2)},
    )
    # This step: "x" has no hit (5 new rows), "a" hits 3 blocks (3 new rows),
    # "b" hits 1 block (2 new rows).
    new_x = rows(cfg, 5, 6, dtype=torch.bfloat16, seed=4)
    step_hs = torch.cat([new_x, full_a[12:], full_b[4:]])
    step_codes = torch.cat(
        [
            rows(cfg, 5, 2, dtype=torch.int64, seed=5),
            codes_a[12:],
            rows(cfg, 2, 2, dtype=torch.int64, seed=6),
        ]
    )
    requests = [
        ScheduledRequest("x", 5),
        ScheduledRequest("a", 3, 12, [9, 4, 12], [key(9), key(4), key(12)]),
        ScheduledRequest("b", 2, 4, [2], [key(2)]),
    ]
    meta = torch.tensor([7, 8, 9])
    merged = store.read_merged(
        requests, hidden_states=step_hs, multimodal_outputs={"codes": step_codes, "ref_len": meta}
    )
    assert merged.misses == ()
    assert merged.passthrough == {"ref_len": meta} and merged.passthrough["ref_len"] is meta
    assert list(merged.hidden_states) == ["x", "a", "b"]
    assert torch.equal(cpu(merged.hidden_states["x"]), cpu(new_x))
    assert torch.equal(cpu(merged.hidden_states["a"]), cpu(full_a))
    assert torch.equal(cpu(merged.hidden_states["b"]), cpu(full_b))
    assert torch.equal(cpu(merged.tensors["codes"]["a"]), cpu(codes_a))
    assert merged.hidden_states["a"].device.type == cfg.store_device
    stats = store.stats
    assert (stats.num_read_requests, stats.num_hit_blocks_read, stats.num_stale_reads) == (3, 4, 0)


def test_read_merged_gathers_into_given_buffers(cfg: Config) -> None:
    store = make(cfg)
    data = rows(cfg, 8, 3)
    store.write_outputs(block_slots([6, 1]), hidden_states=data, block_keys={6: key(6), 1: key(1)})
    bufs = store.new_read_buffers(32)
    assert (
        bufs[HIDDEN_STATES].shape == (32, 3) and bufs[HIDDEN_STATES].device.type == cfg.store_device
    )
    new = rows(cfg, 2, 3, seed=5)
    merged = store.read_merged(
        [ScheduledRequest("a", 2, 8, [6, 1], [key(6), key(1)])], hidden_states=new, out=bufs
    )
    got = merged.hidden_states["a"]
    assert got.data_ptr() == bufs[HIDDEN_STATES].data_ptr()
    assert torch.equal(cpu(got), torch.cat([cpu(data), cpu(new)]))
    before = snapshot(store)
    with pytest.raises(
        ValueError, match=r"out\['hidden_states'\]: expected shape \(>= 10, 3\), found \(9, 3\)"
    ):
        store.read_merged(
            [ScheduledRequest("a", 2, 8, [6, 1], [key(6), key(1)])],
            hidden_states=new,
            out={HIDDEN_STATES: bufs[HIDDEN_STATES][:9]},
        )
    with pytest.raises(
        ValueError, match=r"out: expected a buffer for entry 'hidden_states', found none"
    ):
        store.read_merged([ScheduledRequest("a", 2)], hidden_states=new, out={})
    assert_same(before, snapshot(store))


def test_read_merged_reports_stale_blocks_as_misses_or_raises(cfg: Config) -> None:
    store = make(cfg)
    data = rows(cfg, 8, 3)
    store.write_outputs(block_slots([6, 1]), hidden_states=data, block_keys={6: key(6), 1: key(1)})
    store.on_block_evicted(1, key(1))
    new = rows(cfg, 3, 3, seed=5)
    requests = [
        ScheduledRequest("a", 1, 8, [6, 1], [key(6), key(1)]),
        ScheduledRequest("b", 2, 4, [6], [key(6)]),
    ]
    merged = store.read_merged(requests, hidden_states=new)
    assert merged.misses == (ReadMiss("a", 2, 1, HIDDEN_STATES),)
    assert list(merged.hidden_states) == ["b"]
    assert torch.equal(cpu(merged.hidden_states["b"]), torch.cat([cpu(data)[:4], cpu(new)[1:]]))
    assert store.stats.num_stale_reads == 1
    before = snapshot(store)
    with pytest.raises(StaleBlockError) as info:
        store.read_merged(requests, hidden_states=new, strict=True)
    err = info.value
    assert (err.name, err.block_id, err.block_index, err.expected, err.found, err.req_id) == (
        HIDDEN_STATES,
        1,
        1,
        key(1),
        None,
        "a",
    )
    assert "of request 'a'" in str(err)
    after = snapshot(store)
    assert after[4].num_stale_reads == before[4].num_stale_reads + 1


def test_read_merged_wrong_key_is_a_miss(cfg: Config) -> None:
    store = make(cfg)
    store.write_outputs(block_slots([3]), hidden_states=rows(cfg, 4, 3), block_keys={3: key(3)})
    merged = store.read_merged(
        [ScheduledRequest("a", 0, 4, [3], [key(4)])], hidden_states=rows(cfg, 0, 3)
    )
    assert merged == MergedRead({HIDDEN_STATES: {}}, {}, (ReadMiss("a", 1, 0, HIDDEN_STATES),))


def test_read_merged_rejects_bad_requests_without_counting(cfg: Config) -> None:
    store = make(cfg)
    store.write_outputs(block_slots([3]), hidden_states=rows(cfg, 4, 3), block_keys={3: key(3)})
    before = snapshot(store)
    hs = rows(cfg, 2, 3)
    with pytest.raises(ValueError, match=r"block_keys: expected 1 keys \(one per block\), found 0"):
        store.read_merged([ScheduledRequest("a", 2, 4, [3], [])], hidden_states=hs)
    with pytest.raises(ValueError, match=r"requests\[1\]: request 'a' listed twice"):
        store.read_merged([ScheduledRequest("a", 1), ScheduledRequest("a", 1)], hidden_states=hs)
    with pytest.raises(
        ValueError, match=r"entry 'hidden_states': expected at least 3 rows, found 2"
    ):
        store.read_merged([ScheduledRequest("a", 3)], hidden_states=hs)
    with pytest.raises(
        ValueError,
        match=r"entry 'hidden_states': expected dtype torch.float32, found torch.float16",
    ):
        store.read_merged([ScheduledRequest("a", 2)], hidden_states=hs.half())
    with pytest.raises(IndexError, match=r"block_ids\[0\]: expected 0..7, found 8"):
        store.read_merged([ScheduledRequest("a", 2, 4, [8], [key(8)])], hidden_states=hs)
    assert_same(before, snapshot(store))


# -- block pool ---------------------------------------------------------------


def test_pool_reuse_clears_stamps_through_the_eviction_listener(cfg: Config) -> None:
    pool = BlockPool(4, 4)
    store = make(cfg, num_blocks=4)
    store.attach(pool)
    blocks = pool.allocate(2)
    assert blocks is not None
    ids = [b.block_id for b in blocks]
    keys = [key(10), key(11)]
    store.write_outputs(
        block_slots(ids),
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


def test_eviction_resets_the_fill_count(cfg: Config) -> None:
    store = make(cfg)
    store.register("h", 3, torch.float32)
    data = rows(cfg, 4, 3)
    store.write("h", data[:2], [8, 9])
    store.on_block_evicted(2, key(2))
    # A new owner continuing at offset 2 does not complete the old owner's run.
    assert store.write("h", data[2:], [10, 11], block_keys={2: key(2)}).stamped_block_ids == ()
    with pytest.raises(IndexError, match=r"block_id: expected 0..7, found 8"):
        store.on_block_evicted(8, key(8))


def test_invalidate(cfg: Config) -> None:
    store = make(cfg)
    store.write_outputs(
        block_slots([1, 2]), hidden_states=rows(cfg, 8, 3), block_keys={1: key(1), 2: key(2)}
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
    store.invalidate_all()
    assert store.probe([1], [key(1)]) == 0
    with pytest.raises(IndexError, match=r"block_ids\[1\]: expected 0..7, found -1"):
        store.invalidate([0, -1])
    with pytest.raises(
        TypeError, match=r"block_ids: expected a flat sequence of int, found \[1.5\]"
    ):
        store.invalidate([1.5])  # type: ignore[list-item]


# -- deferred entries -------------------------------------------------------------


def test_deferred_rows_are_staged_committed_and_stamped(cfg: Config) -> None:
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    audio_a = rows(cfg, 10, 2, seed=1)
    audio_b = rows(cfg, 3, 2, seed=2)
    # Step 1: "a" tokens 0..5, "b" tokens 0..2; step 2: "a" tokens 6..9.
    store.stage_outputs(
        [ScheduledRequest("a", 6, 0), ScheduledRequest("b", 3, 0)],
        multimodal_outputs={"audio": torch.cat([audio_a[:6], audio_b]), "ref": torch.ones(9)},
    )
    step2 = audio_a[6:].clone()
    store.stage_outputs([ScheduledRequest("a", 4, 6)], multimodal_outputs={"audio": step2})
    step2.fill_(-1)  # the model reuses its buffers: staging copied the rows
    assert store.has_staged("a") and store.has_staged("b")
    assert store.stats.num_staged_bytes == (10 + 3) * 2 * 4
    assert store.stamp_of("audio", 5) is None
    # "a" finishes with blocks [5, 0, 7]: two full blocks and 2 tokens in the last.
    results = store.commit("a", [5, 0, 7], [key(5), key(0)])
    assert results == {"audio": WriteResult("audio", 10, (5, 0), ())}
    assert not store.has_staged("a")
    assert torch.equal(cpu(store.read_blocks("audio", [5, 0], [key(5), key(0)])), cpu(audio_a)[:8])
    assert store.stats.num_staged_bytes == 3 * 2 * 4
    assert store.discard("b") == 24
    assert store.stats.num_staged_bytes == 0
    with pytest.raises(
        ValueError,
        match=r"req_id: expected a request with staged rows, found 'b' \(0 requests staged\)",
    ):
        store.commit("b", [1], [])
    with pytest.raises(ValueError, match=r"req_id: expected a request with staged rows, found 'b'"):
        store.discard("b")


def test_rejected_commit_keeps_staged_rows(cfg: Config) -> None:
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    store.stage("a", "audio", rows(cfg, 6, 2), token_start=2)
    before = snapshot(store)
    with pytest.raises(
        ValueError,
        match=r"entry 'audio': staged tokens 2..7 of request 'a': "
        r"expected tokens below 4 \(1 blocks of 4\)",
    ):
        store.commit("a", [3], [key(3)])
    with pytest.raises(
        ValueError, match=r"block_keys: expected at most 2 keys \(one per block\), found 3"
    ):
        store.commit("a", [3, 4], [key(3), key(4), key(5)])
    assert_same(before, snapshot(store))
    # Tokens 2..7 land in blocks 3 (offsets 2, 3) and 4 (offsets 0..3): only
    # block 4 has its rows in order from offset 0.
    assert store.commit("a", [3, 4], [key(3), key(4)]) == {
        "audio": WriteResult("audio", 6, (4,), (3,))
    }


def test_stage_validates(cfg: Config) -> None:
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    store.register("h", 2, torch.float32)
    before = snapshot(store)
    with pytest.raises(
        ValueError, match=r"entry 'h': expected a deferred entry, found a direct one"
    ):
        store.stage("a", "h", rows(cfg, 2, 2), token_start=0)
    with pytest.raises(
        ValueError, match=r"entry 'audio': expected dtype torch.float32, found torch.float64"
    ):
        store.stage("a", "audio", rows(cfg, 2, 2).double(), token_start=0)
    with pytest.raises(ValueError, match=r"token_start: expected int >= 0, found -1"):
        store.stage("a", "audio", rows(cfg, 2, 2), token_start=-1)
    with pytest.raises(TypeError, match=r"requests\[1\].req_id: expected str, found int"):
        store.stage_outputs(
            [ScheduledRequest("a", 2), ScheduledRequest(7, 2)],  # type: ignore[arg-type]
            multimodal_outputs={"audio": rows(cfg, 4, 2)},
        )
    with pytest.raises(ValueError, match=r"entry 'audio': expected at least 5 rows, found 4"):
        store.stage_outputs(
            [ScheduledRequest("a", 2), ScheduledRequest("b", 3)],
            multimodal_outputs={"audio": rows(cfg, 4, 2)},
        )
    assert_same(before, snapshot(store))


def test_later_staged_chunks_overwrite_earlier_ones(cfg: Config) -> None:
    # A preempted request recomputes tokens 0..3; its second pass wins.
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    store.stage("a", "audio", rows(cfg, 4, 2, seed=1), token_start=0)
    second = rows(cfg, 4, 2, seed=2)
    store.stage("a", "audio", second, token_start=0)
    assert store.commit("a", [6], [key(6)]) == {"audio": WriteResult("audio", 8, (6,), ())}
    assert torch.equal(cpu(store.read_blocks("audio", [6], [key(6)])), cpu(second))


# -- the fill rule against a token-by-token model -----------------------------------


def model_fill(writes: list[list[int]], block_size: int, num_blocks: int) -> list[int]:
    filled = [0] * num_blocks
    for slots in writes:
        for slot in slots:
            block, offset = divmod(slot, block_size)
            if offset == 0:
                filled[block] = 1
            elif filled[block] == offset:
                filled[block] = offset + 1
            else:
                filled[block] = -1
    return filled


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 23), unique=True, max_size=12), min_size=1, max_size=6))
def test_fill_counts_and_stamps_follow_the_token_order_rule(writes: list[list[int]]) -> None:
    bs, nb = 4, 6
    store = TensorStore(nb, bs)
    store.register("h", 2, torch.int64)
    content: dict[int, tuple[int, int]] = {}
    for step, slots in enumerate(writes):
        data = torch.tensor([[step, s] for s in slots], dtype=torch.int64).view(-1, 2)
        result = store.write("h", data, slots, block_keys={b: key(b) for b in range(nb)})
        for s in slots:
            content[s] = (step, s)
        expected_fill = model_fill(writes[: step + 1], bs, nb)
        touched = sorted({s // bs for s in slots})
        assert sorted(result.stamped_block_ids) == [b for b in touched if expected_fill[b] == bs]
        assert sorted(result.incomplete_block_ids) == [b for b in touched if expected_fill[b] != bs]
    final_fill = model_fill(writes, bs, nb)
    assert store._entries["h"].filled.tolist() == final_fill
    stamped = [b for b in range(nb) if store.stamp_of("h", b) is not None]
    for b in stamped:
        got = store.read_blocks("h", [b], [key(b)])
        assert got.tolist() == [list(content[b * bs + o]) for o in range(bs)]
    # A block is stamped exactly when the last write touching it completed it.
    last_touch = {s // bs: i for i, slots in enumerate(writes) for s in slots}
    assert stamped == sorted(
        b for b, i in last_touch.items() if model_fill(writes[: i + 1], bs, nb)[b] == bs
    )
