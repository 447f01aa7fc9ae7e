"""Inputs of the identity golden vectors: one per form, each a function of the algorithm.

Shared by scripts/make_identity_vectors.py (which writes
tests/vectors/identity_v1.json once) and tests/test_identity.py (which checks
every identity against it).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from omnicache.identity import item_identity, tenant_identifier


def _ramp(n: int, mul: int = 37, add: int = 11) -> bytes:
    return bytes((i * mul + add) % 256 for i in range(n))


def _array(shape: tuple[int, ...], dtype: str = "uint8") -> Any:
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(_ramp(count), dtype=dtype).reshape(shape)


def _picture() -> Image.Image:
    return Image.frombytes("RGB", (3, 2), _ramp(18))


def _png() -> bytes:
    buffer = io.BytesIO()
    _picture().save(buffer, "PNG")
    return buffer.getvalue()


_METADATA = {
    "total_num_frames": 2,
    "fps": 2.5,
    "duration": 0.8,
    "video_backend": "opencv",
    "frames_indices": [0, 1],
    "do_sample_frames": False,
}


def _identity(item_fn: Callable[[], object], modality: str, **kwargs: Any) -> Callable[[str], str]:
    return lambda algorithm: item_identity(
        item_fn(),
        modality=modality,
        algorithm=algorithm,
        **kwargs,  # type: ignore[arg-type]
    ).hex()


def _embeddings() -> object:
    import torch

    return torch.from_numpy(_array((2, 3), "float32").copy())


CASES: dict[str, Callable[[str], str]] = {
    "picture_rgb_3x2": _identity(_picture, "image"),
    "picture_rgba_2x2_over_white": _identity(
        lambda: Image.frombytes("RGBA", (2, 2), _ramp(16)), "image"
    ),
    "picture_png_bytes": _identity(_png, "image"),
    "picture_context": _identity(_picture, "image", context={"model": "org/model-7b"}),
    "array_uint8_2x2x3": _identity(lambda: _array((2, 2, 3)), "image"),
    "embeddings_float32_2x3": _identity(_embeddings, "image", form="embeddings"),
    "samples_float32_at_16k": _identity(lambda: (_array((4,), "float32"), 16_000), "audio"),
    "samples_float32_no_rate": _identity(lambda: _array((4,), "float32"), "audio"),
    "frames_with_metadata": _identity(lambda: (_array((2, 2, 2, 3)), _METADATA), "video"),
    "frames_as_pictures": _identity(
        lambda: [Image.frombytes("RGB", (2, 2), _ramp(12, add=i)) for i in range(2)], "video"
    ),
    "tenant_identifier": lambda algorithm: tenant_identifier(
        CASES["picture_rgb_3x2"](algorithm),
        cache_salt="tenant-a",
        algorithm=algorithm,  # type: ignore[arg-type]
    ),
}
