"""Block-key throughput: omnicache's BlockHasher against vLLM 0.33's block hashing.

Workload: a 32768-token prompt (ids from a seeded RNG) with 8 images of 1024
placeholder tokens each at unaligned offsets, block size 16 (2048 blocks, 520
of them touching an image). Every row keys the whole prompt, in one run, side
by side; the ratio is the vLLM default row's median time over the row's.

Rows:
  omnicache <alg>, from list      AnnotatedTokens(list, annotations) + hash_blocks
  omnicache <alg>, pre-packed     hash_blocks on an AnnotatedTokens built beforehand
  vLLM default (re-impl)          sha256(pickle((parent, tuple(tokens), extra_keys)))
                                  with ("mm", identifier_hex, offset) extra keys
                                  generated per block as vLLM 0.33 does
  vLLM sha256_cbor (re-impl)      the same with canonical cbor2 (when importable)
  vLLM xxhash (re-impl)           xxh3_128 over the same pickle
  vLLM own request block hasher   vllm.v1.core.kv_cache_utils (when importable)
  decode rows                     one new block after the prompt

Usage:
  .venv/bin/python benchmarks/bench_block_hash.py            # omnicache + re-implementations
  .venv-vllm/bin/python benchmarks/bench_block_hash.py       # adds vLLM's own code
  ... --repeat 31 --storage                                  # more repeats; storage table
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import operator
import os
import pickle
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import blake3
import xxhash

from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import DEFAULT_BLOCK_ALGORITHM, BlockHash, BlockHasher

NUM_TOKENS = 32768
BLOCK_SIZE = 16
NUM_IMAGES = 8
IMAGE_TOKENS = 1024
PLACEHOLDER_ID = 151655
VOCAB = 150000
NUM_DECODE_BLOCKS = 256

TARGET_DEFAULT = 2.0
TARGET_XXH3 = 4.0
TARGET_DECODE_US = 2.0

Prompt = tuple[list[int], list[TokenRangeAnnotation], list[tuple[str, int, int]]]


def make_prompt() -> Prompt:
    """Token ids, omnicache annotations and vLLM-style (identifier, offset, length) items."""
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(NUM_TOKENS)]
    annotations = []
    items = []
    for k in range(NUM_IMAGES):
        offset = 1000 + k * 3901
        ids[offset : offset + IMAGE_TOKENS] = [PLACEHOLDER_ID] * IMAGE_TOKENS
        digest = blake3.blake3(f"image-{k}".encode()).digest()
        annotations.append(TokenRangeAnnotation(offset, IMAGE_TOKENS, digest, 0, IMAGE_TOKENS))
        items.append((digest.hex(), offset, IMAGE_TOKENS))
    return ids, annotations, items


# --- vLLM 0.33's default key, re-implemented ---------------------------------------
# key = hash_fn((parent or NONE_HASH, tuple(block_tokens), extra_keys)), where
# extra_keys holds ("mm", identifier, item_offset - block_start) for every item
# overlapping the block (None when there is none), computed per block by walking
# the sorted items from the first one the previous block had not finished.


def _vllm_sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _vllm_xxhash(obj: object) -> bytes:
    return bytes(xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))


def _mm_extra_keys(
    items: Sequence[tuple[str, int, int]], start: int, end: int, item_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    keys: list[tuple[str, str, int]] = []
    if not items:
        return None, item_idx
    _, last_offset, last_length = items[-1]
    if last_offset + last_length <= start:
        return None, item_idx
    while item_idx < len(items):
        identifier, offset, length = items[item_idx]
        if end <= offset:
            break
        if start >= offset + length:
            item_idx += 1
            continue
        keys.append(("mm", identifier, offset - start))
        if end >= offset + length:
            item_idx += 1
        else:
            break
    return (tuple(keys) if keys else None), item_idx


def vllm_chain(
    hash_fn: Callable[[object], bytes], none_hash: bytes
) -> Callable[[list[int], Sequence[tuple[str, int, int]]], list[bytes]]:
    def chain(ids: list[int], items: Sequence[tuple[str, int, int]]) -> list[bytes]:
        keys: list[bytes] = []
        parent: bytes | None = None
        item_idx = 0
        for start in range(0, len(ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            end = start + BLOCK_SIZE
            extra, item_idx = _mm_extra_keys(items, start, end, item_idx)
            parent = hash_fn((parent or none_hash, tuple(ids[start:end]), extra))
            keys.append(parent)
        return keys

    return chain


# --- vLLM's own code, when importable -----------------------------------------------


def vllm_own_rows(
    ids: list[int], items: list[tuple[str, int, int]]
) -> dict[str, Callable[[], Any]]:
    """Callables that run vLLM 0.33's own block hashing, or {} with a note."""
    try:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256 as vllm_sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request
    except ImportError as exc:
        print(f"vLLM not importable ({exc.__class__.__name__}: {exc}); skipping its own rows")
        return {}
    kv_cache_utils.init_none_hash(vllm_sha256)
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=offset, length=length),
            mm_hash=identifier,
        )
        for identifier, offset, length in items
    ]
    request = Request(
        request_id="bench",
        prompt_token_ids=list(ids),
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        mm_features=features,
    )
    request_hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, vllm_sha256)
    hash_block_tokens = kv_cache_utils.hash_block_tokens

    def own_hash_block_tokens() -> list[bytes]:
        keys: list[bytes] = []
        parent = None
        item_idx = 0
        for start in range(0, len(ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            end = start + BLOCK_SIZE
            extra, item_idx = _mm_extra_keys(items, start, end, item_idx)
            parent = hash_block_tokens(vllm_sha256, parent, ids[start:end], extra)
            keys.append(parent)
        return keys

    own_keys = request_hasher(request)
    if own_keys != own_hash_block_tokens():
        raise RuntimeError("vLLM's request block hasher and hash_block_tokens chain disagree")
    reimpl = vllm_chain(_vllm_sha256, kv_cache_utils.NONE_HASH)(ids, items)
    if own_keys != reimpl:
        raise RuntimeError("the re-implementation of vLLM's default key is not faithful")
    print("vLLM 0.33 importable: its own keys equal the re-implementation's (checked)")
    return {
        "vLLM own: request block hasher (sha256)": lambda: request_hasher(request),
        "vLLM own: hash_block_tokens chain (sha256)": own_hash_block_tokens,
    }


# --- timing ---------------------------------------------------------------------------


def median_seconds(rows: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median wall time per row; rows are interleaved so drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(2):
        for fn in rows.values():
            fn()
    for _ in range(repeat):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) for name, values in samples.items()}


def decode_costs(
    hasher: BlockHasher, prompt: AnnotatedTokens, keys: list[BlockHash], repeat: int
) -> tuple[float, float]:
    """(µs for the hash_new_blocks call that completes a block, µs per block of whole steps).

    A decode loop appends one token a step and asks for new keys; every
    BLOCK_SIZE-th step completes a block.
    """
    rng = random.Random(1)
    new_block_us: list[float] = []
    per_block_us: list[float] = []
    for _ in range(repeat):
        tokens = AnnotatedTokens(prompt.tolist(), prompt.annotations)  # a fresh longest view
        done = list(keys)
        step_ids = [rng.randrange(VOCAB) for _ in range(NUM_DECODE_BLOCKS * BLOCK_SIZE)]
        completing = 0.0
        t_all = time.perf_counter()
        for token_id in step_ids:
            tokens += (token_id,)
            t0 = time.perf_counter()
            new = hasher.hash_new_blocks(tokens, done)
            if new:
                completing += time.perf_counter() - t0
                done += new
        total = time.perf_counter() - t_all
        if len(done) != len(keys) + NUM_DECODE_BLOCKS:
            raise RuntimeError("decode loop keyed the wrong number of blocks")
        new_block_us.append(completing / NUM_DECODE_BLOCKS * 1e6)
        per_block_us.append(total / NUM_DECODE_BLOCKS * 1e6)
    return statistics.median(new_block_us), statistics.median(per_block_us)


def vllm_decode_us(repeat: int) -> float:
    """µs per new block for vLLM's default key after the prompt (no items overlap)."""
    rng = random.Random(2)
    none_hash = _vllm_sha256("vllm-none-hash")
    ids = [rng.randrange(VOCAB) for _ in range(NUM_DECODE_BLOCKS * BLOCK_SIZE)]
    items = [("0" * 64, 0, 16)]
    chain = vllm_chain(_vllm_sha256, none_hash)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        chain(ids, items)
        times.append((time.perf_counter() - t0) / NUM_DECODE_BLOCKS * 1e6)
    return statistics.median(times)


def per_call_us(repeat: int) -> dict[str, float]:
    """One digest of a 100-byte input, as the block loop makes it."""
    data = os.urandom(100)
    number = 20000
    fns: dict[str, Callable[[], Any]] = {
        "sha256 (hashlib, OpenSSL)": lambda: hashlib.sha256(data).digest(),
        "blake3 (blake3-py)": lambda: blake3.blake3(data).digest(),
        "xxh3_128 (xxh3_128_digest)": lambda: xxhash.xxh3_128_digest(data),
        "empty call (loop overhead)": lambda: None,
    }
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            out[name].append((time.perf_counter() - t0) / number * 1e6)
    return {name: statistics.median(v) for name, v in out.items()}


def storage_table(ids: list[int], repeat: int) -> None:
    """Why AnnotatedTokens packs ids into array('I'): build, append, per-block bytes."""
    import struct

    import numpy as np

    as_u32 = array("I", ids)
    packed_block = struct.Struct(f"<{BLOCK_SIZE}I").pack
    kinds: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], Any]]] = {
        "array('I')": (
            lambda: array("I", ids),
            lambda a: a + array("I", (7,)),
            lambda a: a[160:176].tobytes(),
        ),
        "array('i')": (
            lambda: array("i", ids),
            lambda a: a + array("i", (7,)),
            lambda a: a[160:176].tobytes(),
        ),
        "array('l')": (
            lambda: array("l", ids),
            lambda a: a + array("l", (7,)),
            lambda a: array("I", a[160:176]).tobytes(),
        ),
        "numpy uint32": (
            lambda: np.array(ids, dtype=np.uint32),
            lambda a: np.append(a, np.uint32(7)),
            lambda a: a[160:176].tobytes(),
        ),
        "tuple": (
            lambda: tuple(ids),
            lambda a: operator.concat(a, (7,)),
            lambda a: packed_block(*a[160:176]),
        ),
    }
    print()
    print(f"Token storage, {len(ids)} ids ({as_u32.itemsize * len(ids)} bytes as uint32)")
    print(f"{'storage':<14} {'from list ms':>12} {'copy+append µs':>15} {'block bytes µs':>15}")
    for name, (build, append, block) in kinds.items():
        built = build()
        b_ms = _best(build, 5, repeat) * 1e3
        a_us = _best(partial(append, built), 200, repeat) * 1e6
        k_us = _best(partial(block, built), 20000, repeat) * 1e6
        print(f"{name:<14} {b_ms:>12.3f} {a_us:>15.2f} {k_us:>15.3f}")


