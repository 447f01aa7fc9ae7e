"""Golden vectors and the documented framing, byte for byte."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from vector_inputs import digest_of

import hashing

VECTORS = json.loads((Path(__file__).parent / "vectors" / "content_v1.json").read_text())


def test_vectors_cover_every_kind_for_every_algorithm() -> None:
    kinds = {(case["kind"], case["algorithm"]) for case in VECTORS["cases"]}
    expected_kinds = {"image_pil", "image_array", "audio", "video", "array", "bytes", "identifier"}
    assert kinds == {(k, a) for k in expected_kinds for a in hashing.ALGORITHMS}
    assert VECTORS["scheme"] == hashing.SCHEME == "omnicache.content/v1"


@pytest.mark.parametrize(
    "case", VECTORS["cases"], ids=[f"{c['name']}-{c['algorithm']}" for c in VECTORS["cases"]]
)
def test_golden_vector(case: dict[str, object]) -> None:
    digest = digest_of(case)
    assert isinstance(digest, hashing.ContentHash)
    assert digest.hex() == case["digest"]


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x01" + struct.pack("<Q", len(data)) + data


def test_identifier_framing_matches_the_documented_bytes() -> None:
    expected = hashlib.sha256(
        _str("omnicache.content/v1") + _str("identifier")
        + _str("namespace") + _str("tenant-a")
        + _str("identifier") + _str("img-0001")
    ).digest()  # fmt: skip
    assert hashing.hash_identifier("img-0001", namespace="tenant-a", algorithm="sha256") == expected


def test_array_framing_matches_the_documented_bytes() -> None:
    array = np.array([[1, -2], [300, 4]], dtype=np.int16)
    payload = array.tobytes()
    int_2 = b"\x02" + struct.pack("<Q", 1) + b"\x02"
    expected = hashlib.sha256(
        _str("omnicache.content/v1") + _str("array")
        + _str("dtype") + _str("int16")
        + _str("shape") + b"\x08" + struct.pack("<Q", 2) + int_2 + int_2
        + _str("data") + b"\x09" + struct.pack("<Q", len(payload))
        + hashlib.sha256(payload).digest()
        + _str("context") + b"\x07" + struct.pack("<Q", 0)
    ).digest()  # fmt: skip
    assert hashing.hash_array(array, algorithm="sha256") == expected
