"""TensorStore merged reads: hit blocks followed by the step's rows, never stale rows.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DeviceConfig, block_slots, cpu, key
from store_helpers import assert_same, make, rows, snapshot

from omnicache.store import HIDDEN_STATES, MergedRead, ReadMiss, ScheduledRequest, StaleBlockError

# -- merged reads ---------------------------------------------------------------


def test_read_merged_equals_recompute(cfg: DeviceConfig) -> None:
    store = make(cfg, num_blocks=16)
    # Request "a" computed earlier into blocks 9, 4, 12 (12 tokens), "b" into 2.
    full_a = rows(cfg, 15, 6, dtype=torch.bfloat16, seed=1)
    full_b = rows(cfg, 6, 6, dtype=torch.bfloat16, seed=2)
    codes_a = rows(cfg, 15, 2, dtype=torch.int64, seed=3)
    store.write_outputs(
        block_slots([9, 4, 12], 4),
        hidden_states=full_a[:12],
        multimodal_outputs={"codes": codes_a[:12]},
        block_keys={9: key(9), 4: key(4), 12: key(12)},
    )
    store.write_outputs(
        block_slots([2], 4),
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


def test_read_merged_gathers_into_given_buffers(cfg: DeviceConfig) -> None:
    store = make(cfg)
    data = rows(cfg, 8, 3)
    store.write_outputs(
        block_slots([6, 1], 4), hidden_states=data, block_keys={6: key(6), 1: key(1)}
    )
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


def test_read_merged_reports_stale_blocks_as_misses_or_raises(cfg: DeviceConfig) -> None:
    store = make(cfg)
    data = rows(cfg, 8, 3)
    store.write_outputs(
        block_slots([6, 1], 4), hidden_states=data, block_keys={6: key(6), 1: key(1)}
    )
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


def test_read_merged_wrong_key_is_a_miss(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.write_outputs(block_slots([3], 4), hidden_states=rows(cfg, 4, 3), block_keys={3: key(3)})
    merged = store.read_merged(
        [ScheduledRequest("a", 0, 4, [3], [key(4)])], hidden_states=rows(cfg, 0, 3)
    )
    assert merged == MergedRead({HIDDEN_STATES: {}}, {}, (ReadMiss("a", 1, 0, HIDDEN_STATES),))


def test_read_merged_rejects_bad_requests_without_counting(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.write_outputs(block_slots([3], 4), hidden_states=rows(cfg, 4, 3), block_keys={3: key(3)})
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


def test_read_merged_refuses_new_rows_that_do_not_follow_the_hit(cfg: DeviceConfig) -> None:
    # Block 3 holds tokens 0..3; a request that says it computed 6 tokens
    # would get its new rows at positions 4.. with 4..5 missing.
    store = make(cfg)
    store.write_outputs(block_slots([3], 4), hidden_states=rows(cfg, 4, 3), block_keys={3: key(3)})
    before = snapshot(store)
    hs = rows(cfg, 3, 3, seed=1)
    for computed in (6, 0, 3, 8):
        with pytest.raises(ValueError) as info:
            store.read_merged(
                [ScheduledRequest("x", 1), ScheduledRequest("a", 2, computed, [3], [key(3)])],
                hidden_states=hs,
            )
        assert type(info.value) is ValueError
        assert str(info.value) == (
            "requests[1].num_computed_tokens: expected 4 (request 'a': 1 hit blocks of 4 "
            f"tokens, its new rows right after them), found {computed}"
        )
    with pytest.raises(ValueError, match=r"expected 8 \(request 'a': 2 hit blocks of 4 tokens"):
        store.read_merged(
            [ScheduledRequest("a", 3, 4, [3, 3], [key(3), key(3)])], hidden_states=hs, strict=True
        )
    assert_same(before, snapshot(store))


def test_read_merged_of_requests_without_hit_blocks_starts_anywhere(cfg: DeviceConfig) -> None:
    # A later chunk of a prompt (tokens 8..10) and a decode step (token 37)
    # have no hit blocks: they get their new rows, exactly, and nothing else.
    store = make(cfg)
    store.write_outputs(block_slots([3], 4), hidden_states=rows(cfg, 4, 3), block_keys={3: key(3)})
    hs = rows(cfg, 4, 3, seed=2)
    merged = store.read_merged(
        [
            ScheduledRequest("chunk", 3, 8),
            ScheduledRequest("decode", 1, 37),
        ],
        hidden_states=hs,
    )
    assert merged.misses == ()
    assert torch.equal(cpu(merged.hidden_states["chunk"]), cpu(hs)[:3])
    assert torch.equal(cpu(merged.hidden_states["decode"]), cpu(hs)[3:])
    stats = store.stats
    assert (stats.num_read_requests, stats.num_hit_blocks_read, stats.num_stale_reads) == (2, 0, 0)
