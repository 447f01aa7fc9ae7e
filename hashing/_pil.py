"""Pixel bytes of PIL images, read in place through Pillow's Arrow export.

Canonical pixel layout (version 1), one entry per pixel in row-major order:

    mode                      bytes/pixel  layout
    "1"                       1/8          Pillow's packed bits, rows padded to a byte
    L, P, I, F, I;16*         1, 1, 4, 4, 2  the mode's raw packing (tobytes())
    RGBA, RGBX, RGBa, CMYK    4            b0 b1 b2 b3
    RGB, YCbCr, LAB, HSV      4            b0 b1 b2 FF   (LAB: a and b as Pillow
                                           stores them, tobytes() XOR 0x80)
    LA, La, PA                4            b0 FF FF b1

The 4-byte slots are Pillow's own storage with the unused bytes set to 0xFF,
so the common case hashes Pillow's buffer where it lies instead of repacking
it the way ``tobytes()`` and ``np.asarray`` do (2.4 ms for a 2048² RGB image).
The unused bytes must be canonical because Pillow leaves them 0xFF after
decoding or filling but 0x00 after resizing: the same picture would otherwise
hash two ways. 0xFF is the common case, so a 3-band image whose pad bytes
are all 0xFF (one vectorised min over the buffer) is hashed in place; any
other is hashed through an OR mask into a scratch buffer, a chunk at a time.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image

# Bits of a little-endian 4-byte slot that hold no band: set to 1 canonically.
_PAD_BITS = {2: np.uint32(0x00FFFF00), 3: np.uint32(0xFF000000), 4: None}
_SLOT_MODES = {
    "LA": 2, "La": 2, "PA": 2,
    "RGB": 3, "YCbCr": 3, "LAB": 3, "HSV": 3,
    "RGBA": 4, "RGBX": 4, "RGBa": 4, "CMYK": 4,
}  # fmt: skip
_RAW_MODES = {"1", "L", "P", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"}
SUPPORTED_MODES = frozenset(_SLOT_MODES) | _RAW_MODES

# 256 Ki pixels (1 MiB) per masked chunk: it stays in L2 between the mask and
# the hash.
_CHUNK_PIXELS = 1 << 18
_ARROW_ITEM_SIZES = {b"C": 1, b"c": 1, b"s": 2, b"S": 2, b"i": 4, b"I": 4, b"f": 4}


class _ArrowSchema(ctypes.Structure):
    pass


class _ArrowArray(ctypes.Structure):
    pass


# The Arrow C data interface structs (arrow.apache.org/docs/format/CDataInterface.html).
_ArrowSchema._fields_ = [
    ("format", ctypes.c_char_p), ("name", ctypes.c_char_p), ("metadata", ctypes.c_char_p),
    ("flags", ctypes.c_int64), ("n_children", ctypes.c_int64),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowSchema))),
    ("dictionary", ctypes.c_void_p), ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]  # fmt: skip
_ArrowArray._fields_ = [
    ("length", ctypes.c_int64), ("null_count", ctypes.c_int64), ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64), ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p), ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]  # fmt: skip
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _arrow_view(image: Image.Image) -> tuple[np.ndarray[Any, Any], object] | None:
    """A uint8 view of Pillow's pixel buffer and the capsules that keep it alive.

    Returns None when Pillow cannot export the image in one piece (before
    Pillow 11.2, or an image larger than Pillow's 16 MiB allocation block).
    """
    export = getattr(image, "__arrow_c_array__", None)
    if export is None or sys.byteorder != "little":
        return None
    try:
        capsules = export()
    except ValueError:  # "Image rows are not contiguous in memory."
        return None
    schema_capsule, array_capsule = capsules
    schema = ctypes.cast(
        _capsule_pointer(schema_capsule, b"arrow_schema"), ctypes.POINTER(_ArrowSchema)
    ).contents
    array = ctypes.cast(
        _capsule_pointer(array_capsule, b"arrow_array"), ctypes.POINTER(_ArrowArray)
    ).contents
    if schema.n_children == 1 and schema.format == b"+w:4":
        child = array.children[0].contents
        address, nbytes = child.buffers[1], child.length
    elif schema.n_children == 0 and schema.format in _ARROW_ITEM_SIZES:
        address, nbytes = array.buffers[1], array.length * _ARROW_ITEM_SIZES[schema.format]
    else:
        return None
    if not address or array.offset != 0:
        return None
    view = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=np.uint8)
    return view, capsules


def _padded_chunks(
    pixels: np.ndarray[Any, Any], pad_bits: np.uint32 | None, keep: object
) -> Iterator[memoryview]:
    """Yield the pixel bytes with every pad bit set, in place when they already are.

    In place, the whole buffer goes to the hash in one update, which lets
    blake3 split a large image over both cores; otherwise it goes through an
    OR into a cache-sized scratch buffer, a chunk at a time.
    """
    # NOTE: for 3-band slots the pad is the top byte, so "all pads are 0xFF"
    # is exactly "the smallest slot is >= 0xFF000000".
    if pad_bits is None or (pad_bits == 0xFF000000 and pixels.view(np.uint32).min() >= pad_bits):
        yield pixels.data
    else:
        slots = pixels.view(np.uint32)
        scratch = np.empty(min(_CHUNK_PIXELS, slots.size), dtype=np.uint32)
        for start in range(0, slots.size, _CHUNK_PIXELS):
            part = slots[start : start + _CHUNK_PIXELS]
            out = scratch[: part.size]
            np.bitwise_or(part, pad_bits, out=out)
            yield out.view(np.uint8).data
    del keep  # the exported buffer may be released only now


def pixel_payload(image: Image.Image) -> tuple[int, Iterator[memoryview | bytes]]:
    """The size and the chunks of the canonical pixel bytes of a loaded ``image``."""
    mode = image.mode
    if mode in _SLOT_MODES:
        return 4 * image.width * image.height, _iter_slot_bytes(image)
    if mode == "1":
        packed = image.tobytes()
        return len(packed), iter((packed,))
    item_size = {"L": 1, "P": 1, "I": 4, "F": 4}.get(mode, 2)
    exported = _arrow_view(image)
    chunks = (
        iter((reference_pixel_bytes(image),))
        if exported is None
        else (_padded_chunks(exported[0], None, exported[1]))
    )
    return item_size * image.width * image.height, chunks


def _iter_slot_bytes(image: Image.Image) -> Iterator[memoryview | bytes]:
    exported = _arrow_view(image)
    if exported is not None:
        yield from _padded_chunks(exported[0], _PAD_BITS[_SLOT_MODES[image.mode]], exported[1])
    elif image.height > 1 and hasattr(image, "__arrow_c_array__"):
        # Too large for one export: hash horizontal strips, each exportable.
        rows = max(1, (_CHUNK_PIXELS * 8) // image.width)
        for top in range(0, image.height, rows):
            bottom = min(image.height, top + rows)
            yield from _iter_slot_bytes(image.crop((0, top, image.width, bottom)))
    else:
        yield reference_pixel_bytes(image)


def reference_pixel_bytes(image: Image.Image) -> bytes:
    """The canonical pixel bytes built from ``tobytes()``: slow, obviously right.

    Used where Pillow offers no Arrow export, and by the tests as the oracle
    for the fast path.
    """
    packed = image.tobytes()
    bands = _SLOT_MODES.get(image.mode)
    if bands is None or bands == 4:
        return packed
    values = np.frombuffer(packed, dtype=np.uint8).reshape(-1, bands)
    slots = np.full((values.shape[0], 4), 0xFF, dtype=np.uint8)
    if bands == 3:
        slots[:, :3] = values
        if image.mode == "LAB":
            slots[:, 1:3] ^= 0x80
    else:
        slots[:, 0], slots[:, 3] = values[:, 0], values[:, 1]
    return slots.tobytes()
