"""Deferred entries: rows staged per request, committed into its blocks or discarded.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import DeviceConfig, cpu, key
from store_helpers import assert_same, make, rows, snapshot

from omnicache.block_hash import BlockHash
from omnicache.store import ScheduledRequest, StaleCommitError, TensorStore, WriteResult

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


# -- commits onto blocks that changed hands -----------------------------------------


def audio_store(cfg: DeviceConfig) -> TensorStore:
    """A store (8 blocks of 4) whose one entry, "audio" (2 float32), is deferred."""
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    return store


def audio_step(
    cfg: DeviceConfig, store: TensorStore, step: list[ScheduledRequest], slots: list[int], seed: int
) -> torch.Tensor:
    """Stages a step's audio rows through `write_step` (which knows their slots); returns them."""
    audio = rows(cfg, len(slots), 2, seed=seed)
    assert store.write_step(step, slots, multimodal_outputs={"audio": audio}) == {}
    return audio


def refused_commit(
    store: TensorStore, req_id: str, block_ids: list[int], keys: list[BlockHash]
) -> StaleCommitError:
    """Commits, expecting the refusal; checks it changed nothing but its counter."""
    before = snapshot(store)
    with pytest.raises(StaleCommitError) as info:
        store.commit(req_id, block_ids, keys)
    after = snapshot(store)
    assert after.stats == replace(
        before.stats, num_refused_commits=before.stats.num_refused_commits + 1
    )
    assert_same(before._replace(stats=after.stats), after)
    return info.value


def fields(err: StaleCommitError) -> tuple[object, ...]:
    return (
        err.req_id,
        err.name,
        err.token,
        err.block_index,
        err.block_id,
        err.staged_block_id,
        err.owner,
    )


def test_commit_onto_a_block_handed_out_since_is_refused_and_counted(cfg: DeviceConfig) -> None:
    store = audio_store(cfg)
    # "a" computes tokens 0..5 into blocks 3 (whole) and 5 (offsets 0, 1).
    audio_step(cfg, store, [ScheduledRequest("a", 6)], [12, 13, 14, 15, 20, 21], seed=1)
    # Its commit comes late: the pool handed block 5 out again in between.
    store.on_block_evicted(5, key(5))
    err = refused_commit(store, "a", [3, 5], [key(3)])
    assert str(err) == (
        "commit of request 'a': entry 'audio', token 4: expected block 5 (block_ids[1]) held "
        "by the request since the row was staged, found it handed out again since (evicted "
        "or invalidated)"
    )
    assert fields(err) == ("a", "audio", 4, 1, 5, 5, None)
    assert isinstance(err, ValueError)
    # Nothing was written; the rows stay staged, refused again until discarded.
    assert [store.filled_of("audio", b) for b in (3, 5)] == [0, 0]
    with pytest.raises(StaleCommitError, match=r"token 4: expected block 5"):
        store.commit("a", [3, 5], [key(3)])
    assert store.stats.num_refused_commits == 2
    assert store.discard("a") == 6 * 2 * 4
    assert store.stats.num_staged_bytes == 0


def test_commit_onto_a_block_another_request_wrote_is_refused(cfg: DeviceConfig) -> None:
    # "a" leaves block 2 half full: freed without a key, the pool hands it to
    # "b" with no eviction call. Only b's step tells the store.
    store = audio_store(cfg)
    audio_step(cfg, store, [ScheduledRequest("a", 2)], [8, 9], seed=1)
    audio_b = audio_step(cfg, store, [ScheduledRequest("b", 4)], [8, 9, 10, 11], seed=2)
    assert store.commit("b", [2], [key(20)]) == {"audio": WriteResult("audio", 4, (2,), ())}
    err = refused_commit(store, "a", [2], [])
    assert str(err) == (
        "commit of request 'a': entry 'audio', token 0: expected block 2 (block_ids[0]) held "
        "by the request since the row was staged, found it in request 'b''s table since"
    )
    assert fields(err) == ("a", "audio", 0, 0, 2, 2, "b")
    # b's rows and stamp are untouched.
    assert store.stamp_of("audio", 2) == key(20)
    assert torch.equal(cpu(store.read_blocks("audio", [2], [key(20)])), cpu(audio_b))


def test_a_late_commit_never_restamps_the_new_owners_block(cfg: DeviceConfig) -> None:
    # Block 2 was whole, so the pool evicted its key when it handed it out.
    store = audio_store(cfg)
    audio_step(cfg, store, [ScheduledRequest("a", 4)], [8, 9, 10, 11], seed=1)
    store.on_block_evicted(2, key(2))
    audio_b = audio_step(cfg, store, [ScheduledRequest("b", 4)], [8, 9, 10, 11], seed=2)
    assert store.commit("b", [2], [key(20)]) == {"audio": WriteResult("audio", 4, (2,), ())}
    err = refused_commit(store, "a", [2], [key(2)])
    assert fields(err) == ("a", "audio", 0, 0, 2, 2, "b")
    assert store.stamp_of("audio", 2) == key(20)
    assert store.filled_of("audio", 2) == 4
    assert torch.equal(cpu(store.read_blocks("audio", [2], [key(20)])), cpu(audio_b))


def test_commit_into_other_blocks_than_staged_for_is_refused(cfg: DeviceConfig) -> None:
    store = audio_store(cfg)
    audio_step(
        cfg,
        store,
        [ScheduledRequest("a", 4), ScheduledRequest("b", 2, 4)],
        [16, 17, 18, 19, 4, 5],
        seed=1,
    )
    err = refused_commit(store, "b", [6, 7], [key(6)])
    assert str(err) == (
        "commit of request 'b': entry 'audio', token 4: expected block 1 (the block it was "
        "staged for), found block 7 (block_ids[1])"
    )
    assert fields(err) == ("b", "audio", 4, 1, 7, 1, None)
    assert store.commit("b", [6, 1], [key(6)]) == {"audio": WriteResult("audio", 2, (), ())}
    assert store.commit("a", [4], [key(4)]) == {"audio": WriteResult("audio", 4, (4,), ())}
    assert store.stats.num_refused_commits == 1


