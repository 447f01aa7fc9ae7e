"""The fill rule and the stamp rule, against a token-by-token model."""

from __future__ import annotations

import torch
from helpers import key
from hypothesis import given, settings
from hypothesis import strategies as st

from omnicache.store import (
    TensorStore,
)

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
