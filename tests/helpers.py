"""Helpers shared by test modules: block keys, slots, device configurations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from omnicache.block_hash import BlockHash


def key(i: int) -> BlockHash:
    """A distinct 32-byte block key for every ``i`` in ``[0, 2**32)``."""
    return BlockHash(i.to_bytes(4, "big") * 8)


def block_slots(block_ids: Sequence[int], block_size: int) -> list[int]:
    """Every slot of ``block_ids``, block by block, offsets in order."""
    return [b * block_size + o for b in block_ids for o in range(block_size)]


def cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, detached (for comparisons)."""
    return t.detach().to("cpu")


class DeviceConfig(NamedTuple):
    """Where a store keeps its tensors, and where the rows written come from."""

    name: str
    store_device: str
    source_device: str


DEVICE_CONFIGS = [DeviceConfig("cpu", "cpu", "cpu")]
if torch.cuda.is_available():
    DEVICE_CONFIGS += [
        DeviceConfig("cuda", "cuda", "cuda"),
        DeviceConfig("pinned-from-cuda", "cpu", "cuda"),
    ]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
