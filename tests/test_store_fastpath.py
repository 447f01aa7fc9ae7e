"""TensorStore's small-write and small-read paths against the general ones.

A decode step writes one row per request, so `TensorStore.write` and
`TensorStore.write_outputs` compute small writes over Python ints, and
`TensorStore.read_merged` checks a request's few hit blocks without numpy.
These tests drive those paths and run every operation twice, on a store that
takes them and on a twin whose quick paths are switched off, so that the
general code handles everything. Both must end with the same cache bytes,
stamps, fill counts, counters and results, and raise the same errors.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest
import torch
from helpers import DEVICES, key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import assert_same, snapshot

from omnicache.block_hash import BlockHash
from omnicache.store import (
    HIDDEN_STATES,
    MergedRead,
    ReadMiss,
    ScheduledRequest,
    TensorStore,
    WriteResult,
)
from omnicache.store import reads as reads_module
from omnicache.store import slots as slots_module
from omnicache.store.blocks import hit_blocks
from omnicache.store.writes import Writer

# name -> (row shape, dtype). Rows of 16, 12 and 6 bytes move as complex128,
# int32 and int16 (the widened copies); hidden states are created by a write.
ENTRIES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "h": ((4,), torch.float32),
    "codes": ((2, 3), torch.int16),
    "emb": ((3,), torch.bfloat16),
}
KEYS = [BlockHash(bytes([i]) * 16) for i in range(4)]


@contextlib.contextmanager
def general_paths() -> Iterator[None]:
    """Switches the store's quick paths off: the general code handles every call.

    Writes never take the small path, and merged reads check every request's
    hit blocks with numpy.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slots_module, "small_segments", lambda *args: None)
        patch.setattr(reads_module, "hit_block_list", lambda *args: hit_blocks(*args).tolist())
        yield


class _GeneralTwin:
    """A store whose every method runs under `general_paths`."""

    def __init__(self, store: TensorStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            with general_paths():
                return value(*args, **kwargs)

        return call


def general_twin(store: TensorStore) -> TensorStore:
    """``store`` with its quick paths switched off: the general code handles every call.

    Merged reads check stamps with the reads module's `num_valid_list`;
    `vectorized_stamp_checks` runs them with the vectorized `num_valid` instead.
    """
    return cast(TensorStore, _GeneralTwin(store))


@contextlib.contextmanager
def vectorized_stamp_checks() -> Iterator[None]:
    def num_valid(entries: Any, ids: list[int], keys: Any) -> Any:
        return reads_module.num_valid(entries, np.array(ids, dtype=np.int64), keys)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reads_module, "num_valid_list", num_valid)
        yield


def new_pair(num_blocks: int, block_size: int, device: str) -> tuple[TensorStore, TensorStore]:
    pair = []
    for _ in range(2):
        store = TensorStore(num_blocks, block_size, device=device)
        for name, (shape, dtype) in ENTRIES.items():
            store.register(name, shape, dtype)
        pair.append(store)
    return pair[0], general_twin(pair[1])


def assert_same_state(fast: TensorStore, general: TensorStore) -> None:
    assert_same(snapshot(fast), snapshot(general))


def outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The call's result, or the type and text of its error."""
    try:
        return ("ok", call(*args, **kwargs))
    except Exception as exc:
        return ("error", type(exc), str(exc))


def assert_same_read(a: Any, b: Any) -> None:
    assert a[0] == b[0]
    if a[0] == "error":
        assert a == b
        return
    ra, rb = a[1], b[1]
    assert isinstance(ra, MergedRead) and isinstance(rb, MergedRead)
    assert ra.misses == rb.misses
    assert ra.passthrough.keys() == rb.passthrough.keys()
    assert ra.tensors.keys() == rb.tensors.keys()
    for name, per_req in ra.tensors.items():
        assert list(per_req) == list(rb.tensors[name])
        for req_id, rows in per_req.items():
            assert torch.equal(rows.cpu(), rb.tensors[name][req_id].cpu()), (name, req_id)


# -- the small path is the one taken ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_takes_the_small_path(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = TensorStore(16, 4, device=device)
    store.register("h", 4, torch.float32)
    calls: list[int] = []
    apply_small = Writer.apply_small

    def spy(self: Writer, *args: Any) -> WriteResult:
        calls.append(len(args[2].slots))
        return apply_small(self, *args)

    monkeypatch.setattr(Writer, "apply_small", spy)
    rows = torch.arange(12, dtype=torch.float32).view(3, 4).to(device)
    # Three requests, one row each, in distinct blocks; block 5 fills on its last row.
    store.invalidate([5])
    store.write("h", rows[:3], [20, 21, 22])
    result = store.write("h", rows, [3, 23, 40], block_keys={5: key(5), 10: key(10)})
    assert result == WriteResult("h", 3, (5,), (10,))
    assert calls == [3, 3]
    assert store.stamp_of("h", 5) == key(5)
    assert [store.filled_of("h", b) for b in (0, 5, 10)] == [-1, 4, 1]
    assert torch.equal(store.cached_rows("h")[23], rows[1].cpu())