def test_rows_staged_without_slots_are_refused_by_blocks_handed_out_since(
    cfg: DeviceConfig,
) -> None:
    store = audio_store(cfg)
    # Blocks invalidated *before* staging (newly allocated ones) take the rows.
    store.invalidate([6, 7])
    store.stage("a", "audio", rows(cfg, 6, 2, seed=1), token_start=0)
    store.stage_outputs(
        [ScheduledRequest("b", 2, 4)], multimodal_outputs={"audio": rows(cfg, 2, 2)}
    )
    store.stage("c", "audio", rows(cfg, 1, 2), token_start=0)
    store.invalidate([0, 7])
    err = refused_commit(store, "a", [6, 7], [key(6)])
    assert fields(err) == ("a", "audio", 4, 1, 7, None, None)
    assert str(err).startswith("commit of request 'a': entry 'audio', token 4: expected block 7")
    assert store.commit("b", [1, 2], []) == {"audio": WriteResult("audio", 2, (), ())}
    # Once every key is forgotten, no block's next owner is seen: all refused.
    store.invalidate_all()
    assert fields(refused_commit(store, "c", [3], [])) == ("c", "audio", 0, 0, 3, None, None)
    assert store.stats.num_refused_commits == 2
    assert store.has_staged("a") and store.has_staged("c")


def test_tokens_restaged_after_the_hand_over_commit(cfg: DeviceConfig) -> None:
    # Preempted, "a" lost blocks 1 and 2 and recomputes tokens 0..5 into 5 and 6.
    store = audio_store(cfg)
    audio_step(cfg, store, [ScheduledRequest("a", 6)], [4, 5, 6, 7, 8, 9], seed=1)
    store.on_block_evicted(1, key(1))
    store.on_block_evicted(2, key(2))
    again = audio_step(cfg, store, [ScheduledRequest("a", 6)], [20, 21, 22, 23, 24, 25], seed=2)
    assert store.commit("a", [5, 6], [key(5)]) == {"audio": WriteResult("audio", 12, (5,), ())}
    assert torch.equal(cpu(store.read_blocks("audio", [5], [key(5)])), cpu(again)[:4])
    assert torch.equal(store.cached_rows("audio")[24:26], cpu(again)[4:])


def test_a_token_not_restaged_keeps_its_old_block_refused(cfg: DeviceConfig) -> None:
    store = audio_store(cfg)
    audio_step(cfg, store, [ScheduledRequest("a", 6)], [4, 5, 6, 7, 8, 9], seed=1)
    store.on_block_evicted(2, key(2))
    # Token 4 is recomputed into block 7, token 5 is not: its row still
    # names block 2.
    audio_step(cfg, store, [ScheduledRequest("a", 1, 4)], [28], seed=2)
    err = refused_commit(store, "a", [1, 7], [key(1)])
    assert fields(err) == ("a", "audio", 5, 1, 7, 2, None)
    audio_step(cfg, store, [ScheduledRequest("a", 1, 5)], [29], seed=3)
    assert store.commit("a", [1, 7], [key(1)]) == {"audio": WriteResult("audio", 8, (1,), ())}


def test_two_requests_writing_one_block_in_one_step_refuse_the_first(cfg: DeviceConfig) -> None:
    store = audio_store(cfg)
    audio_step(
        cfg, store, [ScheduledRequest("a", 2), ScheduledRequest("b", 2, 2)], [8, 9, 10, 11], seed=1
    )
    assert fields(refused_commit(store, "a", [2], [])) == ("a", "audio", 0, 0, 2, 2, "b")
    assert store.commit("b", [2], [key(2)]) == {"audio": WriteResult("audio", 2, (), (2,))}


def test_a_request_that_writes_its_own_blocks_keeps_them(cfg: DeviceConfig) -> None:
    store = audio_store(cfg)
    # Rows staged without slots, then steps that write the same block (3):
    # the request's own steps, so nothing changed hands.
    store.stage("a", "audio", rows(cfg, 2, 2, seed=1), token_start=0)
    audio_step(cfg, store, [ScheduledRequest("a", 1, 2)], [14], seed=2)
    audio_step(cfg, store, [ScheduledRequest("a", 1, 3)], [15], seed=3)
    # Other blocks changing hands do not matter either.
    store.on_block_evicted(4, key(4))
    store.invalidate([5])
    assert store.commit("a", [3], [key(3)]) == {"audio": WriteResult("audio", 4, (3,), ())}
    assert store.stats.num_refused_commits == 0


def test_a_rejected_write_step_takes_no_block(cfg: DeviceConfig) -> None:
    store = audio_store(cfg)
    audio_step(cfg, store, [ScheduledRequest("a", 2)], [8, 9], seed=1)
    with pytest.raises(ValueError, match=r"entry 'audio': expected dtype torch.float32"):
        store.write_step(
            [ScheduledRequest("b", 2)],
            [10, 11],
            multimodal_outputs={"audio": rows(cfg, 2, 2).double()},
        )
    with pytest.raises(IndexError, match=r"block_ids\[1\]: expected 0..7, found 8"):
        store.invalidate([2, 8])
    assert store.commit("a", [2], []) == {"audio": WriteResult("audio", 2, (), ())}
