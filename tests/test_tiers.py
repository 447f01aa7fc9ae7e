"""The BlockTier contract, run against every tier: MemoryTier and RedisTier (a real server).

Each test gets a fresh namespace, so tests on the shared server never see each
other's values.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import key
from redis_server import RedisServer

from omnicache.store import EntrySpec, TierBlock
from omnicache.tiers import codec
from omnicache.tiers.base import TierStats, value_key
from omnicache.tiers.memory import MemoryTier
from omnicache.tiers.redis import RedisTier

BS = 4


def spec(name: str, row_shape: tuple[int, ...], dtype: torch.dtype) -> EntrySpec:
    return EntrySpec(name, row_shape, dtype, False, 0)


HIDDEN = spec("hidden_states", (8,), torch.bfloat16)
CODES = spec("codes", (2, 3), torch.int32)
ENTRIES = [HIDDEN, CODES]


def rows_for(entry: EntrySpec, i: int) -> torch.Tensor:
    """Distinct rows per (entry, block)."""
    n = BS
    for size in entry.row_shape:
        n *= size
    values = torch.arange(n, dtype=torch.float32) + 1000 * i
    return values.to(entry.dtype).reshape(BS, *entry.row_shape)


def blocks(indices: list[int], entries: list[EntrySpec] = ENTRIES) -> list[TierBlock]:
    return [TierBlock(key(i), e.name, rows_for(e, i)) for i in indices for e in entries]


@dataclass
class Harness:
    """A tier under test and raw access to what it stores."""

    tier: Any
    kind: str
    server: RedisServer | None

    def settle(self) -> None:
        if isinstance(self.tier, RedisTier):
            assert self.tier.flush(10)

    def name(self, i: int, entry: str) -> str:
        return value_key(self.tier.prefix, self.tier.namespace, key(i), entry)

    def raw_get(self, name: str) -> bytes | None:
        if self.server is None:
            return self.tier.values.get(name)  # type: ignore[no-any-return]
        value: bytes | None = self.server.client().get(name)
        return value

    def raw_set(self, name: str, value: bytes) -> None:
        if self.server is None:
            self.tier.values[name] = value
        else:
            self.server.client().set(name, value)

    def raw_delete(self, name: str) -> None:
        if self.server is None:
            del self.tier.values[name]
        else:
            assert self.server.client().delete(name) == 1


def _make(kind: str, request: pytest.FixtureRequest, **kwargs: Any) -> Iterator[Harness]:
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    if kind == "memory":
        yield Harness(MemoryTier(namespace=namespace, **kwargs), kind, None)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    tier = RedisTier.from_url(server.url, namespace=namespace, **kwargs)
    try:
        yield Harness(tier, kind, server)
    finally:
        tier.close(5)


@pytest.fixture(params=["memory", "redis"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from _make(request.param, request)


@pytest.fixture(params=["memory", "redis"])
def small_values(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A tier that keeps no value over 150 bytes: a block of HIDDEN takes 169."""
    yield from _make(request.param, request, max_value_bytes=150)


def assert_blocks(found: Any, indices: list[int], entries: list[EntrySpec] = ENTRIES) -> None:
    assert len(found) == len(indices)
    for got, i in zip(found, indices, strict=True):
        assert sorted(got) == sorted(e.name for e in entries)
        for e in entries:
            assert got[e.name].dtype == e.dtype
            assert torch.equal(got[e.name], rows_for(e, i)), (i, e.name)


# -- round trips -----------------------------------------------------------------


def test_get_returns_what_put_stored(harness: Harness) -> None:
    harness.tier.put(blocks([1, 2, 3]))
    harness.settle()
    found = harness.tier.get([key(1), key(2), key(3)], ENTRIES, BS)
    assert_blocks(found, [1, 2, 3])
    stats = harness.tier.stats
    assert (stats.num_put_values, stats.num_written_values) == (6, 6)
    assert (stats.num_get_calls, stats.num_get_blocks, stats.num_hit_blocks) == (1, 3, 3)
    assert stats.num_rejected_values == stats.num_read_errors == stats.num_faults == 0


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool]
)
def test_every_dtype_round_trips(harness: Harness, dtype: torch.dtype) -> None:
    entry = spec("out", (3, 2), dtype)
    rows = (torch.arange(BS * 6) % 7).to(dtype).reshape(BS, 3, 2)
    harness.tier.put([TierBlock(key(9), "out", rows)])
    harness.settle()
    [got] = harness.tier.get([key(9)], [entry], BS)
    assert got["out"].dtype == dtype
    assert torch.equal(got["out"], rows)


def test_values_live_under_the_documented_key(harness: Harness) -> None:
    harness.tier.put(blocks([5], [HIDDEN]))
    harness.settle()
    name = f"omnicache:{harness.tier.namespace}:{key(5).hex()}:hidden_states"
    value = harness.raw_get(name)
    assert value == codec.encode(key(5), "hidden_states", rows_for(HIDDEN, 5))


