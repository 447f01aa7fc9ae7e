"""Where rows live: the store's layout, each entry's cache and per-block state, row checks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from omnicache.checks import check_bool, check_int, check_str, type_name
from omnicache.store.slots import IntArray
from omnicache.store.specs import EntrySpec, StoreCapacityError

# Widest element types to move rows with, by size in bytes. Scatter and
# gather kernels move one element per step, so viewing a bf16 row as
# complex128 moves 8 values per step: a scattered whole-block write of 64 MiB
# of bf16 rows on CPU ran at 0.33 of a plain copy_ as bf16 and 0.96 as
# complex128. The bits are moved, never converted.
_WIDE_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


@dataclass(frozen=True, slots=True)
class Layout:
    """A store's geometry, and where its cache tensors live (see `make_layout`)."""

    num_blocks: int
    block_size: int
    num_slots: int
    device: torch.device
    on_cpu: bool
    # CPU cache tensors are pinned: copies from CUDA into them are asynchronous.
    pin_memory: bool


def make_layout(
    num_blocks: int, block_size: int, device: str | torch.device, pin_memory: bool | None
) -> Layout:
    """Checks a store's geometry and device arguments (see `TensorStore`)."""
    check_int("num_blocks", num_blocks, minimum=1)
    check_int("block_size", block_size, minimum=1)
    dev = _parse_device(device)
    if pin_memory is None:
        pin = dev.type == "cpu" and torch.cuda.is_available()
    else:
        pin = check_bool("pin_memory", pin_memory)
    if pin and dev.type != "cpu":
        raise ValueError(f"pin_memory: expected False for device {dev}, found True")
    if pin and not torch.cuda.is_available():
        raise ValueError("pin_memory: expected False or None without CUDA, found True")
    return Layout(num_blocks, block_size, num_blocks * block_size, dev, dev.type == "cpu", pin)


@dataclass(slots=True, eq=False)
class Entry:
    """One entry's cache tensor and the stamp and fill count of each of its blocks."""

    spec: EntrySpec
    # Values per token: rows are moved as (rows, dim).
    dim: int
    # (num_blocks, block_size, dim), and the same memory as (num_slots, dim).
    cache: torch.Tensor
    flat: torch.Tensor
    # Element type that moves whole rows (see _WIDE_DTYPES).
    wide_dtype: torch.dtype
    # Rows written in token order from offset 0, per block (see `fill`).
    filled: npt.NDArray[np.int32]
    # Object array of BlockHash or None: vectorized stamping and checks.
    stamps: npt.NDArray[np.object_]
    # CUDA events of asynchronous copies into ``cache`` not yet waited for.
    pending: list[torch.cuda.Event] = field(default_factory=list)


def make_spec(
    layout: Layout, name: str, dim: int | Sequence[int], dtype: torch.dtype, deferred: bool
) -> EntrySpec:
    """Checks an entry's declaration; its ``nbytes`` are those of a cache in ``layout``."""
    check_str("name", name, nonempty=True)
    if isinstance(dim, int) and not isinstance(dim, bool):
        row_shape: tuple[int, ...] = (dim,)
    elif isinstance(dim, Sequence) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in dim
    ):
        row_shape = tuple(dim)
    else:
        raise TypeError(f"dim: expected int or sequence of int, found {type_name(dim)}")
    if not row_shape or any(d < 1 for d in row_shape):
        raise ValueError(f"dim: expected positive sizes, found {row_shape}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected torch.dtype, found {type_name(dtype)}")
    check_bool("deferred", deferred)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = layout.num_slots * math.prod(row_shape) * itemsize
    return EntrySpec(name, row_shape, dtype, deferred, nbytes)


def new_entry(layout: Layout, spec: EntrySpec) -> Entry:
    """Allocates an entry's cache (zeros): no block holds a key or a row yet."""
    dim = math.prod(spec.row_shape)
    cache = torch.zeros(
        (layout.num_blocks, layout.block_size, dim),
        dtype=spec.dtype,
        device=layout.device,
        pin_memory=layout.pin_memory,
    )
    row_bytes = dim * cache.element_size()
    wide_dtype, wide_size = spec.dtype, cache.element_size()
    for size, candidate in _WIDE_DTYPES:
        if size > wide_size and row_bytes % size == 0:
            wide_dtype, wide_size = candidate, size
            break
    return Entry(
        spec=spec,
        dim=dim,
        cache=cache,
        flat=cache.view(layout.num_slots, dim),
        wide_dtype=wide_dtype,
        filled=np.zeros(layout.num_blocks, dtype=np.int32),
        stamps=np.full(layout.num_blocks, None, dtype=object),
    )


