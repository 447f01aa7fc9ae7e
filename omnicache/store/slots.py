"""A write's slot mapping: parsed, checked and cut into runs of consecutive slots per block.

A slot is ``block_id * block_size + offset``. A run is a stretch of rows whose
slots are consecutive inside one block: the unit of the fill rule (see
`omnicache.store.fill`) and, where runs are long, of the copies.

Two cuts give the same runs: `segments` over numpy arrays for any write, and
`small_segments` over Python ints for a small one (a decode step), where
numpy's per-call cost would exceed the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from omnicache.checks import check_optional_int, type_name

IntArray = npt.NDArray[np.int64]

# Slot tensor dtypes a write accepts.
SLOT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)

# Writes of at most this many rows take the small-write path: runs, fill
# counts and stamps over Python ints, then one copy op. A decode step writes
# one row per request, and numpy's per-call cost on such tiny arrays made the
# general path cost several times the copy. The bound is where the small
# path stops being faster, warm, on the CPU; right after a forward pass, where
# a live engine writes, every numpy call is cold and the small path gains more
# (benchmarks/bench_store.py pins both paths).
SMALL_WRITE_MAX_ROWS = 512


class Segments(NamedTuple):
    """A write's slots cut into runs of consecutive slots inside one block."""

    slots: IntArray
    # The slots as a tensor on the caller's device, when one was given.
    slots_tensor: torch.Tensor | None
    # Block, offset in the block and length of each run.
    blocks: IntArray
    offsets: IntArray
    lens: IntArray
    # Whether a block appears in more than one run.
    repeated_blocks: bool
    # Whether every run is one whole block (then ``blocks`` are the targets).
    whole_blocks: bool


class SmallSegments(NamedTuple):
    """A small write's slots cut into runs, as Python ints (see `Segments`)."""

    slots: list[int]
    # The caller's slot mapping (tensor or ndarray), for the copy's index;
    # None for a list.
    source: torch.Tensor | IntArray | None
    # Block of each run, and (block, offset in the block, length) of each.
    blocks: list[int]
    runs: list[tuple[int, int, int]]
    repeated_blocks: bool
    # Whether the slots are consecutive: one copy_ moves them all.
    one_run: bool


def parse_slots(
    slot_mapping: object, num_tokens: int | None, num_slots: int
) -> tuple[IntArray, torch.Tensor | None]:
    """The first ``num_tokens`` slots: an int64 host array, and the device tensor given, if any.

    Raises:
        TypeError, ValueError, IndexError: A mapping that is no 1-D integer
            sequence, a bad ``num_tokens``, or a slot outside ``0..num_slots - 1``.
    """
    device_tensor: torch.Tensor | None = None
    if isinstance(slot_mapping, torch.Tensor):
        if slot_mapping.dtype not in SLOT_DTYPES:
            raise TypeError(
                f"slot_mapping: expected an integer tensor, found dtype {slot_mapping.dtype}"
            )
        if slot_mapping.ndim != 1:
            raise ValueError(
                f"slot_mapping: expected 1 dim, found shape {tuple(slot_mapping.shape)}"
            )
        if slot_mapping.device.type != "cpu":
            device_tensor = slot_mapping
        host = slot_mapping.detach().cpu().numpy()
    elif isinstance(slot_mapping, np.ndarray):
        host = slot_mapping
    elif isinstance(slot_mapping, Sequence) and not isinstance(slot_mapping, (str, bytes)):
        host = np.asarray(slot_mapping)
        if host.size == 0:
            host = host.astype(np.int64)
    else:
        raise TypeError(
            "slot_mapping: expected torch.Tensor, numpy.ndarray or sequence of int, "
            f"found {type_name(slot_mapping)}"
        )
    if host.ndim != 1:
        raise ValueError(f"slot_mapping: expected 1 dim, found shape {host.shape}")
    if host.dtype.kind not in "iu":
        raise TypeError(f"slot_mapping: expected integers, found dtype {host.dtype}")
    check_optional_int("num_tokens", num_tokens, minimum=0, maximum=len(host))
    n = len(host) if num_tokens is None else num_tokens
    # NOTE: contiguous, so that the copy can index with it (a reversed
    # view has negative strides, which torch.from_numpy refuses).
    slots = np.ascontiguousarray(host[:n], dtype=np.int64)
    bad = np.flatnonzero((slots < 0) | (slots >= num_slots))
    if bad.size:
        index = int(bad[0])
        raise IndexError(
            f"slot_mapping[{index}]: expected 0..{num_slots - 1}, found {int(slots[index])}"
        )
    if device_tensor is not None:
        device_tensor = device_tensor[:n]
    return slots, device_tensor


