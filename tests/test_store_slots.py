"""Slot mappings cut into runs: the layouts that choose the copies, and the small-write cut.

`omnicache.store.slots` cuts a write's slots into runs of consecutive slots
per block, over numpy arrays (`segments`) or, for a small write, over Python
ints (`small_segments`), which accepts only input the general cut accepts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from helpers import block_slots
from store_helpers import SCATTERED

from omnicache.store import slots as slot_cuts
from omnicache.store.slots import SMALL_WRITE_MAX_ROWS, Segments, SmallSegments, is_one_run


def test_write_paths_are_chosen_from_the_slot_layout() -> None:
    def segments(slots: list[int]) -> Segments:
        return slot_cuts.segments(np.array(slots, dtype=np.int64), None, 2)

    # Scattered whole blocks: one indexed copy by block id.
    whole = segments(block_slots(SCATTERED, 2))
    assert whole.whole_blocks and not is_one_run(whole)
    assert whole.blocks.tolist() == SCATTERED
    # One row per block: indexed copy by slot.
    firsts = segments([2 * b for b in SCATTERED])
    assert not firsts.whole_blocks and not is_one_run(firsts)
    assert (firsts.blocks.tolist(), firsts.lens.tolist()) == (SCATTERED, [1] * 16)
    # Consecutive slots: one copy_, whole blocks or not.
    assert is_one_run(segments(block_slots([0, 1, 2, 3], 2)))
    assert is_one_run(segments([3, 4, 5, 6, 7]))
    # The same slots out of order are not one run.
    assert not is_one_run(segments(block_slots([1, 0, 2, 3], 2)))
    assert not is_one_run(segments([3, 5, 4, 6, 7]))


def test_small_segments_accepts_exactly_small_valid_distinct_slots() -> None:
    def small(mapping: object, num_tokens: Any) -> SmallSegments | None:
        return slot_cuts.small_segments(mapping, num_tokens, 256 * 4, 4)

    limit = SMALL_WRITE_MAX_ROWS
    scattered = [b * 4 + 1 for b in range(limit)]
    accepted: list[object] = [
        [9],
        scattered[:64],
        np.array(scattered[:64], dtype=np.int32),
        np.array(scattered[:64])[::-1],
        torch.tensor(scattered[:64]),
        torch.tensor(scattered[:64], dtype=torch.int32),
        list(range(limit)),
        [1, 3, 2],
    ]
    for mapping in accepted:
        assert isinstance(small(mapping, None), SmallSegments), mapping
    segs = small([4, 5, 6, 7, 8, 13, 15, 14], None)
    assert segs == SmallSegments(
        [4, 5, 6, 7, 8, 13, 15, 14],
        None,
        [1, 2, 3, 3, 3],
        [(1, 0, 4), (2, 0, 1), (3, 1, 1), (3, 3, 1), (3, 2, 1)],
        True,
        False,
    )
    assert small([6, 7, 8, 9], 3) == SmallSegments(
        [6, 7, 8], None, [1, 2], [(1, 2, 2), (2, 0, 1)], False, True
    )
    # Everything else is the general path's: big writes, other types, bad input.
    declined: list[tuple[object, Any]] = [
        (list(range(limit + 1)), None),
        ((1, 2), None),
        ([1, True], None),
        ([np.int64(1)], None),
        ([1.0], None),
        ([], None),
        ([1, 2], 0),
        ([1, 2], 3),
        ([1, 2], True),
        ([1024], None),
        ([-1], None),
        ([3, 3], None),
        ([3, 1, 3], None),
        (np.array([1.0]), None),
        (np.array([[1]]), None),
        (torch.tensor([1], dtype=torch.float32), None),
        (torch.tensor([[1]]), None),
        (torch.tensor([True]), None),
    ]
    for mapping, num_tokens in declined:
        assert small(mapping, num_tokens) is None, (mapping, num_tokens)
