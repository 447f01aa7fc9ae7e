"""Inputs of the content golden vectors, rebuilt from their JSON description.

Shared by scripts/make_content_vectors.py (which writes
tests/vectors/content_v1.json once) and tests/test_content_vectors.py (which
checks every digest against it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

import hashing


def _array(spec: dict[str, Any]) -> Any:
    data = bytes.fromhex(spec["data"])
    if spec["dtype"] == "bfloat16":
        import torch

        return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(spec["shape"])
    return np.frombuffer(data, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])


def _pil(spec: dict[str, Any]) -> Image.Image:
    image = Image.frombytes(spec["mode"], tuple(spec["size"]), bytes.fromhex(spec["data"]))
    if "palette" in spec:
        mode, data = spec["palette"]
        image.putpalette(bytes.fromhex(data), mode)
    return image


def digest_of(case: dict[str, Any]) -> hashing.ContentHash:
    """Recompute the digest a golden-vector case describes."""
    kind, spec, algorithm = case["kind"], case["input"], case["algorithm"]
    context = spec.get("context")
    if kind == "image_pil":
        return hashing.hash_image(_pil(spec), algorithm=algorithm, context=context)
    if kind == "image_array":
        return hashing.hash_image(_array(spec), algorithm=algorithm, context=context)
    if kind == "audio":
        return hashing.hash_audio(
            _array(spec), spec["sample_rate"], algorithm=algorithm, context=context
        )
    if kind == "video":
        return hashing.hash_video(
            _array(spec), fps=spec["fps"], algorithm=algorithm, context=context
        )
    if kind == "array":
        return hashing.hash_array(_array(spec), algorithm=algorithm, context=context)
    if kind == "bytes":
        return hashing.hash_bytes(
            bytes.fromhex(spec["data"]),
            modality=spec["modality"],
            algorithm=algorithm,
            context=context,
        )
    if kind == "identifier":
        return hashing.hash_identifier(
            spec["identifier"], namespace=spec["namespace"], algorithm=algorithm
        )
    raise ValueError(f"unknown golden-vector kind {kind!r}")