def test_put_copies_the_rows(harness: Harness) -> None:
    rows = rows_for(HIDDEN, 1).clone()
    harness.tier.put([TierBlock(key(1), HIDDEN.name, rows)])
    rows.fill_(0)
    harness.settle()
    [got] = harness.tier.get([key(1)], [HIDDEN], BS)
    assert torch.equal(got[HIDDEN.name], rows_for(HIDDEN, 1))


def test_strided_rows_store_as_their_contiguous_copy(harness: Harness) -> None:
    wide = torch.arange(BS * 16, dtype=torch.float32).reshape(BS, 16)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    entry = spec("s", (8,), torch.float32)
    harness.tier.put([TierBlock(key(2), "s", strided)])
    harness.settle()
    [got] = harness.tier.get([key(2)], [entry], BS)
    assert torch.equal(got["s"], strided.contiguous())


def test_empty_calls(harness: Harness) -> None:
    harness.tier.put([])
    harness.settle()
    assert harness.tier.get([], ENTRIES, BS) == []
    assert harness.tier.get([key(1)], [], BS) == []
    assert harness.tier.stats.num_put_values == 0


# -- leading runs --------------------------------------------------------------------


def test_the_run_stops_at_the_first_missing_block(harness: Harness) -> None:
    harness.tier.put(blocks([1, 3]))
    harness.settle()
    found = harness.tier.get([key(1), key(2), key(3)], ENTRIES, BS)
    assert_blocks(found, [1])
    assert harness.tier.stats.num_hit_blocks == 1


def test_a_block_missing_one_entry_is_a_miss(harness: Harness) -> None:
    """As after maxmemory evicted one of its values, or one of them expired."""
    harness.tier.put(blocks([1, 2, 3]))
    harness.settle()
    harness.raw_delete(harness.name(2, "codes"))
    found = harness.tier.get([key(1), key(2), key(3)], ENTRIES, BS)
    assert_blocks(found, [1])
    # Entries that are present alone still serve a read asking only for them.
    assert_blocks(harness.tier.get([key(2)], [HIDDEN], BS), [2], [HIDDEN])


def test_a_first_block_missing_is_an_empty_run(harness: Harness) -> None:
    harness.tier.put(blocks([2]))
    harness.settle()
    assert harness.tier.get([key(1), key(2)], ENTRIES, BS) == []


# -- nothing wrong is ever served ---------------------------------------------------


def _tampered(harness: Harness, value: bytes) -> list[Any]:
    harness.tier.put(blocks([1, 2]))
    harness.settle()
    harness.raw_set(harness.name(2, "hidden_states"), value)
    return list(harness.tier.get([key(1), key(2)], ENTRIES, BS))


def test_a_damaged_value_is_a_miss(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    value = bytearray(codec.encode(key(2), "hidden_states", rows_for(HIDDEN, 2)))
    value[-1] ^= 0x01
    with caplog.at_level(logging.WARNING):
        found = _tampered(harness, bytes(value))
    assert_blocks(found, [1])
    assert harness.tier.stats.num_rejected_values == 1
    if harness.kind == "redis":
        assert f"{harness.name(2, 'hidden_states')} rejected (checksum)" in caplog.text


def test_a_cut_value_is_a_miss(harness: Harness) -> None:
    value = codec.encode(key(2), "hidden_states", rows_for(HIDDEN, 2))
    assert_blocks(_tampered(harness, value[:-7]), [1])
    assert harness.tier.stats.num_rejected_values == 1


def test_another_blocks_value_is_a_miss(harness: Harness) -> None:
    """Same entry, same shape and dtype, valid checksum: but stamped with block 1's key."""
    value = codec.encode(key(1), "hidden_states", rows_for(HIDDEN, 1))
    assert_blocks(_tampered(harness, value), [1])
    assert harness.tier.stats.num_rejected_values == 1


def test_another_entrys_value_is_a_miss(harness: Harness) -> None:
    value = codec.encode(key(2), "other", rows_for(HIDDEN, 2))
    assert_blocks(_tampered(harness, value), [1])


def test_a_value_of_another_shape_or_dtype_is_a_miss(harness: Harness) -> None:
    harness.tier.put(blocks([1]))
    harness.settle()
    wider = spec("hidden_states", (16,), torch.bfloat16)
    assert harness.tier.get([key(1)], [wider], BS) == []
    as_float = spec("hidden_states", (8,), torch.float32)
    assert harness.tier.get([key(1)], [as_float], BS) == []
    assert harness.tier.get([key(1)], [HIDDEN], BS + 1) == []
    assert harness.tier.stats.num_rejected_values == 3


def test_namespaces_do_not_share(harness: Harness, request: pytest.FixtureRequest) -> None:
    harness.tier.put(blocks([1]))
    harness.settle()
    other = next(_make(harness.kind, request))
    if harness.server is None:
        # Two memory tiers never share; give the other one these very values.
        other.tier.values.update(harness.tier.values)
    assert other.tier.get([key(1)], ENTRIES, BS) == []


# -- limits ---------------------------------------------------------------------------


def test_values_over_the_size_limit_are_counted_not_stored(small_values: Harness) -> None:
    tier = small_values.tier
    small = spec("small", (1,), torch.uint8)
    tier.put([*blocks([1], [HIDDEN]), TierBlock(key(1), "small", torch.ones(BS, 1).byte())])
    small_values.settle()
    hidden_value = codec.encode(key(1), HIDDEN.name, rows_for(HIDDEN, 1))
    assert len(hidden_value) == 169
    stats: TierStats = tier.stats
    assert (stats.num_put_values, stats.num_oversize_values, stats.num_written_values) == (2, 1, 1)
    assert small_values.raw_get(small_values.name(1, "hidden_states")) is None
    assert tier.get([key(1)], [HIDDEN], BS) == []
    assert len(tier.get([key(1)], [small], BS)) == 1


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"namespace": "a:b"}, ValueError, "namespace: expected non-empty printable ASCII"),
        ({"namespace": ""}, ValueError, "namespace: expected non-empty"),
        ({"namespace": "x", "prefix": "{p}"}, ValueError, "prefix: expected non-empty"),
        ({"namespace": "x y"}, ValueError, "found 'x y'"),
        ({"namespace": 7}, TypeError, "namespace: expected str, found int"),
        (
            {"namespace": "x", "max_value_bytes": 0},
            ValueError,
            "max_value_bytes: expected int >= 1",
        ),
        ({"namespace": "x", "max_value_bytes": 1.5}, TypeError, "max_value_bytes: expected int"),
        ({"namespace": "x", "max_value_bytes": True}, TypeError, "found bool"),
    ],
)
def test_bad_arguments(
    kind: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    fragment: str,
    request: pytest.FixtureRequest,
) -> None:
    with pytest.raises(error) as info:
        if kind == "memory":
            MemoryTier(**kwargs)
        else:
            server: RedisServer = request.getfixturevalue("redis_server")
            RedisTier.from_url(server.url, **kwargs)
    assert fragment in str(info.value)