def entry_named(entries: Mapping[str, Entry], name: str) -> Entry:
    """The registered entry ``name``."""
    entry = entries.get(name)
    if entry is None:
        raise ValueError(f"name: expected a registered entry {list(entries)}, found {name!r}")
    return entry


def entries_named(entries: Mapping[str, Entry], names: Iterable[str] | None) -> list[Entry]:
    """The registered entries ``names`` (None: every one, in registration order)."""
    if names is None:
        return list(entries.values())
    if isinstance(names, str):
        raise TypeError("names: expected an iterable of entry names, found str")
    return [entry_named(entries, name) for name in names]


def check_capacity(
    entries: Mapping[str, Entry], specs: Sequence[EntrySpec], max_bytes: int | None
) -> None:
    """Raises `StoreCapacityError` when ``specs`` do not fit beside ``entries``."""
    if max_bytes is None or not specs:
        return
    used = sum(entry.spec.nbytes for entry in entries.values())
    need = sum(spec.nbytes for spec in specs)
    if used + need > max_bytes:
        names = ", ".join(repr(spec.name) for spec in specs)
        raise StoreCapacityError(
            f"entries {names}: need {need} bytes, {max_bytes - used} available "
            f"(max_bytes={max_bytes}, {used} used by {list(entries)})"
        )


def clear_blocks(entries: Iterable[Entry], ids: IntArray | list[int] | int | slice) -> None:
    """Clears the stamps and fill counts of blocks ``ids`` (checked) in ``entries``.

    A list holds a few ids (`blocks.small_block_ids`): cleared one by one,
    without a numpy call.
    """
    for entry in entries:
        if isinstance(ids, list):
            for block_id in ids:
                entry.stamps[block_id] = None
                entry.filled[block_id] = 0
            continue
        entry.stamps[ids] = None
        entry.filled[ids] = 0


def empty_rows(layout: Layout, entry: Entry, num_rows: int) -> torch.Tensor:
    """A new ``(num_rows, dim)`` buffer for the entry's rows on the store's device."""
    return torch.empty(
        (num_rows, entry.dim),
        dtype=entry.spec.dtype,
        device=layout.device,
        pin_memory=layout.pin_memory,
    )


def check_rows(spec: EntrySpec, rows: object, num_rows: int) -> None:
    """Rows a caller hands in for ``spec``: at least ``num_rows`` of them, on CPU or CUDA."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"entry {spec.name!r}: expected torch.Tensor rows, found {type_name(rows)}")
    if rows.shape[1:] != spec.row_shape or rows.ndim != len(spec.row_shape) + 1:
        shape = ", ".join(map(str, spec.row_shape))
        raise ValueError(
            f"entry {spec.name!r}: expected rows of shape (n, {shape}), found {tuple(rows.shape)}"
        )
    if rows.dtype != spec.dtype:
        raise ValueError(f"entry {spec.name!r}: expected dtype {spec.dtype}, found {rows.dtype}")
    if rows.shape[0] < num_rows:
        raise ValueError(
            f"entry {spec.name!r}: expected at least {num_rows} rows, found {rows.shape[0]}"
        )
    # NOTE: is_cpu / is_cuda rather than device.type: this check runs on every write.
    if not (rows.is_cpu or rows.is_cuda):
        raise ValueError(f"entry {spec.name!r}: expected rows on cpu or cuda, found {rows.device}")


def check_out(spec: EntrySpec, buf: object, num_rows: int, device: torch.device, what: str) -> None:
    """A caller's output buffer for ``num_rows`` rows of ``spec`` on ``device``."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what}: expected torch.Tensor, found {type_name(buf)}")
    if tuple(buf.shape[1:]) != spec.row_shape or buf.shape[0] < num_rows:
        raise ValueError(
            f"{what}: expected shape (>= {num_rows}, {', '.join(map(str, spec.row_shape))}), "
            f"found {tuple(buf.shape)}"
        )
    if buf.dtype != spec.dtype:
        raise ValueError(f"{what}: expected dtype {spec.dtype}, found {buf.dtype}")
    if buf.device != device:
        raise ValueError(f"{what}: expected device {device}, found {buf.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{what}: expected a contiguous buffer, found strides {buf.stride()}")


def _parse_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected str or torch.device, found {type_name(device)}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', found {device!r}") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', found {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: expected 'cpu' (CUDA is not available), found {device!r}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