# -- equivalence on random programs --------------------------------------------


def random_slots(rng: random.Random, num_blocks: int, bs: int) -> list[int]:
    num_slots = num_blocks * bs
    kind = rng.choice(["decode", "decode", "run", "blocks", "random", "bad"])
    if kind == "decode":
        # One row per request, each in its own block, often at its fill count.
        blocks = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
        return [b * bs + rng.choice([0, rng.randrange(bs)]) for b in blocks]
    if kind == "run":
        start = rng.randrange(num_slots)
        return list(range(start, min(num_slots, start + rng.randint(1, 2 * bs))))
    if kind == "blocks":
        blocks = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
        return [b * bs + o for b in blocks for o in range(bs)]
    if kind == "random":
        return rng.sample(range(num_slots), rng.randint(1, min(num_slots, 8)))
    slots = rng.sample(range(num_slots), rng.randint(1, min(num_slots, 4)))
    bad = rng.choice([num_slots, -1, slots[0], num_slots + 7])
    slots.insert(rng.randrange(len(slots) + 1), bad)
    return slots


def as_mapping(rng: random.Random, slots: list[int], device: str) -> object:
    if min(slots) < 0 and rng.random() < 0.8:
        return slots
    kind = rng.choice(["list", "list", "int64", "int32", "reversed", "tensor", "tensor32", "tuple"])
    if kind == "list":
        return list(slots)
    if kind == "tuple":
        return tuple(slots)
    if kind == "int64":
        return np.array(slots, dtype=np.int64)
    if kind == "int32":
        return np.array(slots, dtype=np.int32)
    if kind == "reversed":
        return np.array(slots[::-1], dtype=np.int64)[::-1]
    dtype = torch.int64 if kind == "tensor" else torch.int32
    return torch.tensor(slots, dtype=dtype, device=rng.choice([device, "cpu"]))


def random_rows(
    rng: random.Random, name: str, num_rows: int, device: str, gen: torch.Generator
) -> torch.Tensor:
    shape, dtype = ENTRIES.get(name, ((5,), torch.float32))
    values = torch.randint(-50, 50, (num_rows, *shape), generator=gen)
    kind = rng.choice(["plain", "plain", "strided", "grad", "wrong_dtype", "wrong_shape"])
    if kind == "strided" and len(shape) == 1:
        wide = torch.randint(-50, 50, (num_rows, 2 * shape[0]), generator=gen)
        return wide.to(dtype).to(device)[:, : shape[0]]
    if kind == "grad" and dtype.is_floating_point:
        return values.to(dtype).to(device).requires_grad_()
    if kind == "wrong_dtype" and rng.random() < 0.3:
        return values.to(torch.float64).to(device)
    if kind == "wrong_shape" and rng.random() < 0.3:
        return values.reshape(num_rows, int(np.prod(shape)))[:, :1].to(dtype).to(device)
    return values.to(dtype).to(device)


