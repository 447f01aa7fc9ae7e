"""A step's outputs: `TensorStore.write_outputs`, and `TensorStore.write_step`.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest
import torch
from helpers import DEVICE_CONFIGS, DeviceConfig, block_slots, cpu, key
from store_helpers import assert_same, make, rows, snapshot

from omnicache.block_hash import BlockHash
from omnicache.store import (
    HIDDEN_STATES,
    EntrySpec,
    ScheduledRequest,
    StoreCapacityError,
    TensorStore,
    WriteResult,
)

# -- write_outputs ------------------------------------------------------------


def test_write_outputs_caches_per_token_outputs_and_skips_metadata(cfg: DeviceConfig) -> None:
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
    # None of the metadata looks per-token: nothing is unplaced.
    assert store.stats.num_unplaced_outputs == 0


def test_write_outputs_counts_and_logs_per_token_outputs_it_cannot_place(
    cfg: DeviceConfig, caplog: pytest.LogCaptureFixture
) -> None:
    # 4 real tokens padded to 6: "unpadded" has the real rows only, "five"
    # one padding row; neither is the padded rows of a per-token output, nor
    # can it be told from per-request rows, so no entry is created.
    store = make(cfg)
    outputs: dict[str, object] = {
        "unpadded": rows(cfg, 4, 2),
        "five": rows(cfg, 5, 2, 2),
        "ref_len": torch.arange(4),  # 1-D metadata: passed over silently
        "summary": rows(cfg, 3, 3),  # fewer rows than tokens: silently too
        "wide": rows(cfg, 7, 2),  # more rows than the padded step: silently too
        "names": ["a", "b"],
    }
    with caplog.at_level(logging.WARNING, logger="omnicache.store"):
        for _ in range(2):
            results = store.write_outputs(
                [4, 5, 6, 7, -1, -1],
                hidden_states=rows(cfg, 6, 3),
                multimodal_outputs=outputs,
                num_tokens=4,
                num_tokens_padded=6,
                block_keys={1: key(1)},
            )
            assert list(results) == [HIDDEN_STATES]
    assert list(store.entries) == [HIDDEN_STATES]
    assert store.stats.num_unplaced_outputs == 4
    # Logged once per name, however many steps.
    assert [r.getMessage() for r in caplog.records] == [
        "output 'unpadded': shape (4, 2) on a step of 4 rows padded to 6: not cached (it has "
        "neither the padded rows of a per-token output nor an entry; register it to cache "
        "its first 4 rows); logged once, counted in num_unplaced_outputs",
        "output 'five': shape (5, 2, 2) on a step of 4 rows padded to 6: not cached (it has "
        "neither the padded rows of a per-token output nor an entry; register it to cache "
        "its first 4 rows); logged once, counted in num_unplaced_outputs",
    ]
    # Registered, the same output is cached from its first 4 rows.
    store.register("unpadded", 2, torch.float32)
    results = store.write_outputs(
        [4, 5, 6, 7, -1, -1],
        multimodal_outputs={"unpadded": outputs["unpadded"]},
        num_tokens=4,
        num_tokens_padded=6,
        block_keys={1: key(1)},
    )
    assert results == {"unpadded": WriteResult("unpadded", 4, (1,), ())}
    assert store.stats.num_unplaced_outputs == 4
    # Without padding, the step's rows are its padded rows: cached, not unplaced.
    store.write_outputs([8, 9], multimodal_outputs={"unpadded2": rows(cfg, 2, 2)})
    assert "unpadded2" in store.entries
    assert store.stats.num_unplaced_outputs == 4


def test_write_step_counts_unplaced_outputs_only_when_it_writes(cfg: DeviceConfig) -> None:
    store = step_store(cfg)
    step = small_step(cfg)
    outputs = {**step.multimodal_outputs, "unpadded": rows(cfg, 6, 2)}
    with pytest.raises(ValueError, match=r"num_tokens_padded: expected int >= 6 or None, found 5"):
        write_step(store, step, multimodal_outputs=outputs, num_tokens_padded=5)
    with pytest.raises(ValueError, match=r"entry 'codes': expected dtype torch.int64"):
        write_step(
            store,
            step,
            multimodal_outputs={**outputs, "codes": rows(cfg, 8, 2)},
            num_tokens_padded=8,
        )
    assert store.stats.num_unplaced_outputs == 0
    write_step(store, step, multimodal_outputs=outputs, num_tokens_padded=8)
    assert store.stats.num_unplaced_outputs == 1
    assert "unpadded" not in store.entries


def test_write_outputs_takes_strided_rows_of_whole_blocks(cfg: DeviceConfig) -> None:
    # Column slices of one fused projection (q, k, v) are strided views: the
    # whole-block fast path must move them exactly, and a later entry must
    # never fail after an earlier one was written.
    store = make(cfg)
    fused = rows(cfg, 8, 24)
    q, k, v = fused[:, :8], fused[:, 8:16], fused[:, 16:]
    assert not k.is_contiguous()
    results = store.write_outputs(
        block_slots([2, 5], 4),
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


def test_write_outputs_skips_deferred_entries(cfg: DeviceConfig) -> None:
    store = make(cfg)
    store.register("audio", 2, torch.float32, deferred=True)
    results = store.write_outputs(
        block_slots([3], 4),
        hidden_states=rows(cfg, 4, 3),
        multimodal_outputs={"audio": rows(cfg, 4, 2)},
        block_keys={3: key(3)},
    )
    assert list(results) == [HIDDEN_STATES]
    assert store.stamp_of("audio", 3) is None


def test_write_outputs_rejects_hidden_states_twice(cfg: DeviceConfig) -> None:
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


# -- write_step -------------------------------------------------------------------


def step_store(
    cfg: DeviceConfig, num_blocks: int = 8, max_bytes: int | None = None, hidden: bool = True
) -> TensorStore:
    """A store with a direct and a deferred entry, stamped blocks and staged rows.

    Entries: "audio" (deferred, 2 float32), "codes" (2 int64) and, with
    ``hidden``, hidden states (3 float32, created by a write); block 6 is
    stamped with key 6 and request "old" has 3 staged rows.
    """
    store = make(cfg, num_blocks=num_blocks, max_bytes=max_bytes)
    store.register("audio", 2, torch.float32, deferred=True)
    store.register("codes", 2, torch.int64)
    store.write_outputs(
        block_slots([6], 4),
        hidden_states=rows(cfg, 4, 3, seed=5) if hidden else None,
        multimodal_outputs={"codes": rows(cfg, 4, 2, dtype=torch.int64, seed=5)},
        block_keys={6: key(6)},
    )
    store.stage("old", "audio", rows(cfg, 3, 2, seed=6), token_start=0)
    return store


class Step(NamedTuple):
    requests: list[ScheduledRequest]
    slot_mapping: list[int]
    hidden_states: torch.Tensor
    multimodal_outputs: dict[str, object]
    block_keys: dict[int, BlockHash]


def small_step(cfg: DeviceConfig) -> Step:
    """Request "a" writes block 1 whole (tokens 0..3), "b" tokens 4..5 into block 3.

    Both blocks are keyed: block 1 is stamped, block 3 left incomplete. The
    outputs hold 6 rows and 2 rows of padding; "emb" is a new per-token output
    and "lengths" per-request metadata.
    """
    return Step(
        requests=[ScheduledRequest("a", 4, 0), ScheduledRequest("b", 2, 4)],
        slot_mapping=[4, 5, 6, 7, 12, 13],
        hidden_states=rows(cfg, 8, 3, seed=1),
        multimodal_outputs={
            "codes": rows(cfg, 8, 2, dtype=torch.int64, seed=2),
            "audio": rows(cfg, 8, 2, seed=3),
            "emb": rows(cfg, 8, 5, dtype=torch.bfloat16, seed=4),
            "lengths": torch.tensor([4, 2]),
        },
        block_keys={1: key(1), 3: key(3)},
    )


def write_step(store: TensorStore, step: Step, **changes: Any) -> dict[str, WriteResult]:
    """`TensorStore.write_step` of ``step``, with ``changes`` to its arguments."""
    kwargs: dict[str, Any] = {
        "hidden_states": step.hidden_states,
        "multimodal_outputs": step.multimodal_outputs,
        "block_keys": step.block_keys,
        "num_tokens_padded": 8,
        **changes,
    }
    requests = kwargs.pop("requests", step.requests)
    slot_mapping = kwargs.pop("slot_mapping", step.slot_mapping)
    return store.write_step(requests, slot_mapping, **kwargs)


def test_write_step_writes_direct_entries_and_stages_deferred_ones(cfg: DeviceConfig) -> None:
    store = step_store(cfg)
    step = small_step(cfg)
    mm = step.multimodal_outputs

    results = write_step(store, step)

    assert results == {
        HIDDEN_STATES: WriteResult(HIDDEN_STATES, 6, (1,), (3,)),
        "codes": WriteResult("codes", 6, (1,), (3,)),
        "emb": WriteResult("emb", 6, (1,), (3,)),
    }
    assert store.entries["emb"] == EntrySpec("emb", (5,), torch.bfloat16, False, 8 * 4 * 5 * 2)
    assert list(store.entries) == ["audio", "codes", HIDDEN_STATES, "emb"]
    for name, value in ((HIDDEN_STATES, step.hidden_states), ("codes", mm["codes"])):
        assert isinstance(value, torch.Tensor)
        assert torch.equal(cpu(store.read_blocks(name, [1], [key(1)])), cpu(value)[:4])
        assert torch.equal(store.cached_rows(name)[12:14], cpu(value)[4:6])
        assert [store.filled_of(name, b) for b in (1, 3, 6)] == [4, 2, 4]
        assert [store.stamp_of(name, b) for b in (1, 3, 6)] == [key(1), None, key(6)]
    # The deferred rows wait per request, at their token positions; the
    # padding rows are neither written nor staged.
    audio = mm["audio"]
    assert isinstance(audio, torch.Tensor)
    staged = store.staged_rows()
    assert list(staged) == ["old", "a", "b"]
    [(start_a, rows_a)] = staged["a"]["audio"]
    [(start_b, rows_b)] = staged["b"]["audio"]
    assert (start_a, start_b) == (0, 4)
    assert torch.equal(cpu(rows_a), cpu(audio)[:4])
    assert torch.equal(cpu(rows_b), cpu(audio)[4:6])
    assert store.stamp_of("audio", 1) is None
    stats = store.stats
    assert (stats.num_writes, stats.num_rows_written) == (2 + 3, 8 + 18)
    assert (stats.num_stamped_blocks, stats.num_incomplete_blocks) == (2 + 3, 3)
    assert stats.num_staged_bytes == (3 + 6) * 2 * 4
    # Committed, the staged rows stamp their blocks like the direct ones.
    assert store.commit("a", [1], [key(1)]) == {"audio": WriteResult("audio", 4, (1,), ())}
    assert torch.equal(cpu(store.read_blocks("audio", [1], [key(1)])), cpu(audio)[:4])


@pytest.mark.parametrize("size", ["small", "general"])
def test_write_step_equals_write_outputs_then_stage_outputs(cfg: DeviceConfig, size: str) -> None:
    if size == "small":
        num_blocks = 8
        step = small_step(cfg)
    else:
        # 600 rows, beyond the small-write path: 3 requests of 200 tokens.
        num_blocks = 180
        tables = [list(range(0, 50)), list(range(60, 110)), list(range(120, 170))]
        requests = [ScheduledRequest(f"r{i}", 200, 8) for i in range(3)]
        slot_mapping = [s for t in tables for s in block_slots(t, 4)]
        n = len(slot_mapping)
        step = Step(
            requests=requests,
            slot_mapping=slot_mapping,
            hidden_states=rows(cfg, n + 2, 3, seed=1),
            multimodal_outputs={
                "codes": rows(cfg, n + 2, 2, dtype=torch.int64, seed=2),
                "audio": rows(cfg, n + 2, 2, seed=3),
            },
            block_keys={b: key(b) for t in tables for b in t[:-1]},
        )
    once = step_store(cfg, num_blocks)
    twice = step_store(cfg, num_blocks)
    padded = len(step.slot_mapping) + 2
    results = write_step(once, step, num_tokens_padded=padded)
    expected = twice.write_outputs(
        step.slot_mapping,
        hidden_states=step.hidden_states,
        multimodal_outputs=step.multimodal_outputs,
        block_keys=step.block_keys,
        num_tokens_padded=padded,
    )
    twice.stage_outputs(
        step.requests,
        hidden_states=step.hidden_states,
        multimodal_outputs=step.multimodal_outputs,
    )
    assert results == expected
    assert_same(snapshot(once), snapshot(twice))


def test_write_step_of_requests_without_rows_writes_and_stages_nothing(cfg: DeviceConfig) -> None:
    store = step_store(cfg)
    results = store.write_step(
        [ScheduledRequest("a", 0, 5), ScheduledRequest("b", 0)],
        [],
        hidden_states=rows(cfg, 0, 3),
        multimodal_outputs={"audio": rows(cfg, 0, 2)},
    )
    assert results == {HIDDEN_STATES: WriteResult(HIDDEN_STATES, 0, (), ())}
    assert list(store.staged_rows()) == ["old"]


class StepCase(NamedTuple):
    name: str
    error: type[Exception]
    message: str
    call: Callable[[TensorStore, Step], object]
    # Arguments of `step_store` for the store called.
    store: Mapping[str, Any] = MappingProxyType({})


def rejected_step_cases(cfg: DeviceConfig) -> Iterator[StepCase]:
    """Calls that must raise exactly this, with one bad part each (the rest is good)."""
    mm = small_step(cfg).multimodal_outputs

    def outputs(**changes: object) -> dict[str, object]:
        return {**mm, **changes}

    yield StepCase(
        "rows and slots differ",
        ValueError,
        "requests: expected num_new_tokens summing to 6 (one per slot), found 5",
        lambda s, step: write_step(
            s, step, requests=[ScheduledRequest("a", 4, 0), ScheduledRequest("b", 1, 4)]
        ),
    )
    yield StepCase(
        "bad deferred dtype beside good direct outputs",
        ValueError,
        "entry 'audio': expected dtype torch.float32, found torch.float64",
        lambda s, step: write_step(
            s, step, multimodal_outputs=outputs(audio=rows(cfg, 8, 2, dtype=torch.float64))
        ),
    )
    yield StepCase(
        "deferred rows too few",
        ValueError,
        "entry 'audio': expected at least 6 rows, found 5",
        lambda s, step: write_step(s, step, multimodal_outputs=outputs(audio=rows(cfg, 5, 2))),
    )
    yield StepCase(
        "deferred rows of another shape",
        ValueError,
        "entry 'audio': expected rows of shape (n, 2), found (8, 3)",
        lambda s, step: write_step(s, step, multimodal_outputs=outputs(audio=rows(cfg, 8, 3))),
    )
    yield StepCase(
        "deferred rows that are no tensor",
        TypeError,
        "outputs['audio']: expected torch.Tensor, found list",
        lambda s, step: write_step(s, step, multimodal_outputs=outputs(audio=[[0.0, 1.0]] * 8)),
    )
    yield StepCase(
        "bad direct dtype beside a good deferred output",
        ValueError,
        "entry 'codes': expected dtype torch.int64, found torch.int32",
        lambda s, step: write_step(
            s, step, multimodal_outputs=outputs(codes=rows(cfg, 8, 2, dtype=torch.int32))
        ),
    )
    yield StepCase(
        "direct rows too few",
        ValueError,
        "entry 'hidden_states': expected at least 6 rows, found 5",
        lambda s, step: write_step(s, step, hidden_states=rows(cfg, 5, 3)),
    )
    yield StepCase(
        "direct rows that are no tensor",
        TypeError,
        "outputs['codes']: expected torch.Tensor for a cached entry, found list",
        lambda s, step: write_step(s, step, multimodal_outputs=outputs(codes=[[0, 1]] * 8)),
    )
    yield StepCase(
        "a new entry of 1-D rows",
        ValueError,
        "outputs['hidden_states']: expected (tokens, hidden) rows, found shape (8,)",
        lambda s, step: write_step(s, step, hidden_states=torch.zeros(8, device=cfg.source_device)),
        {"hidden": False},
    )
    yield StepCase(
        "slot out of range",
        IndexError,
        "slot_mapping[5]: expected 0..31, found 32",
        lambda s, step: write_step(s, step, slot_mapping=[4, 5, 6, 7, 12, 32]),
    )
    yield StepCase(
        "slot twice",
        ValueError,
        "slot_mapping: expected distinct slots, found slot 4 at rows [0, 5]",
        lambda s, step: write_step(s, step, slot_mapping=[4, 5, 6, 7, 12, 4]),
    )
    yield StepCase(
        "key of no bytes",
        TypeError,
        "block_keys[1]: expected bytes, found str",
        lambda s, step: write_step(s, step, block_keys={1: "k"}),
    )
    yield StepCase(
        "key of a block beyond the store",
        IndexError,
        "block_keys: expected block ids 0..7, found 8",
        lambda s, step: write_step(s, step, block_keys={8: key(8)}),
    )
    yield StepCase(
        "a request that is no ScheduledRequest",
        TypeError,
        "requests[1]: expected ScheduledRequest, found tuple",
        lambda s, step: write_step(s, step, requests=[step.requests[0], ("b", 2, 4)]),
    )
    yield StepCase(
        "a request listed twice",
        ValueError,
        "requests[1]: request 'a' listed twice",
        lambda s, step: write_step(
            s, step, requests=[ScheduledRequest("a", 4), ScheduledRequest("a", 2)]
        ),
    )
    yield StepCase(
        "fewer padded rows than slots",
        ValueError,
        "num_tokens_padded: expected int >= 6 or None, found 5",
        lambda s, step: write_step(s, step, num_tokens_padded=5),
    )
    yield StepCase(
        "hidden states twice",
        ValueError,
        "multimodal_outputs: expected no 'hidden_states' key when hidden_states is given",
        lambda s, step: write_step(
            s, step, multimodal_outputs=outputs(hidden_states=step.hidden_states)
        ),
    )
    yield StepCase(
        "no room for a new entry",
        StoreCapacityError,
        "entries 'emb': need 320 bytes, 248 available "
        "(max_bytes=1400, 1152 used by ['audio', 'codes', 'hidden_states'])",
        lambda s, step: write_step(s, step),
        {"max_bytes": 1400},
    )


STEP_CASE_NAMES = [c.name for c in rejected_step_cases(DEVICE_CONFIGS[0])]


@pytest.mark.parametrize("case", STEP_CASE_NAMES)
def test_rejected_write_step_changes_nothing(cfg: DeviceConfig, case: str) -> None:
    [bad] = [c for c in rejected_step_cases(cfg) if c.name == case]
    store = step_store(cfg, **bad.store)
    before = snapshot(store)
    with pytest.raises(bad.error) as info:
        bad.call(store, small_step(cfg))
    assert type(info.value) is bad.error
    assert str(info.value) == bad.message
    assert_same(before, snapshot(store))