def segments(slots: IntArray, slots_tensor: torch.Tensor | None, block_size: int) -> Segments:
    """Cuts checked ``slots`` into runs.

    Raises:
        ValueError: A slot given twice.
    """
    n = len(slots)
    bs = block_size
    if n and n % bs == 0:
        # Fast path for whole blocks (a prefill, a commit, a block load):
        # every row of ``by_block`` is one block's slots in order.
        by_block = slots.reshape(-1, bs)
        first = by_block[:, 0]
        if not (first % bs).any() and (by_block - first[:, None] == np.arange(bs)).all():
            blocks = first // bs
            if int(np.bincount(blocks).max()) > 1:
                _raise_duplicate_slot(slots)
            num_blocks = len(blocks)
            return Segments(
                slots=slots,
                slots_tensor=slots_tensor,
                blocks=blocks,
                offsets=np.zeros(num_blocks, dtype=np.int64),
                lens=np.full(num_blocks, bs, dtype=np.int64),
                repeated_blocks=False,
                whole_blocks=True,
            )
    blocks, offsets = np.divmod(slots, bs)
    if n:
        brk = np.empty(n, dtype=bool)
        brk[0] = True
        np.not_equal(np.diff(slots), 1, out=brk[1:])
        brk[1:] |= offsets[1:] == 0
        starts = np.flatnonzero(brk)
    else:
        starts = np.zeros(0, dtype=np.int64)
    seg_blocks = blocks[starts]
    # NOTE: runs hold distinct slots of one block each, so a slot can
    # repeat only where a block starts more than one run.
    repeated = bool(n) and int(np.bincount(seg_blocks).max()) > 1
    if repeated and len(np.unique(slots)) != n:
        _raise_duplicate_slot(slots)
    return Segments(
        slots=slots,
        slots_tensor=slots_tensor,
        blocks=seg_blocks,
        offsets=offsets[starts],
        lens=np.diff(np.append(starts, n)),
        repeated_blocks=repeated,
        whole_blocks=False,
    )


def small_segments(
    slot_mapping: object, num_tokens: int | None, num_slots: int, block_size: int
) -> SmallSegments | None:
    """`segments` of a small write over Python ints, or None.

    NOTE: None hands the write to the general path, which raises the
    errors: this path accepts only input the general one accepts (valid,
    distinct slots), so both paths reject the same input the same way.
    """
    source: torch.Tensor | IntArray | None
    if isinstance(slot_mapping, np.ndarray):
        if slot_mapping.ndim != 1 or slot_mapping.dtype.kind not in "iu":
            return None
        source = slot_mapping
    elif isinstance(slot_mapping, torch.Tensor):
        if (
            slot_mapping.ndim != 1
            or slot_mapping.dtype not in SLOT_DTYPES
            or not (slot_mapping.is_cpu or slot_mapping.is_cuda)
        ):
            return None
        source = slot_mapping
    elif type(slot_mapping) is list:
        source = None
    else:
        return None
    size = len(slot_mapping) if source is None else source.shape[0]
    n = size if num_tokens is None else num_tokens
    if type(n) is not int or not 0 < n <= min(size, SMALL_WRITE_MAX_ROWS):
        return None
    if source is None:
        assert isinstance(slot_mapping, list)
        slots: list[int] = slot_mapping[:n]
        # NOTE: bools, numpy ints and floats go the general way.
        if set(map(type, slots)) != {int}:
            return None
    else:
        slots = (source if n == size else source[:n]).tolist()
    bs = block_size
    prev = slots[0]
    if not 0 <= prev < num_slots:
        return None
    block, offset = divmod(prev, bs)
    length = 1
    blocks = [block]
    runs: list[tuple[int, int, int]] = []
    one_run = True
    for slot in slots[1:]:
        # A slot past its predecessor inside the same block extends the run
        # (and is in range, since the block is).
        if slot == prev + 1 and slot % bs:
            length += 1
        else:
            if not 0 <= slot < num_slots:
                return None
            if slot != prev + 1:
                one_run = False
            runs.append((block, offset, length))
            block, offset = divmod(slot, bs)
            length = 1
            blocks.append(block)
        prev = slot
    runs.append((block, offset, length))
    # NOTE: as in `segments`, a slot can repeat only where a block starts
    # more than one run.
    repeated = len(set(blocks)) != len(blocks)
    if repeated and len(set(slots)) != n:
        return None
    return SmallSegments(slots, source, blocks, runs, repeated, one_run)


def cut(
    slot_mapping: object, num_tokens: int | None, num_slots: int, block_size: int
) -> Segments | SmallSegments:
    """A write's first ``num_tokens`` slots (default: all) checked and cut into runs.

    Over Python ints when the write is small (see `small_segments`), else
    over numpy arrays.

    Raises:
        TypeError, ValueError, IndexError: As `parse_slots` and `segments`.
    """
    small = small_segments(slot_mapping, num_tokens, num_slots, block_size)
    if small is not None:
        return small
    slots, slots_tensor = parse_slots(slot_mapping, num_tokens, num_slots)
    return segments(slots, slots_tensor, block_size)


def as_segments(segs: SmallSegments, block_size: int) -> Segments:
    """A small write's runs as `segments` makes them (for copies run by run)."""
    source = segs.source
    n = len(segs.slots)
    device_slots = source[:n] if isinstance(source, torch.Tensor) and source.is_cuda else None
    return segments(np.array(segs.slots, dtype=np.int64), device_slots, block_size)


def runs(slots: IntArray) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges whose slots are consecutive."""
    starts = np.concatenate(([0], np.flatnonzero(np.diff(slots) != 1) + 1))
    stops = np.append(starts[1:], len(slots))
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def is_one_run(segs: Segments) -> bool:
    """Whether the slots are consecutive: one copy_ moves them all."""
    slots = segs.slots
    if not len(slots) or int(slots[-1]) - int(slots[0]) != len(slots) - 1:
        return False
    if segs.whole_blocks:
        return bool((np.diff(segs.blocks) == 1).all())
    return bool((np.diff(slots) == 1).all())


def _raise_duplicate_slot(slots: IntArray) -> None:
    uniq, counts = np.unique(slots, return_counts=True)
    dup = int(uniq[np.flatnonzero(counts > 1)[0]])
    where = np.flatnonzero(slots == dup)[:2].tolist()
    raise ValueError(f"slot_mapping: expected distinct slots, found slot {dup} at rows {where}")
