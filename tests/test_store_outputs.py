"""A step's outputs: `TensorStore.write_outputs`.

Every test that takes ``cfg`` runs on each device configuration present (see
conftest.py): a CPU store fed from CPU tensors (always); with CUDA, a CUDA
store fed from CUDA tensors and a pinned CPU store fed from CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DeviceConfig, block_slots, cpu, key
from store_helpers import make, rows

from omnicache.store import (
    HIDDEN_STATES,
    EntrySpec,
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
