"""The store's side of a second tier: what it offers, what `read_through` fills.

Every test runs the store against `MemoryTier` (or a tier that breaks on
purpose) and counts exactly: values put, blocks offered, blocks asked for and
filled, tier errors. Configurations as in test_store.py: a CPU store fed from
CPU tensors (always); with CUDA, a CUDA store fed from CUDA tensors and a
pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import pytest
import torch
from helpers import DeviceConfig, block_slots, cpu, key
from store_helpers import assert_same, snapshot

from omnicache.block_hash import BlockHash
from omnicache.store import (
    HIDDEN_STATES,
    EntrySpec,
    ScheduledRequest,
    StaleBlockError,
    StaleCommitError,
    StoreStats,
    TensorStore,
    TierBlock,
    WriteResult,
)
from omnicache.store.writes import Writer
from omnicache.tiers import codec
from omnicache.tiers.base import TierStats, value_key
from omnicache.tiers.memory import MemoryTier

# NOTE: MemoryTier's values are read-only bytes that its decoded rows view;
# torch warns about that once per process. The store copies the rows.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")


BS = 4
HIDDEN = 8
CODES = "codes"
CODES_SHAPE = (2, 3)
NAMES = (HIDDEN_STATES, CODES)


def make(
    cfg: DeviceConfig,
    tier: Any = None,
    num_blocks: int = 8,
    *,
    deferred_codes: bool = False,
) -> TensorStore:
    """A store with bf16 hidden states and int32 (2, 3) codes per token."""
    store = TensorStore(
        num_blocks,
        BS,
        device=cfg.store_device,
        hidden_size=HIDDEN,
        hidden_dtype=torch.bfloat16,
        tier=tier,
    )
    store.register(CODES, CODES_SHAPE, torch.int32, deferred=deferred_codes)
    return store


def hidden(cfg: DeviceConfig, n: int, seed: int = 0) -> torch.Tensor:
    """Distinct bf16 rows (small integers and halves are exact in bf16)."""
    base = torch.arange(n * HIDDEN, dtype=torch.float32).view(n, HIDDEN) % 64
    base = base / 2 + seed * 64
    return base.to(torch.bfloat16).to(cfg.source_device)


def codes(cfg: DeviceConfig, n: int, seed: int = 0) -> torch.Tensor:
    base = torch.arange(n * 6, dtype=torch.int32).view(n, *CODES_SHAPE)
    return (base + seed * 100_000).to(cfg.source_device)


def slots(block_ids: Sequence[int], num_tokens: int | None = None) -> list[int]:
    out = block_slots(block_ids, BS)
    return out if num_tokens is None else out[:num_tokens]


def stamps(store: TensorStore, block_ids: Sequence[int]) -> dict[str, list[BlockHash | None]]:
    return {name: [store.stamp_of(name, b) for b in block_ids] for name in store.entries}


def filled(store: TensorStore, name: str, block_ids: Sequence[int]) -> list[int]:
    return [store.filled_of(name, b) for b in block_ids]


def values_of(tier: MemoryTier, keys: Sequence[BlockHash], names: Sequence[str]) -> set[str]:
    return {value_key(tier.prefix, tier.namespace, k, n) for k in keys for n in names}


class RecordingTier(MemoryTier):
    """A MemoryTier that also records every put: (key, name, shape, device, rows copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[list[tuple[bytes, str, tuple[int, ...], str, torch.Tensor]]] = []

    def put(self, blocks: Sequence[TierBlock]) -> None:
        self.puts.append(
            [
                (b.key, b.name, tuple(b.rows.shape), b.rows.device.type, cpu(b.rows).clone())
                for b in blocks
            ]
        )
        super().put(blocks)


@pytest.fixture
def small_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of the entries each `Writer.apply_small` call wrote (the small-write path)."""
    calls: list[str] = []
    original = Writer.apply_small

    def spy(self: Writer, entry: Any, *args: Any) -> WriteResult:
        calls.append(entry.spec.name)
        return original(self, entry, *args)

    monkeypatch.setattr(Writer, "apply_small", spy)
    yield calls


# -- construction --------------------------------------------------------------


def test_tier_must_be_a_block_tier() -> None:
    message = r"^tier: expected a BlockTier \(put and get methods\) or None, found object$"
    with pytest.raises(TypeError, match=message):
        TensorStore(4, BS, tier=object())  # type: ignore[arg-type]

    class PutOnly:
        def put(self, blocks: Sequence[TierBlock]) -> None: ...

    with pytest.raises(TypeError, match=r"found PutOnly$"):
        TensorStore(4, BS, tier=PutOnly())  # type: ignore[arg-type]

    class NotCallable:
        put = 1
        get = 2

    with pytest.raises(TypeError, match=r"found NotCallable$"):
        TensorStore(4, BS, tier=NotCallable())  # type: ignore[arg-type]
    tier = MemoryTier()
    assert TensorStore(4, BS, tier=tier).tier is tier
    assert TensorStore(4, BS).tier is None


# -- writes offer what they stamp ----------------------------------------------


class WriteCase(NamedTuple):
    name: str
    num_blocks: int
    # Blocks written, first block first; the last one gets ``extra_rows`` rows
    # (0: every block is whole).
    block_ids: list[int]
    extra_rows: int
    small_path: bool


WRITE_CASES = [
    # 10 rows: blocks 2 and 5 whole, block 7 with 2 rows.
    WriteCase("small", 8, [2, 5, 7], 2, True),
    # 522 rows, beyond the small path's 512: 130 whole blocks and 2 rows.
    WriteCase("general", 256, [(7 * i) % 256 for i in range(131)], 2, False),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=[c.name for c in WRITE_CASES])
def test_a_write_offers_exactly_the_blocks_it_stamps(
    cfg: DeviceConfig, case: WriteCase, small_calls: list[str]
) -> None:
    tier = RecordingTier()
    store = make(cfg, tier, case.num_blocks)
    num_whole = len(case.block_ids) - 1
    num_tokens = num_whole * BS + case.extra_rows
    keys = {b: key(i) for i, b in enumerate(case.block_ids)}
    hs = hidden(cfg, num_tokens)
    cs = codes(cfg, num_tokens)

    results = store.write_outputs(
        slots(case.block_ids, num_tokens),
        hidden_states=hs,
        multimodal_outputs={CODES: cs},
        block_keys=keys,
    )

    whole = case.block_ids[:num_whole]
    last = case.block_ids[-1]
    assert results == {
        HIDDEN_STATES: WriteResult(HIDDEN_STATES, num_tokens, tuple(whole), (last,)),
        CODES: WriteResult(CODES, num_tokens, tuple(whole), (last,)),
    }
    assert small_calls == ([HIDDEN_STATES, CODES] if case.small_path else [])
    # One put per entry, of its stamped blocks in the order stamped, as views
    # of the store's device.
    block_shapes = {HIDDEN_STATES: (BS, HIDDEN), CODES: (BS, *CODES_SHAPE)}
    assert [[(k, n, s, d) for k, n, s, d, _ in put] for put in tier.puts] == [
        [(keys[b], name, block_shapes[name], cfg.store_device) for b in whole]
        for name in (HIDDEN_STATES, CODES)
    ]
    for put, src in zip(tier.puts, (hs, cs), strict=True):
        for index, (*_, got) in enumerate(put):
            assert torch.equal(got, cpu(src)[index * BS : (index + 1) * BS])
    assert store.stats.num_tier_offered == 2 * num_whole
    assert store.stats.num_tier_errors == 0
    assert tier.stats == TierStats(num_put_values=2 * num_whole, num_written_values=2 * num_whole)
    # The tier keeps each block's rows, encoded under its key.
    assert set(tier.values) == values_of(tier, [keys[b] for b in whole], NAMES)
    for index, b in enumerate(whole):
        for name, src in ((HIDDEN_STATES, hs), (CODES, cs)):
            rows = cpu(src)[index * BS : (index + 1) * BS]
            assert tier.values[value_key("omnicache", "default", keys[b], name)] == codec.encode(
                keys[b], name, rows
            )


def test_writes_without_keys_or_blocks_left_incomplete_offer_nothing(
    cfg: DeviceConfig, small_calls: list[str]
) -> None:
    tier = MemoryTier()
    store = make(cfg, tier)
    # Whole blocks, no keys.
    store.write_outputs(slots([1, 2]), hidden_states=hidden(cfg, 8), multimodal_outputs={})
    store.write(CODES, codes(cfg, 8), slots([1, 2]))
    # Keyed blocks, 3 rows of 4 each.
    r = store.write(HIDDEN_STATES, hidden(cfg, 3), slots([3], 3), block_keys={3: key(3)})
    assert r == WriteResult(HIDDEN_STATES, 3, (), (3,))
    # Keys of blocks the write does not touch.
    r = store.write(CODES, codes(cfg, 4), slots([4]), block_keys={5: key(5), 6: key(6)})
    assert r == WriteResult(CODES, 4, (), ())
    # A whole block whose rows did not arrive in order from offset 0.
    store.write(HIDDEN_STATES, hidden(cfg, 2), [6 * BS + 2, 6 * BS + 3])
    r = store.write(HIDDEN_STATES, hidden(cfg, 2), [6 * BS + 0, 6 * BS + 1], block_keys={6: key(6)})
    assert r == WriteResult(HIDDEN_STATES, 2, (), (6,))
    assert store.stats.num_tier_offered == 0
    assert store.stats.num_stamped_blocks == 0
    assert tier.stats == TierStats()
    assert tier.values == {}
    assert len(small_calls) == 6


def test_decode_steps_offer_each_block_once_when_its_last_row_lands(
    cfg: DeviceConfig, small_calls: list[str]
) -> None:
    tier = MemoryTier()
    store = make(cfg, tier)
    # Two requests: A with blocks [3, 1, 6] and 6 prompt tokens, B with blocks
    # [4, 5] and 3 prompt tokens; then one token each per step.
    tables = {"A": [3, 1, 6], "B": [4, 5]}
    block_key = {b: key(10 * i + j) for i, t in enumerate(tables.values()) for j, b in enumerate(t)}
    num_tokens = {"A": 6, "B": 3}
    all_h = {r: hidden(cfg, 12, seed=i) for i, r in enumerate(tables)}
    all_c = {r: codes(cfg, 12, seed=i) for i, r in enumerate(tables)}

    def slot_of(req: str, pos: int) -> int:
        return tables[req][pos // BS] * BS + pos % BS

    def keys_of(touched: Sequence[int]) -> dict[int, BlockHash]:
        # The key of every block written: the store stamps only whole ones.
        return {b: block_key[b] for b in touched}

    # Prefill: A completes block 3, B completes nothing.
    for req, n in num_tokens.items():
        pos = range(n)
        store.write_outputs(
            [slot_of(req, p) for p in pos],
            hidden_states=all_h[req][:n],
            multimodal_outputs={CODES: all_c[req][:n]},
            block_keys=keys_of({tables[req][p // BS] for p in pos}),
        )
    assert tier.stats.num_put_values == 2
    whole = [3]
    expected_put = 2
    for _ in range(5):
        step_slots = [slot_of(r, num_tokens[r]) for r in tables]
        touched = [s // BS for s in step_slots]
        results = store.write_outputs(
            step_slots,
            hidden_states=torch.cat([all_h[r][num_tokens[r] : num_tokens[r] + 1] for r in tables]),
            multimodal_outputs={
                CODES: torch.cat([all_c[r][num_tokens[r] : num_tokens[r] + 1] for r in tables])
            },
            block_keys=keys_of(touched),
        )
        for r in tables:
            num_tokens[r] += 1
        completed = [
            tables[r][(num_tokens[r] - 1) // BS] for r in tables if num_tokens[r] % BS == 0
        ]
        for name in NAMES:
            assert results[name].stamped_block_ids == tuple(completed)
        whole += completed
        expected_put += 2 * len(completed)
        assert tier.stats.num_put_values == expected_put
        assert store.stats.num_tier_offered == expected_put
    # A: 11 tokens (blocks 3 and 1 whole), B: 8 tokens (blocks 4 and 5 whole).
    assert num_tokens == {"A": 11, "B": 8}
    assert sorted(whole) == [1, 3, 4, 5]
    assert expected_put == 8
    assert set(tier.values) == values_of(tier, [block_key[b] for b in whole], NAMES)
    # Every write took the small path: 2 prefill and 5 decode writes, 2 entries each.
    assert small_calls == list(NAMES) * 7


@pytest.mark.parametrize(
    ("num_blocks", "block_ids", "small_path"),
    [(8, [6, 2, 5], True), (256, list(range(200, 60, -1)), False)],
    ids=["small", "general"],
)
def test_a_write_that_revisits_a_block_offers_it_once(
    cfg: DeviceConfig,
    num_blocks: int,
    block_ids: list[int],
    small_path: bool,
    small_calls: list[str],
) -> None:
    tier = RecordingTier()
    store = make(cfg, tier, num_blocks)
    # Offset-major order: every block is written in BS runs of one row.
    order = [(b, o) for o in range(BS) for b in block_ids]
    data = hidden(cfg, len(order))
    keys = {b: key(i) for i, b in enumerate(block_ids)}
    result = store.write(HIDDEN_STATES, data, [b * BS + o for b, o in order], block_keys=keys)
    assert sorted(result.stamped_block_ids) == sorted(block_ids)
    assert result.incomplete_block_ids == ()
    assert small_calls == ([HIDDEN_STATES] if small_path else [])
    assert len(tier.puts) == 1
    assert sorted(k for k, *_ in tier.puts[0]) == sorted(keys.values())
    assert store.stats.num_tier_offered == len(block_ids)
    assert tier.stats.num_put_values == len(block_ids)
    # Each block's value holds its rows in offset order.
    for k, name, _, _, got in tier.puts[0]:
        b = next(b for b, kb in keys.items() if kb == k)
        rows = [cpu(data)[i] for i, (bi, _) in enumerate(order) if bi == b]
        assert name == HIDDEN_STATES
        assert torch.equal(got, torch.stack(rows))


def test_rewriting_a_stamped_block_offers_it_again(cfg: DeviceConfig) -> None:
    tier = MemoryTier()
    store = make(cfg, tier)
    for n in (1, 2):
        store.write_blocks(HIDDEN_STATES, hidden(cfg, 8), [1, 2], block_keys=[key(1), key(2)])
        assert store.stats.num_tier_offered == 2 * n
        assert tier.stats.num_put_values == 2 * n
        assert len(tier.values) == 2


def test_commit_offers_the_blocks_it_stamps(cfg: DeviceConfig) -> None:
    tier = RecordingTier()
    store = make(cfg, tier, deferred_codes=True)
    hs = hidden(cfg, 10)
    cs = codes(cfg, 10)
    table = [2, 5, 7]
    keys = [key(0), key(1)]
    # The direct entry is written and offered at once; the deferred one is staged.
    results = store.write_outputs(
        slots(table, 6),
        hidden_states=hs[:6],
        multimodal_outputs={CODES: cs[:6]},
        block_keys={2: keys[0]},
    )
    assert list(results) == [HIDDEN_STATES]
    store.stage_outputs([ScheduledRequest("r", 6)], multimodal_outputs={CODES: cs[:6]})
    store.write_outputs(
        [5 * BS + 2, 5 * BS + 3, 7 * BS, 7 * BS + 1],
        hidden_states=hs[6:],
        block_keys={5: keys[1]},
    )
    store.stage("r", CODES, cs[6:], token_start=6)
    assert tier.stats.num_put_values == 2
    assert [[(k, n) for k, n, *_ in put] for put in tier.puts] == [
        [(keys[0], HIDDEN_STATES)],
        [(keys[1], HIDDEN_STATES)],
    ]
    # A discarded request offers nothing.
    store.stage("gone", CODES, cs[:4], token_start=0)
    assert store.discard("gone") == 4 * 6 * 4
    assert tier.stats.num_put_values == 2

    result = store.commit("r", table, keys)

    assert result == {CODES: WriteResult(CODES, 10, (2, 5), ())}
    assert stamps(store, table) == {
        HIDDEN_STATES: [keys[0], keys[1], None],
        CODES: [keys[0], keys[1], None],
    }
    # One put per staged chunk: the first completes block 2, the second block 5.
    assert [[(k, n) for k, n, *_ in put] for put in tier.puts[2:]] == [
        [(keys[0], CODES)],
        [(keys[1], CODES)],
    ]
    assert store.stats.num_tier_offered == 4
    assert tier.stats.num_put_values == 4
    assert set(tier.values) == values_of(tier, keys, NAMES)
    reader = make(cfg, tier)
    assert reader.read_through([0, 1], keys) == 2
    assert torch.equal(cpu(reader.read_blocks(CODES, [0, 1], keys)), cpu(cs[:8]))


def test_commit_without_keys_offers_nothing(cfg: DeviceConfig) -> None:
    tier = MemoryTier()
    store = make(cfg, tier, deferred_codes=True)
    store.stage("r", CODES, codes(cfg, 8), token_start=0)
    assert store.commit("r", [1, 2], []) == {CODES: WriteResult(CODES, 8, (), ())}
    assert store.stats.num_tier_offered == 0
    assert tier.stats == TierStats()


# -- read_through --------------------------------------------------------------

# Blocks of the writer (engine 1) and of the reader (engine 2) for the same keys.
WRITER_BLOCKS = [2, 5, 7]
READER_BLOCKS = [4, 0, 3]
KEYS = [key(0), key(1), key(2)]


class Written(NamedTuple):
    tier: MemoryTier
    hidden: torch.Tensor
    codes: torch.Tensor


def write_three_blocks(cfg: DeviceConfig, tier: MemoryTier | None = None) -> Written:
    """Engine 1 computes 3 whole blocks of both entries and offers them to the tier."""
    tier = MemoryTier() if tier is None else tier
    writer = make(cfg, tier)
    hs = hidden(cfg, 12, seed=1)
    cs = codes(cfg, 12, seed=1)
    writer.write_outputs(
        slots(WRITER_BLOCKS),
        hidden_states=hs,
        multimodal_outputs={CODES: cs},
        block_keys=dict(zip(WRITER_BLOCKS, KEYS, strict=True)),
    )
    assert tier.stats.num_put_values == 6
    return Written(tier, cpu(hs), cpu(cs))


def prestamp(cfg: DeviceConfig, store: TensorStore, block_ids: Sequence[int]) -> None:
    """Stamps ``block_ids`` of both entries with keys the tests never look up."""
    n = len(block_ids) * BS
    store.write_outputs(
        slots(block_ids),
        hidden_states=hidden(cfg, n, seed=7),
        multimodal_outputs={CODES: codes(cfg, n, seed=7)},
        block_keys={b: key(200 + i) for i, b in enumerate(block_ids)},
    )
    assert stamps(store, block_ids) == {
        name: [key(200 + i) for i in range(len(block_ids))] for name in NAMES
    }


def test_read_through_fills_and_stamps_blocks_as_if_computed(cfg: DeviceConfig) -> None:
    written = write_three_blocks(cfg)
    tier = written.tier
    reader = make(cfg, tier, num_blocks=6)

    assert reader.read_through(READER_BLOCKS, KEYS) == 3

    assert stamps(reader, READER_BLOCKS) == {name: KEYS for name in NAMES}
    for name in NAMES:
        assert filled(reader, name, READER_BLOCKS) == [BS] * 3
    assert reader.stats == StoreStats(num_tier_hit_blocks=3, num_tier_queried_blocks=3)
    # The filled blocks are not offered back.
    assert tier.stats == TierStats(
        num_put_values=6,
        num_written_values=6,
        num_get_calls=1,
        num_get_blocks=3,
        num_hit_blocks=3,
    )
    assert reader.probe(READER_BLOCKS, KEYS) == 3
    got_h = reader.read_blocks(HIDDEN_STATES, READER_BLOCKS, KEYS)
    got_c = reader.read_blocks(CODES, READER_BLOCKS, KEYS)
    assert got_h.device.type == cfg.store_device
    assert torch.equal(cpu(got_h), written.hidden)
    assert torch.equal(cpu(got_c), written.codes)
    # A merged read serves the filled blocks as a hit, followed by the step's rows.
    new_h = hidden(cfg, 1, seed=3)
    new_c = codes(cfg, 1, seed=3)
    merged = reader.read_merged(
        [ScheduledRequest("r", 1, 12, READER_BLOCKS, KEYS)],
        hidden_states=new_h,
        multimodal_outputs={CODES: new_c},
    )
    assert merged.misses == ()
    assert torch.equal(cpu(merged.hidden_states["r"]), torch.cat([written.hidden, cpu(new_h)]))
    assert torch.equal(cpu(merged.tensors[CODES]["r"]), torch.cat([written.codes, cpu(new_c)]))
    assert tier.stats.num_put_values == 6
    assert reader.stats.num_tier_offered == 0


@pytest.mark.parametrize("lacks", ["every entry", "one entry", "a damaged value"])
def test_read_through_fills_the_leading_run_only(cfg: DeviceConfig, lacks: str) -> None:
    written = write_three_blocks(cfg)
    tier = written.tier
    k1_codes = value_key(tier.prefix, tier.namespace, KEYS[1], CODES)
    if lacks == "every entry":
        del tier.values[value_key(tier.prefix, tier.namespace, KEYS[1], HIDDEN_STATES)]
        del tier.values[k1_codes]
    elif lacks == "one entry":
        del tier.values[k1_codes]
    else:
        value = bytearray(tier.values[k1_codes])
        value[-1] ^= 0x01
        tier.values[k1_codes] = bytes(value)
    reader = make(cfg, tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    before = tier.stats

    assert reader.read_through(READER_BLOCKS, KEYS) == 1

    # Block 4 holds key 0; blocks 0 and 3 lost their stamps, although the
    # tier holds key 2.
    assert stamps(reader, READER_BLOCKS) == {name: [KEYS[0], None, None] for name in NAMES}
    for name in NAMES:
        assert filled(reader, name, READER_BLOCKS) == [BS, 0, 0]
    assert torch.equal(
        cpu(reader.read_blocks(HIDDEN_STATES, READER_BLOCKS[:1], KEYS[:1])), written.hidden[:BS]
    )
    assert torch.equal(
        cpu(reader.read_blocks(CODES, READER_BLOCKS[:1], KEYS[:1])), written.codes[:BS]
    )
    stats = reader.stats
    assert (stats.num_tier_hit_blocks, stats.num_tier_queried_blocks) == (1, 3)
    assert stats.num_tier_errors == 0
    assert tier.stats == replace(
        before,
        num_get_calls=1,
        num_get_blocks=3,
        num_hit_blocks=1,
        num_rejected_values=1 if lacks == "a damaged value" else 0,
    )


def test_read_through_clears_the_given_blocks_when_the_tier_misses(cfg: DeviceConfig) -> None:
    written = write_three_blocks(cfg)
    reader = make(cfg, written.tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    caches = snapshot(reader).rows
    unknown = [key(50), key(51), key(52)]

    assert reader.read_through(READER_BLOCKS, unknown) == 0

    assert stamps(reader, READER_BLOCKS) == {name: [None, None, None] for name in NAMES}
    for name in NAMES:
        assert filled(reader, name, READER_BLOCKS) == [0, 0, 0]
        # The rows stay; only their stamps and fill counts go.
        assert snapshot(reader).rows[name] == caches[name]
    stats = reader.stats
    assert (stats.num_tier_hit_blocks, stats.num_tier_queried_blocks) == (0, 3)
    # Other blocks keep their stamps.
    other = make(cfg, written.tier, num_blocks=6)
    prestamp(cfg, other, [1, 2])
    other.read_through([4], [key(50)])
    assert stamps(other, [1, 2]) == {name: [key(200), key(201)] for name in NAMES}


def test_read_through_fills_only_the_named_entries(cfg: DeviceConfig) -> None:
    written = write_three_blocks(cfg)
    tier = written.tier
    # The tier holds only the codes of key 2: it still serves a codes-only read.
    del tier.values[value_key(tier.prefix, tier.namespace, KEYS[2], HIDDEN_STATES)]
    reader = make(cfg, tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    hidden_cache = reader.cached_rows(HIDDEN_STATES)

    assert reader.read_through(READER_BLOCKS, KEYS, names=[CODES]) == 3

    assert stamps(reader, READER_BLOCKS) == {CODES: KEYS, HIDDEN_STATES: [None, None, None]}
    assert filled(reader, CODES, READER_BLOCKS) == [BS] * 3
    assert filled(reader, HIDDEN_STATES, READER_BLOCKS) == [0, 0, 0]
    assert torch.equal(cpu(reader.read_blocks(CODES, READER_BLOCKS, KEYS)), written.codes)
    assert torch.equal(reader.cached_rows(HIDDEN_STATES), hidden_cache)
    with pytest.raises(StaleBlockError):
        reader.read_blocks(HIDDEN_STATES, READER_BLOCKS, KEYS)
    assert reader.probe(READER_BLOCKS, KEYS) == 0
    assert reader.probe(READER_BLOCKS, KEYS, names=[CODES]) == 3
    # Every entry asked: the run stops where the hidden states are missing.
    again = make(cfg, tier, num_blocks=6)
    assert again.read_through(READER_BLOCKS, KEYS) == 2
    assert stamps(again, READER_BLOCKS) == {name: [KEYS[0], KEYS[1], None] for name in NAMES}


def test_read_through_asks_the_tier_for_the_named_entries_only(cfg: DeviceConfig) -> None:
    asked: list[tuple[list[bytes], list[EntrySpec], int]] = []

    class Asking(MemoryTier):
        def get(
            self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
        ) -> list[Mapping[str, torch.Tensor]]:
            asked.append((list(keys), list(entries), block_size))
            return super().get(keys, entries, block_size)

    tier = Asking()
    write_three_blocks(cfg, tier)
    reader = make(cfg, tier, num_blocks=6)
    reader.read_through(READER_BLOCKS[:2], KEYS[:2], names=[CODES])
    reader.read_through(READER_BLOCKS, KEYS)
    assert asked == [
        (KEYS[:2], [reader.entries[CODES]], BS),
        (KEYS, [reader.entries[HIDDEN_STATES], reader.entries[CODES]], BS),
    ]


def test_read_through_without_a_tier_changes_nothing(cfg: DeviceConfig) -> None:
    store = make(cfg)
    prestamp(cfg, store, READER_BLOCKS)
    before = snapshot(store)
    assert store.read_through(READER_BLOCKS, KEYS) == 0
    assert store.read_through(READER_BLOCKS, KEYS, names=[CODES]) == 0
    assert_same(before, snapshot(store))


def test_read_through_of_nothing_asks_nothing(cfg: DeviceConfig) -> None:
    written = write_three_blocks(cfg)
    reader = make(cfg, written.tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    before = snapshot(reader)
    tier_before = written.tier.stats
    # No blocks, or no entries: the tier is not asked and no stamp is cleared.
    assert reader.read_through([], []) == 0
    assert reader.read_through(READER_BLOCKS, KEYS, names=[]) == 0
    assert_same(before, snapshot(reader))
    assert written.tier.stats == tier_before


BAD_INPUTS: list[tuple[str, Callable[[TensorStore], int], type[Exception], str]] = [
    (
        "fewer keys than blocks",
        lambda s: s.read_through([4, 0], [KEYS[0]]),
        ValueError,
        "block_keys: expected 2 keys (one per block), found 1",
    ),
    (
        "more keys than blocks",
        lambda s: s.read_through([4], KEYS[:2]),
        ValueError,
        "block_keys: expected 1 keys (one per block), found 2",
    ),
    (
        "a block twice",
        lambda s: s.read_through([4, 0, 4], KEYS),
        ValueError,
        "block_ids: expected distinct blocks, found [4, 0, 4]",
    ),
    (
        "a block beyond the store",
        lambda s: s.read_through([4, 6], KEYS[:2]),
        IndexError,
        "block_ids[1]: expected 0..5, found 6",
    ),
    (
        "a negative block",
        lambda s: s.read_through([-1, 0], KEYS[:2]),
        IndexError,
        "block_ids[0]: expected 0..5, found -1",
    ),
    (
        "a block that is no int",
        lambda s: s.read_through([4, 0.5], KEYS[:2]),  # type: ignore[list-item]
        TypeError,
        "block_ids: expected a flat sequence of int, found [4, 0.5]",
    ),
    (
        "a key that is no bytes",
        lambda s: s.read_through([4, 0], [KEYS[0], KEYS[1].hex()]),  # type: ignore[list-item]
        TypeError,
        "block_keys[1]: expected bytes, found str",
    ),
    (
        "an unknown entry",
        lambda s: s.read_through([4], KEYS[:1], names=["audio"]),
        ValueError,
        "name: expected a registered entry ['hidden_states', 'codes'], found 'audio'",
    ),
    (
        "names as one str",
        lambda s: s.read_through([4], KEYS[:1], names=CODES),
        TypeError,
        "names: expected an iterable of entry names, found str",
    ),
]


@pytest.mark.parametrize("with_tier", [True, False], ids=["tier", "no-tier"])
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [(call, error, message) for _, call, error, message in BAD_INPUTS],
    ids=[what for what, *_ in BAD_INPUTS],
)
def test_read_through_rejects_bad_input_and_changes_nothing(
    cfg: DeviceConfig,
    with_tier: bool,
    call: Callable[[TensorStore], int],
    error: type[Exception],
    message: str,
) -> None:
    written = write_three_blocks(cfg)
    reader = make(cfg, written.tier if with_tier else None, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    before = snapshot(reader)
    tier_before = written.tier.stats
    with pytest.raises(error) as info:
        call(reader)
    assert str(info.value) == message
    assert_same(before, snapshot(reader))
    assert written.tier.stats == tier_before


# -- a broken tier -------------------------------------------------------------


class RaisingGet(MemoryTier):
    def get(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> list[Mapping[str, torch.Tensor]]:
        raise RuntimeError("tier down")


class RaisingPut(MemoryTier):
    def put(self, blocks: Sequence[TierBlock]) -> None:
        raise RuntimeError("tier full")


class Answering(MemoryTier):
    """Answers what ``answer`` makes of MemoryTier's answer."""

    def __init__(
        self, answer: Callable[[list[dict[str, torch.Tensor]]], list[Any]], tier: MemoryTier
    ) -> None:
        super().__init__()
        self.answer = answer
        self.values = tier.values

    def get(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> list[Any]:
        found = [dict(rows) for rows in super().get(keys, entries, block_size)]
        return self.answer(found)


def with_rows(index: int, name: str, rows: Callable[[torch.Tensor], Any]) -> Any:
    def answer(found: list[dict[str, torch.Tensor]]) -> list[Any]:
        found[index][name] = rows(found[index][name])
        return found

    return answer


def without(index: int, name: str) -> Any:
    def answer(found: list[dict[str, torch.Tensor]]) -> list[Any]:
        del found[index][name]
        return found

    return answer


BROKEN_ANSWERS: list[tuple[str, Any, str]] = [
    (
        "hidden states one value short",
        with_rows(0, HIDDEN_STATES, lambda r: r[:, :-1]),
        "tier: block 0, entry 'hidden_states': expected (4, 8) torch.bfloat16, "
        "found (4, 7) torch.bfloat16",
    ),
    (
        "hidden states of another dtype",
        with_rows(0, HIDDEN_STATES, lambda r: r.float()),
        "tier: block 0, entry 'hidden_states': expected (4, 8) torch.bfloat16, "
        "found (4, 8) torch.float32",
    ),
    (
        "codes of another row shape",
        with_rows(1, CODES, lambda r: r.reshape(BS, 3, 2)),
        "tier: block 1, entry 'codes': expected (4, 2, 3) torch.int32, found (4, 3, 2) torch.int32",
    ),
    (
        "codes flattened",
        with_rows(2, CODES, lambda r: r.reshape(BS, 6)),
        "tier: block 2, entry 'codes': expected (4, 2, 3) torch.int32, found (4, 6) torch.int32",
    ),
    (
        "a block of 3 rows",
        with_rows(0, CODES, lambda r: r[:3]),
        "tier: block 0, entry 'codes': expected (4, 2, 3) torch.int32, found (3, 2, 3) torch.int32",
    ),
    (
        "rows that are no tensor",
        with_rows(1, HIDDEN_STATES, lambda r: r.tolist()),
        "tier: block 1, entry 'hidden_states': expected (4, 8) torch.bfloat16, found list",
    ),
    (
        "an entry missing",
        without(0, CODES),
        "tier: block 0, entry 'codes': expected (4, 2, 3) torch.int32, found NoneType",
    ),
    (
        "more blocks than keys",
        lambda found: [*found, found[0]],
        "tier: expected at most 3 blocks, found 4",
    ),
]


def assert_warned(caplog: pytest.LogCaptureFixture, message: str) -> None:
    records = [r for r in caplog.records if r.name == "omnicache.store"]
    assert [(r.levelno, r.getMessage()) for r in records] == [(logging.WARNING, message)]


def test_a_tier_whose_get_raises_is_a_counted_logged_miss(
    cfg: DeviceConfig, caplog: pytest.LogCaptureFixture
) -> None:
    tier = RaisingGet()
    write_three_blocks(cfg, tier)
    reader = make(cfg, tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    before = reader.stats
    with caplog.at_level(logging.WARNING, logger="omnicache.store"):
        assert reader.read_through(READER_BLOCKS, KEYS) == 0
    assert_warned(
        caplog, "tier RaisingGet failed a read, served as a miss: RuntimeError('tier down')"
    )
    assert reader.stats == replace(before, num_tier_queried_blocks=3, num_tier_errors=1)
    # The given blocks are cleared as on any miss.
    assert stamps(reader, READER_BLOCKS) == {name: [None, None, None] for name in NAMES}


class BuggyGet(MemoryTier):
    def get(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> list[Mapping[str, torch.Tensor]]:
        return len(None)  # type: ignore[arg-type]


def test_a_bug_in_a_tier_raises_and_changes_nothing(cfg: DeviceConfig) -> None:
    tier = BuggyGet()
    write_three_blocks(cfg, tier)
    reader = make(cfg, tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    before = stamps(reader, READER_BLOCKS)
    with pytest.raises(TypeError, match=r"object of type 'NoneType' has no len\(\)"):
        reader.read_through(READER_BLOCKS, KEYS)
    assert stamps(reader, READER_BLOCKS) == before
    assert reader.stats.num_tier_errors == 0


@pytest.mark.parametrize(
    ("answer", "message"),
    [(answer, message) for _, answer, message in BROKEN_ANSWERS],
    ids=[what for what, *_ in BROKEN_ANSWERS],
)
def test_a_tier_that_answers_rows_of_the_wrong_shape_or_dtype_is_a_counted_logged_miss(
    cfg: DeviceConfig, caplog: pytest.LogCaptureFixture, answer: Any, message: str
) -> None:
    written = write_three_blocks(cfg)
    tier = Answering(answer, written.tier)
    reader = make(cfg, tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    before = snapshot(reader)
    with caplog.at_level(logging.WARNING, logger="omnicache.store"):
        assert reader.read_through(READER_BLOCKS, KEYS) == 0
    assert_warned(
        caplog, f"tier Answering failed a read, served as a miss: {ValueError(message)!r}"
    )
    assert reader.stats == replace(before.stats, num_tier_queried_blocks=3, num_tier_errors=1)
    # Nothing of the answer is kept, not even its good leading blocks.
    after = snapshot(reader)
    for name in NAMES:
        assert after.rows[name] == before.rows[name]
    assert after.entries == before.entries
    assert stamps(reader, READER_BLOCKS) == {name: [None, None, None] for name in NAMES}


def store_device_name(cfg: DeviceConfig) -> str:
    """The devices a store of ``cfg`` takes a tier's rows from, as its messages name them."""
    if cfg.store_device == "cpu":
        return "cpu"
    return f"cpu or {torch.device('cuda', torch.cuda.current_device())}"


# Rows a tier may hand back that the store cannot take: (what, answer, message
# given the devices the store takes rows from).
UNTAKEABLE_ANSWERS: list[tuple[str, Any, Callable[[str], str]]] = [
    (
        "rows on another device",
        with_rows(0, HIDDEN_STATES, lambda r: torch.empty(r.shape, dtype=r.dtype, device="meta")),
        lambda devices: (
            f"tier: block 0, entry 'hidden_states': expected rows on {devices}, found meta"
        ),
    ),
    (
        "rows that require grad",
        with_rows(1, HIDDEN_STATES, lambda r: r.clone().requires_grad_()),
        lambda devices: (
            "tier: block 1, entry 'hidden_states': expected rows that do not require grad, "
            "found requires_grad=True"
        ),
    ),
    (
        "sparse rows",
        with_rows(2, CODES, lambda r: r.to_sparse()),
        lambda devices: "tier: block 2, entry 'codes': expected dense rows, found torch.sparse_coo",
    ),
]


@pytest.mark.parametrize(
    ("answer", "message"),
    [(answer, message) for _, answer, message in UNTAKEABLE_ANSWERS],
    ids=[what for what, *_ in UNTAKEABLE_ANSWERS],
)
def test_a_tier_that_answers_rows_the_store_cannot_take_is_a_counted_logged_miss(
    cfg: DeviceConfig,
    caplog: pytest.LogCaptureFixture,
    answer: Any,
    message: Callable[[str], str],
) -> None:
    written = write_three_blocks(cfg)
    tier = Answering(answer, written.tier)
    reader = make(cfg, tier, num_blocks=6)
    prestamp(cfg, reader, READER_BLOCKS)
    # Blocks 1 and 2 hold rows computed here.
    local = [1, 2]
    local_keys = [key(300), key(301)]
    local_h = hidden(cfg, 2 * BS, seed=9)
    local_c = codes(cfg, 2 * BS, seed=9)
    reader.write_outputs(
        slots(local),
        hidden_states=local_h,
        multimodal_outputs={CODES: local_c},
        block_keys=dict(zip(local, local_keys, strict=True)),
    )
    before = snapshot(reader)
    with caplog.at_level(logging.WARNING, logger="omnicache.store"):
        assert reader.read_through(READER_BLOCKS, KEYS) == 0
    error = ValueError(message(store_device_name(cfg)))
    assert_warned(caplog, f"tier Answering failed a read, served as a miss: {error!r}")
    after = snapshot(reader)
    assert after.stats == replace(before.stats, num_tier_queried_blocks=3, num_tier_errors=1)
    # Nothing of the answer is kept, not even its good leading blocks; the
    # given blocks are cleared as on any miss, and no other block changes.
    assert after.rows == before.rows
    assert stamps(reader, READER_BLOCKS) == {name: [None, None, None] for name in NAMES}
    for name in NAMES:
        assert filled(reader, name, READER_BLOCKS) == [0, 0, 0]
    assert stamps(reader, local) == {name: local_keys for name in NAMES}
    # Reads of the blocks computed here still work, the cache untouched by autograd.
    got_h = reader.read_blocks(HIDDEN_STATES, local, local_keys)
    assert not got_h.requires_grad
    assert torch.equal(cpu(got_h), cpu(local_h))
    assert torch.equal(cpu(reader.read_blocks(CODES, local, local_keys)), cpu(local_c))
    new_h = hidden(cfg, 1, seed=10)
    new_c = codes(cfg, 1, seed=10)
    merged = reader.read_merged(
        [ScheduledRequest("r", 1, 2 * BS, local, local_keys)],
        hidden_states=new_h,
        multimodal_outputs={CODES: new_c},
    )
    assert merged.misses == ()
    assert torch.equal(cpu(merged.hidden_states["r"]), torch.cat([cpu(local_h), cpu(new_h)]))
    assert torch.equal(cpu(merged.tensors[CODES]["r"]), torch.cat([cpu(local_c), cpu(new_c)]))
    # A tier that answers well again fills the blocks.
    reader.tier = written.tier
    assert reader.read_through(READER_BLOCKS, KEYS) == 3
    assert torch.equal(cpu(reader.read_blocks(HIDDEN_STATES, READER_BLOCKS, KEYS)), written.hidden)


@pytest.mark.parametrize(
    ("num_blocks", "block_ids", "small_path"),
    [(8, [2, 5], True), (256, list(range(3, 143)), False)],
    ids=["small", "general"],
)
def test_a_tier_whose_put_raises_loses_only_its_copy(
    cfg: DeviceConfig,
    caplog: pytest.LogCaptureFixture,
    small_calls: list[str],
    num_blocks: int,
    block_ids: list[int],
    small_path: bool,
) -> None:
    tier = RaisingPut()
    store = make(cfg, tier, num_blocks)
    keys = [key(i) for i in range(len(block_ids))]
    data = hidden(cfg, len(block_ids) * BS)
    with caplog.at_level(logging.WARNING, logger="omnicache.store"):
        result = store.write_blocks(HIDDEN_STATES, data, block_ids, block_keys=keys)
    assert result == WriteResult(HIDDEN_STATES, len(block_ids) * BS, tuple(block_ids), ())
    assert small_calls == ([HIDDEN_STATES] if small_path else [])
    assert_warned(
        caplog,
        f"tier RaisingPut failed to take {len(block_ids)} blocks of 'hidden_states': "
        "RuntimeError('tier full')",
    )
    assert store.stats == StoreStats(
        num_writes=1,
        num_rows_written=len(block_ids) * BS,
        num_stamped_blocks=len(block_ids),
        num_tier_offered=len(block_ids),
        num_tier_errors=1,
    )
    assert [store.stamp_of(HIDDEN_STATES, b) for b in block_ids] == keys
    assert torch.equal(cpu(store.read_blocks(HIDDEN_STATES, block_ids, keys)), cpu(data))


# -- end to end ----------------------------------------------------------------


def test_two_engines_share_blocks_through_the_tier(cfg: DeviceConfig) -> None:
    """Engine 1 computes a prompt; engine 2 fills its blocks from the tier and reads them."""
    tier = MemoryTier(namespace="model-a")
    dim = 64
    n = 10
    g = torch.Generator().manual_seed(0)
    prompt_h = torch.randn(n, dim, generator=g).to(torch.bfloat16).to(cfg.source_device)
    prompt_c = torch.randint(0, 2**40, (n, 4, 2), generator=g).to(cfg.source_device)
    lengths = torch.tensor([n]).to(cfg.source_device)
    keys = [key(100), key(101)]

    engine1 = TensorStore(8, BS, device=cfg.store_device, tier=tier)
    results = engine1.write_outputs(
        slots([1, 4, 6], n),
        hidden_states=prompt_h,
        multimodal_outputs={"codec_codes": prompt_c, "lengths": lengths},
        block_keys={1: keys[0], 4: keys[1]},
    )
    assert {name: r.stamped_block_ids for name, r in results.items()} == {
        HIDDEN_STATES: (1, 4),
        "codec_codes": (1, 4),
    }
    assert set(tier.values) == {
        f"omnicache:model-a:{k.hex()}:{name}"
        for k in keys
        for name in (HIDDEN_STATES, "codec_codes")
    }

    engine2 = TensorStore(16, BS, device=cfg.store_device, tier=tier)
    engine2.register(HIDDEN_STATES, dim, torch.bfloat16)
    engine2.register("codec_codes", (4, 2), torch.int64)
    assert engine2.read_through([9, 12], keys) == 2
    assert engine2.stats == StoreStats(num_tier_hit_blocks=2, num_tier_queried_blocks=2)

    # The request's last 2 prompt tokens are computed by engine 2.
    new_h = torch.randn(2, dim, generator=g).to(torch.bfloat16).to(cfg.source_device)
    new_c = torch.randint(0, 2**40, (2, 4, 2), generator=g).to(cfg.source_device)
    merged = engine2.read_merged(
        [ScheduledRequest("r", 2, 8, [9, 12], keys)],
        hidden_states=new_h,
        multimodal_outputs={"codec_codes": new_c, "lengths": lengths},
    )
    assert merged.misses == ()
    assert list(merged.passthrough) == ["lengths"]
    assert merged.passthrough["lengths"] is lengths
    h = merged.hidden_states["r"]
    c = merged.tensors["codec_codes"]["r"]
    assert (h.dtype, tuple(h.shape)) == (torch.bfloat16, (n, dim))
    assert (c.dtype, tuple(c.shape)) == (torch.int64, (n, 4, 2))
    assert torch.equal(cpu(h), torch.cat([cpu(prompt_h)[:8], cpu(new_h)]))
    assert torch.equal(cpu(c), torch.cat([cpu(prompt_c)[:8], cpu(new_c)]))
    assert tier.stats == TierStats(
        num_put_values=4,
        num_written_values=4,
        num_get_calls=1,
        num_get_blocks=2,
        num_hit_blocks=2,
    )
    assert [engine2.filled_of(HIDDEN_STATES, b) for b in (9, 12)] == [BS, BS]


def test_a_tier_whose_put_raises_fails_each_entry_of_a_step_alone(
    cfg: DeviceConfig, caplog: pytest.LogCaptureFixture
) -> None:
    tier = RaisingPut()
    store = make(cfg, tier)
    hs = hidden(cfg, 8)
    cs = codes(cfg, 8)
    keys = {2: key(2), 5: key(5)}
    with caplog.at_level(logging.WARNING, logger="omnicache.store"):
        results = store.write_outputs(
            slots([2, 5]), hidden_states=hs, multimodal_outputs={CODES: cs}, block_keys=keys
        )
    assert results == {
        HIDDEN_STATES: WriteResult(HIDDEN_STATES, 8, (2, 5), ()),
        CODES: WriteResult(CODES, 8, (2, 5), ()),
    }
    records = [r for r in caplog.records if r.name == "omnicache.store"]
    assert [r.getMessage() for r in records] == [
        f"tier RaisingPut failed to take 2 blocks of {name!r}: RuntimeError('tier full')"
        for name in NAMES
    ]
    assert (store.stats.num_tier_offered, store.stats.num_tier_errors) == (4, 2)
    assert stamps(store, [2, 5]) == {name: [key(2), key(5)] for name in NAMES}
    assert torch.equal(cpu(store.read_blocks(CODES, [2, 5], [key(2), key(5)])), cpu(cs))


def test_read_through_hands_its_blocks_out_again(cfg: DeviceConfig) -> None:
    """Rows staged for a block before `read_through` fills it are refused by commit."""
    written = write_three_blocks(cfg)
    reader = make(cfg, written.tier, num_blocks=6, deferred_codes=True)
    reader.stage("old", CODES, codes(cfg, 2, seed=3), token_start=0)
    reader.stage("kept", CODES, codes(cfg, 2, seed=4), token_start=0)
    # Without a tier, or with no block, nothing is asked and nothing changes hands.
    alone = make(cfg, num_blocks=6, deferred_codes=True)
    alone.stage("old", CODES, codes(cfg, 2, seed=3), token_start=0)
    assert alone.read_through(READER_BLOCKS, KEYS, names=[HIDDEN_STATES]) == 0
    assert reader.read_through([], [], names=[HIDDEN_STATES]) == 0
    assert list(alone.commit("old", READER_BLOCKS[:1], [])) == [CODES]

    assert reader.read_through(READER_BLOCKS, KEYS, names=[HIDDEN_STATES]) == 3

    with pytest.raises(StaleCommitError) as info:
        reader.commit("old", READER_BLOCKS[:1], [])
    assert (info.value.block_id, info.value.staged_block_id, info.value.owner) == (
        READER_BLOCKS[0],
        None,
        None,
    )
    assert reader.stats.num_refused_commits == 1
    # A block outside the filled ones keeps the rows staged for it.
    other = next(b for b in range(6) if b not in READER_BLOCKS)
    assert reader.commit("kept", [other], []) == {CODES: WriteResult(CODES, 2, (), ())}