def _best(fn: Callable[[], Any], number: int, repeat: int) -> float:
    times = []
    for _ in range(max(3, repeat // 3)):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def from_list(
    hasher: BlockHasher, ids: list[int], annotations: list[TokenRangeAnnotation]
) -> list[BlockHash]:
    return hasher.hash_blocks(AnnotatedTokens(ids, annotations))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per row (median)")
    parser.add_argument("--storage", action="store_true", help="also print the storage table")
    args = parser.parse_args()
    repeat: int = args.repeat

    ids, annotations, items = make_prompt()
    num_blocks = NUM_TOKENS // BLOCK_SIZE
    none_hash = _vllm_sha256("vllm-none-hash")

    rows: dict[str, Callable[[], Any]] = {}
    reimpl_default = "vLLM default: sha256(pickle) (re-impl)"
    rows[reimpl_default] = lambda: vllm_chain(_vllm_sha256, none_hash)(ids, items)
    try:
        cbor2: Any = importlib.import_module("cbor2")

        def _vllm_sha256_cbor(obj: object) -> bytes:
            return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

        cbor_chain = vllm_chain(_vllm_sha256_cbor, _vllm_sha256_cbor("vllm-none-hash"))
        rows["vLLM sha256_cbor (re-impl)"] = lambda: cbor_chain(ids, items)
        cbor_note = ""
    except ImportError:
        cbor_note = "vLLM sha256_cbor (re-impl): cbor2 not importable"
    xx_none = _vllm_xxhash("vllm-none-hash")
    rows["vLLM xxhash: xxh3_128(pickle) (re-impl)"] = lambda: vllm_chain(_vllm_xxhash, xx_none)(
        ids, items
    )
    rows.update(vllm_own_rows(ids, items))
    own_note = (
        ""
        if any(name.startswith("vLLM own") for name in rows)
        else ("vLLM own hash_block_tokens / request block hasher: vLLM not importable")
    )

    hashers = {
        alg: BlockHasher(BLOCK_SIZE, algorithm=alg) for alg in ("sha256", "blake3", "xxh3_128")
    }
    prepacked = AnnotatedTokens(ids, annotations)
    for alg, hasher in hashers.items():
        tag = f"{alg}{' (default)' if alg == DEFAULT_BLOCK_ALGORITHM else ''}"
        rows[f"omnicache {tag}, from list"] = partial(from_list, hasher, ids, annotations)
    for alg, hasher in hashers.items():
        rows[f"omnicache {alg}, pre-packed tokens"] = partial(hasher.hash_blocks, prepacked)

    for hasher in hashers.values():
        if len(hasher.hash_blocks(prepacked)) != num_blocks:
            raise RuntimeError("wrong number of keys")

    medians = median_seconds(rows, repeat)
    base = medians[reimpl_default]
    default = hashers[DEFAULT_BLOCK_ALGORITHM]
    keys = default.hash_blocks(prepacked)
    new_block_us, step_us = decode_costs(default, prepacked, keys, max(3, repeat // 3))
    vllm_block_us = vllm_decode_us(max(3, repeat // 3))

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"Block keys: {NUM_TOKENS} tokens, {NUM_IMAGES} images x {IMAGE_TOKENS} tokens, "
        f"block {BLOCK_SIZE} ({num_blocks} blocks); median of {repeat} interleaved runs; "
        f"load average {load} on {os.cpu_count()} CPUs"
    )
    width = 48
    print(f"{'variant':<{width}} {'tokens/s':>10} {'µs/block':>9} {'vs vLLM default':>16}")
    for name, seconds in medians.items():
        tokens_per_s = NUM_TOKENS / seconds / 1e6
        us_per_block = seconds / num_blocks * 1e6
        print(
            f"{name:<{width}} {tokens_per_s:>9.1f}M {us_per_block:>9.3f} {base / seconds:>15.2f}x"
        )
    for note in (cbor_note, own_note):
        if note:
            print(f"{note}")
    print(
        f"{'decode, vLLM default (re-impl): one new block':<{width}} {'':>10} "
        f"{vllm_block_us:>9.3f} {1.0:>15.2f}x"
    )
    print(
        f"{'decode, omnicache default: hash_new_blocks':<{width}} {'':>10} "
        f"{new_block_us:>9.3f} {vllm_block_us / new_block_us:>15.2f}x"
    )
    print(
        f"{'decode, omnicache: 16 x (append + hash_new)':<{width}} {'':>10} "
        f"{step_us:>9.3f} {vllm_block_us / step_us:>15.2f}x"
    )

    print()
    print("Per-call digest cost on a 100-byte input (block preimage size), µs")
    for name, us in per_call_us(max(3, repeat // 3)).items():
        print(f"  {name:<30} {us:.3f}")

    default_ratio = base / medians[f"omnicache {DEFAULT_BLOCK_ALGORITHM} (default), from list"]
    xxh3_ratio = base / medians["omnicache xxh3_128, from list"]
    print()
    print("Targets (from a Python list of ids):")
    print(
        f"  default >= {TARGET_DEFAULT}x vLLM default: {default_ratio:.2f}x "
        f"{'met' if default_ratio >= TARGET_DEFAULT else 'MISSED'}"
    )
    print(
        f"  xxh3_128 >= {TARGET_XXH3}x vLLM default: {xxh3_ratio:.2f}x "
        f"{'met' if xxh3_ratio >= TARGET_XXH3 else 'MISSED'}"
    )
    print(
        f"  decode append <= {TARGET_DECODE_US} µs per new block: {new_block_us:.2f} µs "
        f"{'met' if new_block_us <= TARGET_DECODE_US else 'MISSED'}"
    )

    if args.storage:
        storage_table(ids, repeat)


if __name__ == "__main__":
    main()
