"""Numeric arrays and tensors as canonical (dtype name, shape, C-order bytes).

torch is never imported here: a tensor can only exist if its caller already
imported torch, so ``sys.modules`` tells whether an object may be one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

# Non-contiguous inputs are copied slab by slab so a strided view never needs
# a second full-size buffer; 1 MiB slabs stay in the core's L2 cache.
_SLAB_BYTES = 1 << 20

# NOTE: numpy's dtype.name is stable across platforms ("int64", never "long").
_NUMERIC_KINDS = "biufc"


class CanonicalArray(NamedTuple):
    array: np.ndarray[Any, Any]  # native numpy view or copy holding the values
    dtype_name: str  # "float32", "bfloat16", ...: the element type as hashed


def is_array_like(obj: object) -> bool:
    """Whether ``obj`` is a numpy array or a torch tensor."""
    if isinstance(obj, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_to_numpy(tensor: Any, what: str) -> CanonicalArray:
    import torch  # already imported by whoever made the tensor

    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: expected a dense (strided) tensor, found layout {tensor.layout}")
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        # NOTE: one device-to-host copy; hashing on the device would give a
        # different digest for the same item (SGLang's CPU/GPU split).
        t = t.cpu()
    dtype_name = str(t.dtype).removeprefix("torch.")
    try:
        return CanonicalArray(t.numpy(), dtype_name)
    except TypeError:
        # bfloat16, float8 and friends have no numpy dtype: hash their bits
        # through an integer view of the same width, under their own name.
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return CanonicalArray(t.view(bits[t.element_size()]).numpy(), dtype_name)


def as_canonical_array(obj: object, what: str) -> CanonicalArray:
    """Validate ``obj`` as a numeric array/tensor and give its canonical view.

    Args:
        obj: a numpy array or a torch tensor on any device.
        what: the argument's name, for error messages.

    Raises:
        TypeError: ``obj`` is no array, or its dtype is not numeric.
    """
    if isinstance(obj, np.ndarray):
        canonical = CanonicalArray(obj, obj.dtype.name)
    elif is_array_like(obj):
        canonical = _tensor_to_numpy(obj, what)
    else:
        raise TypeError(
            f"{what}: expected a numpy.ndarray or torch.Tensor, found {type(obj).__name__}"
        )
    array = canonical.array
    if array.dtype.kind not in _NUMERIC_KINDS and canonical.dtype_name != "bfloat16":
        raise TypeError(
            f"{what}: expected a numeric dtype (bool, int, uint, float, complex), "
            f"found {array.dtype}"
        )
    if array.dtype.byteorder == ">":
        # Same values, same digest: big-endian input is hashed as little-endian.
        array = array.astype(array.dtype.newbyteorder("<"))
        canonical = CanonicalArray(array, canonical.dtype_name)
    return canonical


def iter_c_order_bytes(array: np.ndarray[Any, Any]) -> Iterator[memoryview]:
    """Yield the array's bytes in C order, without copying when it is C-contiguous."""
    if array.flags.c_contiguous:
        yield array.reshape(-1).view(np.uint8).data
        return
    # NOTE: the C-order bytes of an array are the concatenation of the C-order
    # bytes of its slabs along axis 0, so slabs can be made contiguous alone.
    row_bytes = max(1, array[0].nbytes) if array.ndim > 1 else array.itemsize
    rows = max(1, _SLAB_BYTES // row_bytes)
    for start in range(0, array.shape[0], rows):
        slab = np.ascontiguousarray(array[start : start + rows])
        yield slab.reshape(-1).view(np.uint8).data
