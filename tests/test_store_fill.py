"""The fill rule and the stamp rule: alike on ints and arrays, and as a token-by-token model."""

from __future__ import annotations

import numpy as np
import torch
from helpers import key
from hypothesis import given, settings
from hypothesis import strategies as st

from omnicache.block_hash import BlockHash
from omnicache.store import TensorStore
from omnicache.store.fill import BROKEN, fill_after, stamp_rule

# -- one rule, on ints and on arrays ---------------------------------------------------


def test_fill_after_restarts_extends_or_breaks_a_run() -> None:
    # (fill count before, offset, length) -> fill count after.
    cases = {
        (0, 0, 3): 3,  # a new run from offset 0
        (5, 0, 2): 2,  # offset 0 restarts a block, whatever it held
        (BROKEN, 0, 1): 1,  # ... and repairs a broken one
        (2, 2, 2): 4,  # a run that starts at the fill count extends it
        (2, 3, 1): BROKEN,  # a gap
        (3, 1, 1): BROKEN,  # a rewrite in the middle
        (BROKEN, 1, 1): BROKEN,  # a broken block stays broken
    }
    got = {case: fill_after(*case) for case in cases}
    assert got == cases
    filled, offsets, lens = (np.array(column) for column in zip(*cases, strict=True))
    assert fill_after(filled.astype(np.int32), offsets, lens).tolist() == list(cases.values())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-1, 8), st.integers(0, 7), st.integers(1, 8)), min_size=1, max_size=24
    )
)
def test_fill_after_is_the_same_rule_on_ints_and_arrays(runs: list[tuple[int, int, int]]) -> None:
    filled = np.array([f for f, _, _ in runs], dtype=np.int32)
    offsets = np.array([o for _, o, _ in runs], dtype=np.int64)
    lens = np.array([n for _, _, n in runs], dtype=np.int64)
    on_ints = [fill_after(f, o, n) for f, o, n in runs]
    assert fill_after(filled, offsets, lens).tolist() == on_ints
    # The rule itself, spelled out.
    assert on_ints == [o + n if o == 0 or f == o else BROKEN for f, o, n in runs]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(-1, 4)), min_size=1, max_size=24))
def test_stamp_rule_is_the_same_rule_on_ints_and_arrays(blocks: list[tuple[bool, int]]) -> None:
    block_size = 4
    keys: list[BlockHash | None] = [
        key(i) if keyed else None for i, (keyed, _) in enumerate(blocks)
    ]
    fills = [f for _, f in blocks]
    on_ints = [stamp_rule(k, f, block_size) for k, f in zip(keys, fills, strict=True)]
    # Stamped: keyed and complete; incomplete: keyed and not complete.
    assert on_ints == [
        (k is not None and f == block_size, k is not None and f != block_size)
        for k, f in zip(keys, fills, strict=True)
    ]
    key_array = np.empty(len(keys), dtype=object)
    key_array[:] = keys
    stamped, incomplete = stamp_rule(key_array, np.array(fills, dtype=np.int32), block_size)
    assert list(zip(stamped.tolist(), incomplete.tolist(), strict=True)) == on_ints


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
    assert [store.filled_of("h", b) for b in range(nb)] == final_fill
    stamped = [b for b in range(nb) if store.stamp_of("h", b) is not None]
    for b in stamped:
        got = store.read_blocks("h", [b], [key(b)])
        assert got.tolist() == [list(content[b * bs + o]) for o in range(bs)]
    # A block is stamped exactly when the last write touching it completed it.
    last_touch = {s // bs: i for i, slots in enumerate(writes) for s in slots}
    assert stamped == sorted(
        b for b, i in last_touch.items() if model_fill(writes[: i + 1], bs, nb)[b] == bs
    )
