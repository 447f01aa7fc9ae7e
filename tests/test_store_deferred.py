"""Deferred entries: rows staged per request, committed into its blocks or discarded.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DeviceConfig, cpu, key
from store_helpers import assert_same, make, rows, snapshot

from omnicache.store import ScheduledRequest, WriteResult

# -- deferred entries -------------------------------------------------------------


def test_deferred_rows_are_staged_committed_and_stamped(cfg: DeviceConfig) -> None:
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


def test_rejected_commit_keeps_staged_rows(cfg: DeviceConfig) -> None:
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


def test_stage_validates(cfg: DeviceConfig) -> None:
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


def test_later_staged_chunks_overwrite_earlier_ones(cfg: DeviceConfig) -> None:
    # A preempted request recomputes tokens 0..3; its second pass wins.
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    store.stage("a", "audio", rows(cfg, 4, 2, seed=1), token_start=0)
    second = rows(cfg, 4, 2, seed=2)
    store.stage("a", "audio", second, token_start=0)
    assert store.commit("a", [6], [key(6)]) == {"audio": WriteResult("audio", 8, (6,), ())}
    assert torch.equal(cpu(store.read_blocks("audio", [6], [key(6)])), cpu(second))
