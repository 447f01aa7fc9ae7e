"""Write (or check) the golden vectors of block keys: tests/vectors/block_v1.json.

Each case holds a hasher configuration, token ids and annotations, the exact
preimage of the root and of every block (hex), and the keys. The preimages are
built here from the layout in omnicache/block_hash.py's docstring, separately
from BlockHasher, and each key must equal the digest of its preimage, so the
file pins both the bytes and the keys.

Usage:
  .venv/bin/python scripts/make_block_vectors.py          # rewrite the file
  .venv/bin/python scripts/make_block_vectors.py --check  # exit 1 if it would change
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import blake3
import xxhash

from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import SCHEME, BlockHasher, block_hash_low64

OUT = Path(__file__).resolve().parent.parent / "tests" / "vectors" / "block_v1.json"

IMAGE = hashlib.sha256(b"omnicache test image").digest()
AUDIO = hashlib.sha256(b"omnicache test audio").digest()
SHORT = bytes(range(16))  # a 16-byte (xxh3_128-sized) content hash


def digest(algorithm: str, data: bytes) -> bytes:
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()
    if algorithm == "blake3":
        return bytes(blake3.blake3(data).digest())
    if algorithm == "xxh3_128":
        return bytes(xxhash.xxh3_128_digest(data))
    raise ValueError(algorithm)


def field(tag: int, value: str | int | None) -> bytes:
    if value is None:
        return struct.pack("<BBI", tag, 0, 0)
    if isinstance(value, str):
        payload = value.encode("utf-8")
        return struct.pack("<BBI", tag, 1, len(payload)) + payload
    return struct.pack("<BBIQ", tag, 2, 8, value)


def root_preimage(config: dict[str, Any]) -> bytes:
    return (
        field(1, SCHEME)
        + field(2, config["algorithm"])
        + field(3, config["namespace"])
        + field(4, config["cache_salt"])
        + field(5, config["adapter"])
        + field(6, config["block_size"])
    )


def block_preimage(
    parent: bytes, token_ids: tuple[int, ...], annotations: tuple[TokenRangeAnnotation, ...]
) -> bytes:
    out = parent + struct.pack(f"<{len(token_ids)}I", *token_ids)
    for ann in annotations:
        out += struct.pack(
            "<5I",
            ann.token_index,
            ann.token_count,
            ann.content_offset,
            ann.content_length,
            len(ann.content_hash),
        )
        out += ann.content_hash
    return out


def case(
    name: str,
    token_ids: list[int],
    annotations: list[TokenRangeAnnotation],
    *,
    block_size: int,
    algorithm: str = "sha256",
    namespace: str = "",
    cache_salt: str | None = None,
    adapter: str | None = None,
) -> dict[str, Any]:
    config = {
        "block_size": block_size,
        "algorithm": algorithm,
        "namespace": namespace,
        "cache_salt": cache_salt,
        "adapter": adapter,
    }
    hasher = BlockHasher(
        block_size,
        algorithm=algorithm,  # type: ignore[arg-type]
        namespace=namespace,
        cache_salt=cache_salt,
        adapter=adapter,
    )
    tokens = AnnotatedTokens(token_ids, annotations)
    keys = hasher.hash_blocks(tokens)
    root_bytes = root_preimage(config)
    if digest(algorithm, root_bytes) != hasher.root:
        raise SystemExit(f"{name}: BlockHasher.root is not the digest of the documented bytes")
    parent = hasher.root
    blocks = []
    for block, key in zip(tokens.blocks(block_size), keys, strict=True):
        preimage = block_preimage(parent, block.token_ids, block.annotations)
        if digest(algorithm, preimage) != key:
            raise SystemExit(f"{name}: a key is not the digest of the documented bytes")
        blocks.append({"preimage": preimage.hex(), "key": key.hex()})
        parent = key
    return {
        "name": name,
        "config": config,
        "token_ids": token_ids,
        "annotations": [
            {
                "token_index": a.token_index,
                "token_count": a.token_count,
                "content_hash": a.content_hash.hex(),
                "content_offset": a.content_offset,
                "content_length": a.content_length,
            }
            for a in annotations
        ],
        "root_preimage": root_bytes.hex(),
        "root": hasher.root.hex(),
        "blocks": blocks,
        "last_key_low64": block_hash_low64(keys[-1]) if keys else None,
    }


def build() -> dict[str, Any]:
    T = TokenRangeAnnotation
    text = [101, 7592, 1010, 2088, 999, 3, 65535, 65536, 0, 42]
    # 4 text tokens, an 8-token image (placeholder 9), 2 text, a 5-token audio clip
    # (placeholder 8) whose last 3 positions fall in the trailing partial block.
    mixed = [1, 2, 3, 4, *[9] * 8, 5, 6, *[8] * 5]
    mixed_anns = [T(4, 8, IMAGE, 0, 8), T(14, 5, AUDIO, 0, 5)]
    cases = [
        case("text only, defaults", text, [], block_size=4),
        case(
            "image and audio, salted, namespaced",
            mixed,
            mixed_anns,
            block_size=4,
            namespace="llava-hf/llava-1.5-7b-hf",
            cache_salt="tenant-a",
        ),
        case(
            "image and audio, blake3",
            mixed,
            mixed_anns,
            block_size=4,
            algorithm="blake3",
            namespace="llava-hf/llava-1.5-7b-hf",
            cache_salt="tenant-a",
        ),
        case(
            "image and audio, xxh3_128, 16-byte content hash",
            mixed,
            [T(4, 8, SHORT, 0, 8), T(14, 5, AUDIO, 0, 5)],
            block_size=4,
            algorithm="xxh3_128",
        ),
        case("empty salt (not None)", text, [], block_size=4, cache_salt=""),
        case("adapter equal to a salt string", text, [], block_size=4, adapter="tenant-a"),
        case(
            "two items in one block, partial item, block 16, largest id",
            [4294967295, *[9] * 6, *[8] * 3, 5, *[9] * 5, 6, 6],
            [T(1, 6, IMAGE, 2, 12), T(7, 3, AUDIO, 0, 3), T(11, 5, IMAGE, 0, 5)],
            block_size=16,
            namespace="модель/ü",
        ),
    ]
    return {
        "scheme": SCHEME,
        "note": "Generated by scripts/make_block_vectors.py; layout in omnicache/block_hash.py.",
        "cases": cases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = json.dumps(build(), indent=1, ensure_ascii=False) + "\n"
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: rerun scripts/make_block_vectors.py", file=sys.stderr)
            raise SystemExit(1)
        print(f"{OUT} is up to date")
        return
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