def random_keys(
    rng: random.Random, slots: list[int], num_blocks: int, bs: int
) -> dict[int, BlockHash] | None:
    if rng.random() < 0.2:
        return None
    blocks = sorted({s // bs for s in slots if 0 <= s < num_blocks * bs})
    keys: dict[Any, Any] = {b: rng.choice(KEYS) for b in blocks if rng.random() < 0.7}
    if rng.random() < 0.2:
        keys[rng.randrange(num_blocks)] = rng.choice(KEYS)
    if rng.random() < 0.05:
        keys[rng.choice([num_blocks, -1])] = KEYS[0]
    if rng.random() < 0.05 and keys:
        keys[next(iter(keys))] = "not bytes"
    return keys


def random_requests(
    rng: random.Random, fast: TensorStore, num_blocks: int
) -> list[ScheduledRequest]:
    requests = []
    for i in range(rng.randint(0, 5)):
        hit = rng.sample(range(num_blocks), rng.randint(0, min(3, num_blocks)))
        # Mostly the keys the blocks hold (hits), sometimes another (a stale block).
        keys = [
            (fast.stamp_of("h", b) or KEYS[0]) if rng.random() < 0.8 else rng.choice(KEYS)
            for b in hit
        ]
        ids: object = hit
        if rng.random() < 0.15:
            ids = rng.choice([tuple(hit), np.array(hit, dtype=np.int64)])
        if rng.random() < 0.05:
            ids, keys = [*hit, rng.choice([num_blocks, -1])], [*keys, KEYS[1]]
        if rng.random() < 0.05:
            keys = [*keys, KEYS[1]]
        # The step's rows start right after the hit; sometimes elsewhere: refused
        # with hit blocks, served without.
        computed = len(hit) * fast.block_size
        if rng.random() < 0.05:
            computed += rng.choice([-1, 1]) if computed else 1
        requests.append(ScheduledRequest(f"r{i}", rng.randint(0, 3), computed, ids, keys))  # type: ignore[arg-type]
    return requests


def run_program(seed: int, device: str, num_ops: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks, bs = rng.randint(2, 6), rng.randint(1, 4)
    fast, general = new_pair(num_blocks, bs, device)
    for _ in range(num_ops):
        op = rng.choice(["write", "write", "write", "outputs", "evict", "read"])
        if op == "write":
            slots = random_slots(rng, num_blocks, bs)
            mapping = as_mapping(rng, slots, device)
            name = rng.choice(list(ENTRIES))
            num_tokens = rng.choice([None, None, rng.randint(0, len(slots) + 1)])
            rows = random_rows(rng, name, len(slots) + rng.randint(0, 2), device, gen)
            keys = random_keys(rng, slots, num_blocks, bs)
            results = [
                outcome(s.write, name, rows, mapping, block_keys=keys, num_tokens=num_tokens)
                for s in (fast, general)
            ]
            assert results[0] == results[1], (slots, mapping, num_tokens)
        elif op == "outputs":
            slots = random_slots(rng, num_blocks, bs)
            mapping = as_mapping(rng, slots, device)
            n = len(slots)
            hidden = random_rows(rng, HIDDEN_STATES, n, device, gen)
            mm: dict[str, object] = {"codes": random_rows(rng, "codes", n, device, gen)}
            if rng.random() < 0.5:
                mm["emb"] = random_rows(rng, "emb", n, device, gen)
            mm["lengths"] = torch.arange(3)
            keys = random_keys(rng, slots, num_blocks, bs)
            results = [
                outcome(
                    s.write_outputs,
                    mapping,
                    hidden_states=hidden,
                    multimodal_outputs=mm,
                    block_keys=keys,
                )
                for s in (fast, general)
            ]
            assert results[0] == results[1], (slots, mapping)
        elif op == "evict":
            blocks = rng.sample(range(num_blocks), rng.randint(1, 2))
            evict = rng.random() < 0.5
            for store in (fast, general):
                if evict:
                    store.on_block_evicted(blocks[0], KEYS[0])
                else:
                    store.invalidate(blocks)
        else:
            requests = random_requests(rng, fast, num_blocks)
            total_new = sum(r.num_new_tokens for r in requests)
            hidden = random_rows(rng, "h", total_new, device, gen)
            strict = rng.random() < 0.3
            use_out = rng.random() < 0.5
            outputs: dict[str, object] = {"h": hidden, "meta": [1]}
            if rng.random() < 0.5:
                outputs["emb"] = random_rows(rng, "emb", total_new, device, gen)
            reads = []
            for store in (fast, general):
                out = store.new_read_buffers(64, list(ENTRIES)) if use_out else None
                with vectorized_stamp_checks() if store is general else contextlib.nullcontext():
                    reads.append(
                        outcome(
                            store.read_merged,
                            requests,
                            multimodal_outputs=outputs,
                            out=out,
                            strict=strict,
                        )
                    )
            assert_same_read(reads[0], reads[1])
            if reads[0][0] == "ok":
                names = [name for name in outputs if name in ENTRIES]
                assert_merged_rows(fast, requests, hidden, reads[0][1], names)
        assert_same_state(fast, general)


def expected_misses(
    store: TensorStore, requests: list[ScheduledRequest], names: list[str]
) -> list[ReadMiss]:
    """A request misses at its first block that fails a stamp of any entry read."""
    misses = []
    for request in requests:
        ids = list(request.hit_block_ids)
        for index, (block_id, block_key) in enumerate(
            zip(ids, request.hit_block_keys, strict=True)
        ):
            failed = [n for n in names if store.stamp_of(n, block_id) != block_key]
            if failed:
                misses.append(ReadMiss(request.req_id, len(ids), index, failed[0]))
                break
    return misses


def assert_merged_rows(
    store: TensorStore,
    requests: list[ScheduledRequest],
    hidden: torch.Tensor,
    merged: MergedRead,
    names: list[str] = ["h"],  # noqa: B006 (never mutated)
) -> None:
    """Misses as the stamps say; each request read holds its blocks' rows of
    entry "h", then its own new rows."""
    assert list(merged.misses) == expected_misses(store, requests, names)
    missed = {m.req_id for m in merged.misses}
    per_req = merged.tensors["h"]
    flat = store.cached_rows("h")
    bs = store.block_size
    start = 0
    for request in requests:
        stop = start + request.num_new_tokens
        if request.req_id in missed:
            assert request.req_id not in per_req
        else:
            slots = [b * bs + o for b in list(request.hit_block_ids) for o in range(bs)]
            expected = torch.cat([flat[slots], hidden[start:stop].detach().cpu()])
            assert torch.equal(per_req[request.req_id].cpu(), expected)
        start = stop


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_small_paths_equal_general_paths(device: str, seed: int) -> None:
    run_program(seed, device, num_ops=30)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_cycles_equal_general_path(device: str) -> None:
    """Many requests decoding in lockstep: blocks fill in order and stamp on completion."""
    num_requests, bs = 24, 4
    fast, general = new_pair(2 * num_requests, bs, device)
    blocks = list(range(0, 2 * num_requests, 2))
    gen = torch.Generator().manual_seed(1)
    num_stamped = 0
    for step in range(3 * bs):
        offsets = [(step + i) % bs for i in range(num_requests)]
        slots = torch.tensor([b * bs + o for b, o in zip(blocks, offsets, strict=True)])
        keys = {b: key(b) for b, o in zip(blocks, offsets, strict=True) if o == bs - 1}
        rows = torch.randn(num_requests, 4, generator=gen).to(device)
        results = [s.write("h", rows, slots.to(device), block_keys=keys) for s in (fast, general)]
        assert results[0] == results[1]
        num_stamped += len(results[0].stamped_block_ids)
        assert_same_state(fast, general)
    # Every block completes 3 times; the first time only where it started at offset 0.
    assert num_stamped == 3 * num_requests - (num_requests - num_requests // bs)
    assert fast.stats.num_stamped_blocks == num_stamped


def test_merged_read_of_decode_step_equals_recompute() -> None:
    """64 requests, 2 hit blocks and one new row each, and some that miss."""
    bs, num_requests = 4, 64
    store = TensorStore(2 * num_requests + 8, bs)
    store.register("h", 4, torch.float32)
    ids = list(range(2 * num_requests))
    cached = torch.randn(len(ids) * bs, 4, generator=torch.Generator().manual_seed(2))
    store.write_blocks("h", cached, ids, block_keys=[key(b) for b in ids])
    new = torch.randn(num_requests, 4, generator=torch.Generator().manual_seed(3))
    requests = [
        ScheduledRequest(
            f"r{i}",
            1,
            2 * bs,
            ids[2 * i : 2 * i + 2],
            [key(b) if i % 7 else KEYS[0] for b in ids[2 * i : 2 * i + 2]],
        )
        for i in range(num_requests)
    ]
    out = store.new_read_buffers(num_requests * (2 * bs + 1))
    merged = store.read_merged(requests, multimodal_outputs={"h": new}, out=out)
    assert [m.req_id for m in merged.misses] == [f"r{i}" for i in range(0, num_requests, 7)]
    assert_merged_rows(store, requests, new, merged)
    # The requests read lie back to back in the buffer, in batch order.
    per_req = merged.tensors["h"]
    read = [r.req_id for r in requests if r.req_id in per_req]
    assert read == list(per_req)
    base = out["h"].data_ptr()
    row_bytes = 4 * 4
    for index, req_id in enumerate(read):
        assert per_req[req_id].data_ptr() == base + index * (2 * bs + 1) * row_bytes
    assert store.stats.num_hit_blocks_read == 2 * len(read)
    assert store.stats.num_stale_reads == len(merged.misses)


def test_repeated_blocks_report_in_block_order() -> None:
    """Two runs in one block: results list blocks in ascending order, as the general path."""
    bs = 2
    fast, general = new_pair(24, bs, "cpu")
    for store in (fast, general):
        store.write("h", torch.ones(2, 4), [34, 2])
    # Blocks 17 and 1 both get two runs (a set iterates 17 before 1 here).
    slots = [35, 3, 34, 2]
    keys = {17: key(17), 1: key(1)}
    results = [s.write("h", torch.ones(4, 4), slots, block_keys=keys) for s in (fast, general)]
    assert results[0] == results[1]
    # Offsets 1 then 0: the run broke, then offset 0 restarted it with one row.
    assert results[0] == WriteResult("h", 4, (), (1, 17))
    assert_same_state(fast, general)
    # Without repeated blocks, results follow the runs' order.
    results = [s.write("h", torch.ones(2, 4), [35, 3], block_keys=keys) for s in (fast, general)]
    assert results[0] == results[1] == WriteResult("h", 2, (17, 1), ())
    assert_same_state(fast, general)