def test_counters_add_up_over_many_calls(harness: Harness) -> None:
    for start in range(0, 12, 3):
        harness.tier.put(blocks(list(range(start, start + 3))))
    harness.settle()
    for n in range(1, 6):
        found = harness.tier.get([key(i) for i in range(n)], ENTRIES, BS)
        assert_blocks(found, list(range(n)))
    found = harness.tier.get([key(i) for i in itertools.chain(range(12), [99])], ENTRIES, BS)
    assert len(found) == 12
    stats = harness.tier.stats
    assert (stats.num_put_values, stats.num_written_values) == (24, 24)
    assert (stats.num_get_calls, stats.num_get_blocks, stats.num_hit_blocks) == (6, 28, 27)


# -- keyed tiers -------------------------------------------------------------------------

AUTH_KEY = bytes(range(32))


@pytest.fixture(params=["memory", "redis"])
def keyed(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from _make(request.param, request, auth_key=AUTH_KEY)


def _same_namespace(harness: Harness, request: pytest.FixtureRequest, **kwargs: Any) -> Any:
    """Another tier over the same values (the same dict, or the same server and namespace)."""
    if harness.server is None:
        other = MemoryTier(namespace=harness.tier.namespace, **kwargs)
        other.values = harness.tier.values
        return other
    return RedisTier.from_url(harness.server.url, namespace=harness.tier.namespace, **kwargs)


def test_a_keyed_tier_round_trips(keyed: Harness) -> None:
    keyed.tier.put(blocks([1, 2]))
    keyed.settle()
    assert_blocks(keyed.tier.get([key(1), key(2)], ENTRIES, BS), [1, 2])
    value = keyed.raw_get(keyed.name(1, "hidden_states"))
    assert value is not None and value[:4] == b"OCTK"


def test_a_writer_without_the_key_cannot_plant_rows(
    keyed: Harness, request: pytest.FixtureRequest
) -> None:
    keyed.tier.put(blocks([1]))
    keyed.settle()
    # Someone with write access but no key stores rows for block 2, and
    # overwrites block 1 with rows signed by another key.
    planter = _same_namespace(keyed, request)
    planter.put(blocks([2]))
    forger = _same_namespace(keyed, request, auth_key=bytes(32))
    forger.put([TierBlock(key(1), HIDDEN.name, rows_for(HIDDEN, 9))])
    for other in (planter, forger):
        if isinstance(other, RedisTier):
            other.close(5)
    assert keyed.tier.get([key(1)], ENTRIES, BS) == []
    assert keyed.tier.get([key(2)], ENTRIES, BS) == []
    assert keyed.tier.stats.num_rejected_values == 2
    # And a reader without the key serves none of the keyed values.
    keyed.tier.put(blocks([3]))
    keyed.settle()
    reader = _same_namespace(keyed, request)
    assert reader.get([key(3)], ENTRIES, BS) == []
    assert reader.stats.num_rejected_values == 1
    if isinstance(reader, RedisTier):
        reader.close(5)
