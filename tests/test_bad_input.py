"""Bad input across the public API: the exact error, and nothing changed.

Every case runs against a fresh `World`: a block pool with cached, free and
in-use blocks and pending events, a prefix cache with one finished and one
active request, and a tensor store attached to the pool holding stamped rows
and staged rows. Each case asserts the exact exception type (not a subclass),
a fragment of its message, and that a snapshot of the whole world (free queue
order, hash table, reference counts, events, requests, store tensors' bytes,
stamps, fill counts, staged rows and counters) is unchanged afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from PIL import Image
from store_helpers import Snapshot as StoreSnapshot
from store_helpers import snapshot as store_snapshot

from hashing import (
    ContentHash,
    hash_audio,
    hash_bytes,
    hash_content,
    hash_identifier,
    hash_image,
    hash_video,
)
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher, block_hash_hex, block_hash_low64
from omnicache.preprocess import annotate_prompt
from omnicache.reference.block_pool import BlockPool, CacheBlock
from omnicache.reference.prefix_cache import PrefixCache
from omnicache.store import ScheduledRequest, StaleCommitError, StoreCapacityError, TensorStore

BS = 4
NUM_BLOCKS = 8
IMG = 9_000
RED = Image.new("RGB", (4, 4), (255, 0, 0))
WAVE = np.linspace(-1, 1, 64, dtype=np.float32)
H = b"h" * 32


@dataclass
class World:
    pool: BlockPool
    hasher: BlockHasher
    cache: PrefixCache
    store: TensorStore
    done: AnnotatedTokens
    live: AnnotatedTokens

    @property
    def live_blocks(self) -> list[CacheBlock]:
        return [self.pool.blocks[i] for i in self.cache.block_ids("live")]

    @property
    def free_uncached(self) -> CacheBlock:
        return next(b for b in self.pool.free_block_queue if b.block_hash is None)

    @property
    def free_cached(self) -> CacheBlock:
        return next(b for b in self.pool.free_block_queue if b.block_hash is not None)


def rows(n: int, dim: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    values = torch.arange(n * dim, dtype=torch.float64).view(n, dim) + 100 * seed
    return values.to(dtype)


def slots(block_ids: tuple[int, ...] | list[int], num_tokens: int) -> list[int]:
    return [block_ids[i // BS] * BS + i % BS for i in range(num_tokens)]


def build_world() -> World:
    pool = BlockPool(NUM_BLOCKS, BS)
    hasher = BlockHasher(BS)
    cache = PrefixCache(pool, hasher)
    store = TensorStore(NUM_BLOCKS, BS, max_bytes=4096)
    store.register("h", 3, torch.float32)
    store.register("codes", 2, torch.int64, deferred=True)
    store.attach(pool)
    # "done": 13 tokens, 3 full blocks cached, then freed.
    done = annotate_prompt([1, 2, 3] + [IMG] * 6 + [4, 5, 6, 7], [RED], placeholder_token_id=IMG)
    admitted = cache.add_request("done", done)
    assert admitted is not None
    keys = dict(zip(admitted.block_ids, cache.block_hashes("done"), strict=False))
    store.write("h", rows(13), slots(admitted.block_ids, 13), block_keys=keys)
    cache.mark_computed("done", 13)
    cache.free("done")
    # "live": 10 tokens, 8 computed and registered, 2 more staged.
    live = annotate_prompt([8] * 2 + [IMG] * 5 + [9] * 3, ["clip-1"], placeholder_token_id=IMG)
    admitted = cache.add_request("live", live)
    assert admitted is not None
    keys = dict(zip(admitted.block_ids, cache.block_hashes("live"), strict=False))
    store.write("h", rows(8, seed=1), slots(admitted.block_ids, 8), block_keys=keys)
    store.stage("live", "codes", rows(10, 2, torch.int64), token_start=0)
    cache.mark_computed("live", 8)
    world = World(pool, hasher, cache, store, done, live)
    assert [b.block_id for b in pool.free_block_queue] == [6, 7, 2, 1, 0]
    assert pool.num_cached_blocks == 5
    assert len(pool._events) == 2
    return world


class Snapshot(NamedTuple):
    free_queue: list[int]
    table: dict[bytes, int]
    blocks: list[tuple[int, bytes | None]]
    num_evictions: int
    events: list[object]
    num_listeners: int
    requests: dict[str, tuple[object, ...]]
    cache_stats: object
    prompts: tuple[object, ...]
    # Length of the token buffers the prompts share with their extensions.
    buffer_lengths: tuple[int, ...]
    # Rows, stamps, fill counts, entries, counters and staged rows.
    store: StoreSnapshot


def snapshot(world: World) -> Snapshot:
    pool, cache, store = world.pool, world.cache, world.store
    return Snapshot(
        free_queue=[b.block_id for b in pool.free_block_queue],
        table={k: b.block_id for k, b in pool.hash_to_block.items()},
        blocks=[(b.ref_cnt, b.block_hash) for b in pool.blocks],
        num_evictions=pool.num_evictions,
        events=list(pool._events),
        num_listeners=len(pool._eviction_listeners),
        requests={
            rid: (
                r.tokens.tolist(),
                r.tokens.annotations,
                [b.block_id for b in r.blocks],
                list(r.block_hashes),
                r.num_cached_blocks,
                r.num_computed_tokens,
            )
            for rid, r in cache._requests.items()
        },
        cache_stats=cache.stats(),
        prompts=tuple((p.tolist(), p.annotations) for p in (world.done, world.live)),
        buffer_lengths=tuple(len(p._buf) for p in (world.done, world.live)),
        store=store_snapshot(store),
    )


class Case(NamedTuple):
    id: str
    call: Callable[[World], object]
    error: type[BaseException]
    fragment: str


def _tokens(n: int = 8) -> AnnotatedTokens:
    return AnnotatedTokens(list(range(n)))


def _ann(*fields: Any) -> TokenRangeAnnotation:
    return TokenRangeAnnotation(*fields)


CASES: list[Case] = [
    # -- hashing ----------------------------------------------------------------
    Case(
        "image-wrong-type",
        lambda w: hash_image("red.png"),
        TypeError,
        "image: expected a PIL.Image.Image, a uint8 numpy.ndarray or a uint8 torch.Tensor, "
        "found str",
    ),
    Case(
        "image-float-array",
        lambda w: hash_image(np.zeros((2, 2), np.float32)),
        TypeError,
        "image: expected uint8 pixel values, found float32",
    ),
    Case(
        "image-five-channels",
        lambda w: hash_image(np.zeros((2, 2, 5), np.uint8)),
        ValueError,
        "with 1 to 4 channels last, found shape (2, 2, 5)",
    ),
    Case(
        "image-empty-array",
        lambda w: hash_image(np.zeros((0, 2, 3), np.uint8)),
        ValueError,
        "image: expected a non-empty image, found shape (0, 2, 3)",
    ),
    Case(
        "image-empty-pil",
        lambda w: hash_image(Image.new("RGB", (0, 3))),
        ValueError,
        "image: expected a non-empty image, found size 0x3",
    ),
    Case(
        "image-unknown-algorithm",
        lambda w: hash_image(RED, algorithm="md5"),  # type: ignore[arg-type]
        ValueError,
        "algorithm: expected one of blake3, sha256, xxh3_128, found 'md5'",
    ),
    Case(
        "context-int-key",
        lambda w: hash_image(RED, context={1: 2}),  # type: ignore[dict-item]
        TypeError,
        "context: expected str keys, found int key 1",
    ),
    Case(
        "context-object-value",
        lambda w: hash_image(RED, context={"a": {"b": object()}}),
        TypeError,
        "context['a']['b']: expected str, int, float, bool, bytes, None, a mapping",
    ),
    Case(
        "audio-zero-rate",
        lambda w: hash_audio(WAVE, 0),
        ValueError,
        "sample_rate: expected a positive int, found 0",
    ),
    Case(
        "audio-float-rate",
        lambda w: hash_audio(WAVE, 16000.0),  # type: ignore[arg-type]
        ValueError,
        "sample_rate: expected a positive int, found float 16000.0",
    ),
    Case(
        "audio-3d",
        lambda w: hash_audio(np.zeros((2, 2, 2), np.float32), 8000),
        ValueError,
        "waveform: expected shape (samples,) or (channels, samples), found shape (2, 2, 2)",
    ),
    Case(
        "audio-empty",
        lambda w: hash_audio(np.zeros(0, np.float32), 8000),
        ValueError,
        "waveform: expected a non-empty clip, found shape (0,)",
    ),
    Case(
        "audio-str-dtype",
        lambda w: hash_audio(np.array(["a"]), 8000),
        TypeError,
        "waveform: expected a numeric dtype",
    ),
    Case(
        "video-no-frames",
        lambda w: hash_video([]),
        ValueError,
        "frames: expected at least one frame, found 0",
    ),
    Case(
        "video-nan-fps",
        lambda w: hash_video([RED], fps=float("nan")),
        ValueError,
        "fps: expected a finite positive number or None, found nan",
    ),
    Case(
        "bytes-empty",
        lambda w: hash_bytes(b"", modality="image"),
        ValueError,
        "data: expected non-empty bytes, found 0 bytes",
    ),
    Case(
        "bytes-str",
        lambda w: hash_bytes("abc", modality="image"),  # type: ignore[arg-type]
        TypeError,
        "data: expected bytes, bytearray or memoryview, found str",
    ),
    Case(
        "bytes-empty-modality",
        lambda w: hash_bytes(b"x", modality=""),
        ValueError,
        "modality: expected a non-empty str, found ''",
    ),
    Case(
        "identifier-empty",
        lambda w: hash_identifier("", namespace="n"),
        ValueError,
        "identifier: expected a non-empty str, found ''",
    ),
    Case(
        "identifier-namespace-none",
        lambda w: hash_identifier("x", namespace=None),  # type: ignore[arg-type]
        TypeError,
        "namespace: expected a str, found NoneType",
    ),
    Case(
        "content-float",
        lambda w: hash_content(3.5),
        TypeError,
        "item: expected a ContentHash, PIL.Image.Image",
    ),
    Case(
        "content-short-digest",
        lambda w: hash_content(ContentHash(b"x" * 16)),
        ValueError,
        "item: expected a 32-byte blake3 ContentHash, found 16 bytes",
    ),
    Case(
        "content-bytes-no-modality",
        lambda w: hash_content(b"abc"),
        ValueError,
        "modality: expected a modality for encoded bytes, found None",
    ),
    # -- AnnotatedTokens, TokenRangeAnnotation -------------------------------------
    Case(
        "tokens-negative",
        lambda w: AnnotatedTokens([1, -1]),
        ValueError,
        "token_ids[1]: expected an int in [0, 4294967295], found -1 (int)",
    ),
    Case(
        "tokens-too-large",
        lambda w: AnnotatedTokens([1, 2, 2**32]),
        ValueError,
        "token_ids[2]: expected an int in [0, 4294967295], found 4294967296 (int)",
    ),
    Case(
        "tokens-str-id",
        lambda w: AnnotatedTokens([1, "2"]),  # type: ignore[list-item]
        ValueError,
        "token_ids[1]: expected an int in [0, 4294967295], found '2' (str)",
    ),
    Case(
        "tokens-float-id",
        lambda w: AnnotatedTokens([1.0]),  # type: ignore[list-item]
        ValueError,
        "token_ids[0]: expected an int in [0, 4294967295], found 1.0 (float)",
    ),
    Case(
        "tokens-str",
        lambda w: AnnotatedTokens("abc"),  # type: ignore[arg-type]
        TypeError,
        "token_ids: expected a list, tuple, range, array or other iterable of int, found str",
    ),
    Case(
        "tokens-bytes",
        lambda w: AnnotatedTokens(b"\x01\x02"),
        TypeError,
        "token_ids: expected a list, tuple, range, array or other iterable of int, found bytes",
    ),
    Case(
        "annotation-not-a-range",
        lambda w: AnnotatedTokens([1] * 4, [(0, 1, H, 0, 1)]),  # type: ignore[list-item]
        TypeError,
        "annotations[0]: expected a TokenRangeAnnotation, found tuple",
    ),
    Case(
        "annotation-past-item-end",
        lambda w: AnnotatedTokens([1] * 4, [_ann(0, 2, H, 0, 1)]),
        ValueError,
        "annotations[0]: expected content_offset + token_count <= content_length "
        "(1), found 0 + 2 = 2",
    ),
    Case(
        "annotation-overlap",
        lambda w: AnnotatedTokens([1] * 4, [_ann(0, 2, H, 0, 2), _ann(1, 2, H, 0, 2)]),
        ValueError,
        "annotations[1]: expected token_index >= 2 (end of annotations[0]; "
        "annotations are sorted and do not overlap), found 1",
    ),
    Case(
        "annotation-unsorted",
        lambda w: AnnotatedTokens([1] * 4, [_ann(2, 2, H, 0, 2), _ann(0, 2, H, 0, 2)]),
        ValueError,
        "annotations[1]: expected token_index >= 4 (end of annotations[0]",
    ),
    Case(
        "annotation-outside",
        lambda w: AnnotatedTokens([1] * 4, [_ann(3, 2, H, 0, 2)]),
        ValueError,
        "annotations[0]: expected token_index + token_count <= 4 (number of "
        "tokens), found 3 + 2 = 5",
    ),
    Case(
        "annotation-empty-hash",
        lambda w: AnnotatedTokens([1] * 4, [_ann(0, 1, b"", 0, 1)]),
        ValueError,
        "annotations[0].content_hash: expected non-empty bytes, found b'' (bytes)",
    ),
    Case(
        "annotation-zero-count",
        lambda w: AnnotatedTokens([1] * 4, [_ann(0, 0, H, 0, 1)]),
        ValueError,
        "annotations[0].token_count: expected >= 1, found 0",
    ),
    Case(
        "annotation-bool-index",
        lambda w: AnnotatedTokens([1] * 4, [_ann(True, 1, H, 0, 1)]),
        ValueError,
        "annotations[0].token_index: expected an int, found True (bool)",
    ),
    Case(
        "annotation-negative-offset",
        lambda w: AnnotatedTokens([1] * 4, [_ann(0, 1, H, -1, 1)]),
        ValueError,
        "annotations[0].content_offset: expected >= 0, found -1",
    ),
    Case(
        "slice-step",
        lambda w: w.live[::2],
        ValueError,
        "expected a slice with step 1, found step 2",
    ),
    Case(
        "index-out-of-range",
        lambda w: w.live[10],
        IndexError,
        "token index: expected -10 <= index < 10, found 10",
    ),
    Case(
        "blocks-zero-size",
        lambda w: w.live.blocks(0),
        ValueError,
        "block_size: expected an int >= 1, found 0 (int)",
    ),
    Case(
        "blocks-start-beyond",
        lambda w: w.live.blocks(4, start_block=3),
        ValueError,
        "start_block: expected an int in [0, 2] (full blocks of 4 in 10 tokens), found 3 (int)",
    ),
    Case(
        "packed-reversed",
        lambda w: w.live.packed(3, 2),
        ValueError,
        "expected 0 <= start <= stop <= 10, found start=3, stop=2",
    ),
    Case(
        "clip-reversed-window",
        lambda w: _ann(0, 1, H, 0, 1).clip(5, 2),
        ValueError,
        "expected a window 0 <= start <= end, found [5, 2)",
    ),
    Case(
        "extend-bad-token",
        lambda w: w.live.extend([5, -3]),
        ValueError,
        "token_ids[1]: expected an int in [0, 4294967295], found -3 (int)",
    ),
    # -- annotate_prompt -------------------------------------------------------------
    Case(
        "prompt-no-placement",
        lambda w: annotate_prompt([1, IMG], [RED]),
        ValueError,
        "expected placeholder_token_id or placeholder_ranges to place 1 items, found neither",
    ),
    Case(
        "prompt-both-placements",
        lambda w: annotate_prompt(
            [1, IMG], [RED], placeholder_token_id=IMG, placeholder_ranges=[(1, 1)]
        ),
        ValueError,
        "expected placeholder_token_id or placeholder_ranges, found both: give one",
    ),
    Case(
        "prompt-run-count",
        lambda w: annotate_prompt([1] + [IMG] * 4, [RED, RED], placeholder_token_id=IMG),
        ValueError,
        "placeholder runs of 9000: expected 2 (one per item), found 1 at (offset, length) [(1, 4)]",
    ),
    Case(
        "prompt-unsupported-item",
        lambda w: annotate_prompt([IMG], [3.5], placeholder_token_id=IMG),
        TypeError,
        "items[0]: expected a hashing.ContentHash (used as is)",
    ),
    Case(
        "prompt-float-array",
        lambda w: annotate_prompt([IMG], [np.zeros((2, 2), np.float32)], placeholder_token_id=IMG),
        TypeError,
        "found a ndarray of dtype float32 (only uint8 arrays are images",
    ),
    Case(
        "prompt-short-digest",
        lambda w: annotate_prompt([IMG], [ContentHash(b"d" * 16)], placeholder_token_id=IMG),
        ValueError,
        "items[0]: expected a 32-byte blake3 ContentHash, found 16 bytes",
    ),
    Case(
        "prompt-ranges-overlap",
        lambda w: annotate_prompt([0] * 8, [RED, RED], placeholder_ranges=[(0, 4), (3, 2)]),
        ValueError,
        "placeholder_ranges[1]: expected offset >= 4 (end of placeholder_ranges[0]; "
        "ranges must not overlap), found 3",
    ),
    Case(
        "prompt-range-outside",
        lambda w: annotate_prompt([0] * 8, [RED], placeholder_ranges=[(6, 4)]),
        ValueError,
        "placeholder_ranges[0]: expected offset + length <= 8 (tokens in the "
        "prompt), found 6 + 4 = 10",
    ),
    Case(
        "prompt-range-empty",
        lambda w: annotate_prompt([0] * 8, [RED], placeholder_ranges=[(2, 0)]),
        ValueError,
        "placeholder_ranges[0].length: expected an int >= 1, found 0",
    ),
    Case(
        "prompt-range-count",
        lambda w: annotate_prompt([0] * 8, [RED, RED], placeholder_ranges=[(2, 1)]),
        ValueError,
        "placeholder_ranges: expected 2 ranges (one per item), found 1",
    ),
    Case(
        "prompt-empty-id-set",
        lambda w: annotate_prompt([IMG], [RED], placeholder_token_id=set()),
        ValueError,
        "placeholder_token_id: expected a non-empty set of ids, found set()",
    ),
    Case(
        "prompt-str-id",
        lambda w: annotate_prompt([IMG], [RED], placeholder_token_id="9000"),  # type: ignore[arg-type]
        TypeError,
        "placeholder_token_id: expected an int or a set or frozenset of ints, found str",
    ),
    Case(
        "prompt-items-str",
        lambda w: annotate_prompt([IMG], "abc"),
        TypeError,
        "items: expected a list or tuple of items, found str",
    ),
    Case(
        "prompt-namespace-none",
        lambda w: annotate_prompt(
            [IMG],
            ["x"],
            placeholder_token_id=IMG,
            identifier_namespace=None,  # type: ignore[arg-type]
        ),
        TypeError,
        "identifier_namespace: expected a str, found NoneType",
    ),
    Case(
        "prompt-bad-token",
        lambda w: annotate_prompt([IMG, -1], [RED], placeholder_token_id=IMG),
        ValueError,
        "token_ids[1]: expected an int in [0, 4294967295], found -1 (int)",
    ),
    # -- BlockHasher ----------------------------------------------------------------
    Case(
        "hasher-zero-block",
        lambda w: BlockHasher(0),
        ValueError,
        "block_size: expected int in [1, 4294967295], found 0",
    ),
    Case(
        "hasher-float-block",
        lambda w: BlockHasher(4.0),  # type: ignore[arg-type]
        TypeError,
        "block_size: expected int, found float",
    ),
    Case(
        "hasher-algorithm",
        lambda w: BlockHasher(4, algorithm="md5"),  # type: ignore[arg-type]
        ValueError,
        "algorithm: expected one of blake3, sha256, xxh3_128, found 'md5'",
    ),
    Case(
        "hasher-namespace-none",
        lambda w: BlockHasher(4, namespace=None),  # type: ignore[arg-type]
        TypeError,
        "namespace: expected str, found NoneType",
    ),
    Case(
        "hasher-salt-bytes",
        lambda w: BlockHasher(4, cache_salt=b"s"),  # type: ignore[arg-type]
        TypeError,
        "cache_salt: expected str or None, found bytes",
    ),
    Case(
        "hasher-adapter-int",
        lambda w: BlockHasher(4, adapter=1),  # type: ignore[arg-type]
        TypeError,
        "adapter: expected str or None, found int",
    ),
    Case(
        "hasher-surrogate",
        lambda w: BlockHasher(4, namespace="\ud800"),
        ValueError,
        "namespace: expected a str encodable as UTF-8, found '\\ud800'",
    ),
    Case(
        "hash-start-without-parent",
        lambda w: w.hasher.hash_blocks(w.live, start_block=1),
        ValueError,
        "parent: expected the key of block 0 for start_block=1, found None",
    ),
    Case(
        "hash-short-parent",
        lambda w: w.hasher.hash_blocks(w.live, parent=b"p" * 16, start_block=1),
        ValueError,
        "parent: expected a 32-byte sha256 key, found 16 bytes",
    ),
    Case(
        "hash-str-parent",
        lambda w: w.hasher.hash_blocks(w.live, parent="ab"),  # type: ignore[arg-type]
        TypeError,
        "parent: expected bytes or None, found str",
    ),
    Case(
        "hash-start-beyond",
        lambda w: w.hasher.hash_blocks(w.live, start_block=3),
        ValueError,
        "start_block: expected an int in [0, 2] (full blocks of 4 in 10 tokens), found 3",
    ),
    Case(
        "hash-bool-start",
        lambda w: w.hasher.hash_blocks(w.live, start_block=True),
        TypeError,
        "start_block: expected int, found bool",
    ),
    Case(
        "hash-bad-token",
        lambda w: w.hasher.hash_blocks([1, 2, -1, 4]),
        ValueError,
        "token_ids[2]: expected an int in [0, 4294967295], found -1 (int)",
    ),
    Case(
        "hash-new-too-many",
        lambda w: w.hasher.hash_new_blocks(w.live, [BlockHash(H)] * 3),
        ValueError,
        "block_hashes: expected at most 2 keys (full blocks of 4 in 10 tokens), found 3",
    ),
    Case(
        "hash-new-list",
        lambda w: w.hasher.hash_new_blocks(list(range(8)), []),  # type: ignore[arg-type]
        TypeError,
        "tokens: expected an AnnotatedTokens, found list",
    ),
    Case(
        "hash-new-short-key",
        lambda w: w.hasher.hash_new_blocks(w.live, [BlockHash(b"short")]),
        ValueError,
        "block_hashes[-1]: expected a 32-byte sha256 key, found 5 bytes",
    ),
    Case(
        "low64-short",
        lambda w: block_hash_low64(b"abc"),
        ValueError,
        "key: expected at least 8 bytes, found 3",
    ),
    Case(
        "hex-str",
        lambda w: block_hash_hex("ab"),  # type: ignore[arg-type]
        TypeError,
        "key: expected bytes, found str",
    ),
    # -- BlockPool ------------------------------------------------------------------
    Case(
        "pool-zero-blocks",
        lambda w: BlockPool(0, 4),
        ValueError,
        "num_blocks: expected int >= 1, found 0",
    ),
    Case(
        "pool-float-size",
        lambda w: BlockPool(4, 4.0),  # type: ignore[arg-type]
        TypeError,
        "block_size: expected int, found float",
    ),
    Case(
        "allocate-negative",
        lambda w: w.pool.allocate(-1),
        ValueError,
        "num_blocks: expected int >= 0, found -1",
    ),
    Case(
        "allocate-float",
        lambda w: w.pool.allocate(1.0),  # type: ignore[arg-type]
        TypeError,
        "num_blocks: expected int, found float",
    ),
    Case(
        "touch-foreign",
        lambda w: w.pool.touch([w.free_cached, BlockPool(8, 4).blocks[0]]),
        ValueError,
        "[1]: block 0 does not belong to this pool",
    ),
    Case(
        "touch-free-uncached",
        lambda w: w.pool.touch([w.free_cached, w.free_uncached]),
        ValueError,
        "blocks[1]: expected a block in use or holding a key, found free block 6 without a key",
    ),
    Case(
        "touch-not-a-block",
        lambda w: w.pool.touch([w.live_blocks[0], "x"]),  # type: ignore[list-item]
        TypeError,
        "[1]: expected CacheBlock, found str",
    ),
    Case(
        "free-double",
        lambda w: w.pool.free([*w.live_blocks, w.free_cached]),
        RuntimeError,
        "ordered_blocks[3]: block 2 freed more often than allocated or touched",
    ),
    Case(
        "free-same-block-twice",
        lambda w: w.pool.free([w.live_blocks[0]] * 2),
        RuntimeError,
        "ordered_blocks[1]: block 3 freed more often than allocated or touched",
    ),
    Case(
        "free-foreign",
        lambda w: w.pool.free([w.live_blocks[0], BlockPool(8, 4).blocks[1]]),
        ValueError,
        "[1]: block 1 does not belong to this pool",
    ),
    Case(
        "free-not-a-block",
        lambda w: w.pool.free([w.live_blocks[0], "x"]),  # type: ignore[list-item]
        TypeError,
        "[1]: expected CacheBlock, found str",
    ),
    Case(
        "cache-cached-beyond-full",
        lambda w: w.pool.cache_full_blocks(w.live_blocks, [BlockHash(H)] * 3, 2, 1),
        ValueError,
        "num_cached_blocks: expected 0..1 (num_full_blocks), found 2",
    ),
    Case(
        "cache-full-beyond-keys",
        lambda w: w.pool.cache_full_blocks(w.live_blocks, [BlockHash(H)], 0, 2),
        ValueError,
        "num_full_blocks: expected <= 1 (len(blocks)=3, len(block_hashes)=1), found 2",
    ),
    Case(
        "cache-free-block",
        lambda w: w.pool.cache_full_blocks(
            [w.live_blocks[2], w.free_uncached], [BlockHash(b"a" * 32), BlockHash(b"b" * 32)], 0, 2
        ),
        ValueError,
        "blocks[1]: expected a block in use, found free block 6",
    ),
    Case(
        "cache-other-key",
        lambda w: w.pool.cache_full_blocks(w.live_blocks, [BlockHash(H)] * 3, 0, 1),
        ValueError,
        "blocks[0]: block 3 holds key ",
    ),
    Case(
        "cache-listed-twice",
        lambda w: w.pool.cache_full_blocks(
            [w.live_blocks[2]] * 2, [BlockHash(b"a" * 32)] * 2, 0, 2
        ),
        ValueError,
        "blocks[1]: block 5 listed twice",
    ),
    Case(
        "hit-negative-cap",
        lambda w: w.pool.find_longest_cache_hit(w.cache.block_hashes("live"), -1),
        ValueError,
        "max_num_blocks: expected int >= 0 or None, found -1",
    ),
    Case(
        "block-hash-out-of-range",
        lambda w: w.pool.get_block_hash(8),
        ValueError,
        "block_id: expected int in [0, 7], found 8",
    ),
    Case(
        "block-hash-float-id",
        lambda w: w.pool.get_block_hash(1.5),  # type: ignore[arg-type]
        TypeError,
        "block_id: expected int, found float",
    ),
    Case(
        "block-hash-bool-id",
        lambda w: w.pool.get_block_hash(True),
        TypeError,
        "block_id: expected int, found bool",
    ),
    Case(
        "hit-float-cap",
        lambda w: w.pool.find_longest_cache_hit(w.cache.block_hashes("live"), 1.5),  # type: ignore[arg-type]
        TypeError,
        "max_num_blocks: expected int or None, found float",
    ),
    Case(
        "cache-none-key",
        lambda w: w.pool.cache_full_blocks([w.live_blocks[2]], [None], 0, 1),  # type: ignore[list-item]
        TypeError,
        "block_hashes[0]: expected bytes, found NoneType",
    ),
    Case(
        "cache-str-key",
        lambda w: w.pool.cache_full_blocks([w.live_blocks[2]], ["k"], 0, 1),  # type: ignore[list-item]
        TypeError,
        "block_hashes[0]: expected bytes, found str",
    ),
    Case(
        "listener-not-callable",
        lambda w: w.pool.add_eviction_listener(3),  # type: ignore[arg-type]
        TypeError,
        "callback: expected a callable, found int",
    ),
    Case(
        "listener-unknown",
        lambda w: w.pool.remove_eviction_listener(print),
        ValueError,
        "callback: expected a registered eviction listener, found <built-in function print>",
    ),
    # -- PrefixCache ----------------------------------------------------------------
    Case(
        "cache-size-mismatch",
        lambda w: PrefixCache(w.pool, BlockHasher(8)),
        ValueError,
        "block_hasher.block_size: expected 4 (block_pool.block_size), found 8",
    ),
    Case(
        "cache-pool-type",
        lambda w: PrefixCache("pool", w.hasher),  # type: ignore[arg-type]
        TypeError,
        "block_pool: expected BlockPool, found str",
    ),
    Case(
        "add-int-id",
        lambda w: w.cache.add_request(1, w.done),  # type: ignore[arg-type]
        TypeError,
        "request_id: expected str, found int",
    ),
    Case(
        "add-active-id",
        lambda w: w.cache.add_request("live", w.done),
        ValueError,
        "request_id: expected a new request id, found 'live' active",
    ),
    Case(
        "add-list-prompt",
        lambda w: w.cache.add_request("new", [1, 2]),  # type: ignore[arg-type]
        TypeError,
        "prompt: expected AnnotatedTokens, found list",
    ),
    Case(
        "add-empty-prompt",
        lambda w: w.cache.add_request("new", AnnotatedTokens([])),
        ValueError,
        "prompt: expected at least 1 token, found 0",
    ),
    Case(
        "computed-unknown",
        lambda w: w.cache.mark_computed("done", 13),
        ValueError,
        "request_id: expected an active request, found 'done'",
    ),
    Case(
        "computed-backwards",
        lambda w: w.cache.mark_computed("live", 4),
        ValueError,
        "num_computed_tokens: expected 8..10 for request 'live', found 4",
    ),
    Case(
        "computed-beyond",
        lambda w: w.cache.mark_computed("live", 11),
        ValueError,
        "num_computed_tokens: expected 8..10 for request 'live', found 11",
    ),
    Case(
        "computed-float",
        lambda w: w.cache.mark_computed("live", 9.0),  # type: ignore[arg-type]
        TypeError,
        "num_computed_tokens: expected int, found float",
    ),
    Case(
        "append-bad-token",
        lambda w: w.cache.append_tokens("live", [1, 2, 2**32]),
        ValueError,
        "token_ids[2]: expected an int in [0, 4294967295], found 4294967296 (int)",
    ),
    Case(
        "append-unknown",
        lambda w: w.cache.append_tokens("nope", [1]),
        ValueError,
        "request_id: expected an active request, found 'nope'",
    ),
    Case(
        "free-unknown",
        lambda w: w.cache.free("done"),
        ValueError,
        "request_id: expected an active request, found 'done'",
    ),
    # -- TensorStore ----------------------------------------------------------------
    Case(
        "store-zero-blocks",
        lambda w: TensorStore(0, 4),
        ValueError,
        "num_blocks: expected int >= 1, found 0",
    ),
    Case(
        "store-max-bytes-float",
        lambda w: TensorStore(4, 4, max_bytes=1.5),  # type: ignore[arg-type]
        TypeError,
        "max_bytes: expected int or None, found float",
    ),
    Case(
        "store-meta-device",
        lambda w: TensorStore(4, 4, device="meta"),
        ValueError,
        "device: expected 'cpu' or 'cuda[:N]', found 'meta'",
    ),
    Case(
        "store-half-hidden",
        lambda w: TensorStore(4, 4, hidden_size=8),
        ValueError,
        "hidden_size and hidden_dtype: expected both or neither",
    ),
    Case(
        "register-empty-name",
        lambda w: w.store.register("", 3, torch.float32),
        ValueError,
        "name: expected a non-empty str, found ''",
    ),
    Case(
        "register-int-name",
        lambda w: w.store.register(5, 3, torch.float32),  # type: ignore[arg-type]
        TypeError,
        "name: expected str, found int",
    ),
    Case(
        "register-changed",
        lambda w: w.store.register("h", 4, torch.float32),
        ValueError,
        "entry 'h': already registered as rows (3,) of torch.float32, found rows (4,) of "
        "torch.float32",
    ),
    Case(
        "register-dtype-str",
        lambda w: w.store.register("x", 3, "float32"),  # type: ignore[arg-type]
        TypeError,
        "dtype: expected torch.dtype, found str",
    ),
    Case(
        "register-over-cap",
        lambda w: w.store.register("big", 200, torch.float32),
        StoreCapacityError,
        "entries 'big': need 25600 bytes, 3200 available (max_bytes=4096",
    ),
    Case(
        "write-unknown-entry",
        lambda w: w.store.write("nope", rows(4), [0, 1, 2, 3]),
        ValueError,
        "name: expected a registered entry ['h', 'codes'], found 'nope'",
    ),
    Case(
        "write-dtype",
        lambda w: w.store.write("h", rows(4, dtype=torch.float64), [0, 1, 2, 3]),
        ValueError,
        "entry 'h': expected dtype torch.float32, found torch.float64",
    ),
    Case(
        "write-shape",
        lambda w: w.store.write("h", rows(4, 2), [0, 1, 2, 3]),
        ValueError,
        "entry 'h': expected rows of shape (n, 3), found (4, 2)",
    ),
    Case(
        "write-few-rows",
        lambda w: w.store.write("h", rows(2), [24, 25, 26, 27]),
        ValueError,
        "entry 'h': expected at least 4 rows, found 2",
    ),
    Case(
        "write-slot-range",
        lambda w: w.store.write("h", rows(2), [24, 32]),
        IndexError,
        "slot_mapping[1]: expected 0..31, found 32",
    ),
    Case(
        "write-slot-negative",
        lambda w: w.store.write("h", rows(2), [-1, 24]),
        IndexError,
        "slot_mapping[0]: expected 0..31, found -1",
    ),
    Case(
        "write-slot-twice",
        lambda w: w.store.write("h", rows(3), [24, 28, 24]),
        ValueError,
        "slot_mapping: expected distinct slots, found slot 24 at rows [0, 2]",
    ),
    Case(
        "write-slots-str",
        lambda w: w.store.write("h", rows(3), "abc"),
        TypeError,
        "slot_mapping: expected torch.Tensor, numpy.ndarray or sequence of int, found str",
    ),
    Case(
        "write-slots-float",
        lambda w: w.store.write("h", rows(1), np.array([0.5])),
        TypeError,
        "slot_mapping: expected integers, found dtype float64",
    ),
    Case(
        "write-slots-2d",
        lambda w: w.store.write("h", rows(2), torch.zeros(1, 2, dtype=torch.int64)),
        ValueError,
        "slot_mapping: expected 1 dim, found shape (1, 2)",
    ),
    Case(
        "write-num-tokens",
        lambda w: w.store.write("h", rows(2), [24, 25], num_tokens=3),
        ValueError,
        "num_tokens: expected int in [0, 2] or None, found 3",
    ),
    Case(
        "write-num-tokens-float",
        lambda w: w.store.write("h", rows(2), [24, 25], num_tokens=1.0),  # type: ignore[arg-type]
        TypeError,
        "num_tokens: expected int or None, found float",
    ),
    Case(
        "write-key-id-str",
        lambda w: w.store.write("h", rows(4), [24, 25, 26, 27], block_keys={"6": BlockHash(H)}),  # type: ignore[dict-item]
        TypeError,
        "block_keys: expected int block ids, found str",
    ),
    Case(
        "write-key-block-range",
        lambda w: w.store.write("h", rows(4), [24, 25, 26, 27], block_keys={8: BlockHash(H)}),
        IndexError,
        "block_keys: expected block ids 0..7, found 8",
    ),
    Case(
        "write-key-str",
        lambda w: w.store.write("h", rows(4), [24, 25, 26, 27], block_keys={6: "k"}),  # type: ignore[dict-item]
        TypeError,
        "block_keys[6]: expected bytes, found str",
    ),
    Case(
        "write-blocks-twice",
        lambda w: w.store.write_blocks("h", rows(8), [6, 6]),
        ValueError,
        "block_ids: expected distinct blocks, found [6, 6]",
    ),
    Case(
        "write-blocks-keys",
        lambda w: w.store.write_blocks("h", rows(8), [6, 7], block_keys=[BlockHash(H)]),
        ValueError,
        "block_keys: expected 2 keys (one per block), found 1",
    ),
    Case(
        "write-outputs-hidden-twice",
        lambda w: w.store.write_outputs(
            [24], hidden_states=rows(1), multimodal_outputs={"hidden_states": rows(1)}
        ),
        ValueError,
        "multimodal_outputs: expected no 'hidden_states' key when hidden_states is given",
    ),
    Case(
        "write-outputs-new-and-bad",
        lambda w: w.store.write_outputs(
            [24, 25], multimodal_outputs={"new": rows(2, 5), "h": rows(2, 4)}
        ),
        ValueError,
        "entry 'h': expected rows of shape (n, 3), found (2, 4)",
    ),
    Case(
        "write-outputs-padded",
        lambda w: w.store.write_outputs([24, 25], hidden_states=rows(2), num_tokens_padded=1),
        ValueError,
        "num_tokens_padded: expected int >= 2 or None, found 1",
    ),
    Case(
        "write-outputs-padded-float",
        lambda w: w.store.write_outputs([24, 25], hidden_states=rows(2), num_tokens_padded=2.0),  # type: ignore[arg-type]
        TypeError,
        "num_tokens_padded: expected int or None, found float",
    ),
    Case(
        "write-step-rows-and-slots",
        lambda w: w.store.write_step(
            [ScheduledRequest("r", 1)], [24, 25], multimodal_outputs={"h": rows(2)}
        ),
        ValueError,
        "requests: expected num_new_tokens summing to 2 (one per slot), found 1",
    ),
    Case(
        "write-step-deferred-dtype",
        lambda w: w.store.write_step(
            [ScheduledRequest("r", 2)],
            [24, 25],
            multimodal_outputs={"h": rows(2), "codes": rows(2, 2)},
        ),
        ValueError,
        "entry 'codes': expected dtype torch.int64, found torch.float32",
    ),
    Case(
        "write-step-direct-shape",
        lambda w: w.store.write_step(
            [ScheduledRequest("r", 2)],
            [24, 25],
            multimodal_outputs={"h": rows(2, 4), "codes": rows(2, 2, torch.int64)},
        ),
        ValueError,
        "entry 'h': expected rows of shape (n, 3), found (2, 4)",
    ),
    Case(
        "stage-direct-entry",
        lambda w: w.store.stage("r", "h", rows(2), token_start=0),
        ValueError,
        "entry 'h': expected a deferred entry, found a direct one",
    ),
    Case(
        "stage-negative-start",
        lambda w: w.store.stage("r", "codes", rows(2, 2, torch.int64), token_start=-1),
        ValueError,
        "token_start: expected int >= 0, found -1",
    ),
    Case(
        "stage-float-start",
        lambda w: w.store.stage("r", "codes", rows(2, 2, torch.int64), token_start=1.0),  # type: ignore[arg-type]
        TypeError,
        "token_start: expected int, found float",
    ),
    Case(
        "stage-dtype",
        lambda w: w.store.stage("live", "codes", rows(2, 2), token_start=10),
        ValueError,
        "entry 'codes': expected dtype torch.int64, found torch.float32",
    ),
    Case(
        "commit-unknown",
        lambda w: w.store.commit("done", [0], []),
        ValueError,
        "req_id: expected a request with staged rows, found 'done' (1 requests staged)",
    ),
    Case(
        "commit-too-few-blocks",
        lambda w: w.store.commit(
            "live", w.cache.block_ids("live")[:2], w.cache.block_hashes("live")
        ),
        ValueError,
        "entry 'codes': staged tokens 0..9 of request 'live': expected tokens "
        "below 8 (2 blocks of 4)",
    ),
    Case(
        "commit-too-many-keys",
        lambda w: w.store.commit("live", [3], w.cache.block_hashes("live")),
        ValueError,
        "block_keys: expected at most 1 keys (one per block), found 2",
    ),
    Case(
        "discard-unknown",
        lambda w: w.store.discard("done"),
        ValueError,
        "req_id: expected a request with staged rows, found 'done' (1 requests staged)",
    ),
    Case(
        "read-keys-count",
        lambda w: w.store.read_blocks("h", [0, 1], [BlockHash(H)]),
        ValueError,
        "block_keys: expected 2 keys (one per block), found 1",
    ),
    Case(
        "read-block-range",
        lambda w: w.store.read_blocks("h", [8], [BlockHash(H)]),
        IndexError,
        "block_ids[0]: expected 0..7, found 8",
    ),
    Case(
        "read-key-type",
        lambda w: w.store.read_blocks("h", [0], ["k"]),  # type: ignore[list-item]
        TypeError,
        "block_keys[0]: expected bytes, found str",
    ),
    Case(
        "read-out-dtype",
        lambda w: w.store.read_blocks(
            "h", [0], [BlockHash(H)], out=torch.zeros(4, 3, dtype=torch.float64)
        ),
        ValueError,
        "out: expected dtype torch.float32, found torch.float64",
    ),
    Case(
        "probe-names-str",
        lambda w: w.store.probe([0], [BlockHash(H)], names="h"),
        TypeError,
        "names: expected an iterable of entry names, found str",
    ),
    Case(
        "merged-not-scheduled",
        lambda w: w.store.read_merged([("live", 1)]),  # type: ignore[list-item]
        TypeError,
        "requests[0]: expected ScheduledRequest, found tuple",
    ),
    Case(
        "merged-listed-twice",
        lambda w: w.store.read_merged(
            [ScheduledRequest("a", 1), ScheduledRequest("a", 1)], multimodal_outputs={"h": rows(2)}
        ),
        ValueError,
        "requests[1]: request 'a' listed twice",
    ),
    Case(
        "merged-out-missing",
        lambda w: w.store.read_merged(
            [
                ScheduledRequest(
                    "live", 1, 8, w.cache.block_ids("live")[:2], w.cache.block_hashes("live")
                )
            ],
            multimodal_outputs={"h": rows(1)},
            out={},
        ),
        ValueError,
        "out: expected a buffer for entry 'h', found none",
    ),
    Case(
        "merged-computed-past-hit",
        lambda w: w.store.read_merged(
            [
                ScheduledRequest(
                    "live", 1, 6, w.cache.block_ids("live")[:1], w.cache.block_hashes("live")[:1]
                )
            ],
            multimodal_outputs={"h": rows(1)},
        ),
        ValueError,
        "requests[0].num_computed_tokens: expected 4 (request 'live': 1 hit blocks of 4 tokens, "
        "its new rows right after them), found 6",
    ),
    Case(
        "merged-computed-zero-with-hit",
        lambda w: w.store.read_merged(
            [
                ScheduledRequest("new", 2),
                ScheduledRequest(
                    "live", 0, 0, w.cache.block_ids("live")[:2], w.cache.block_hashes("live")
                ),
            ],
            multimodal_outputs={"h": rows(2)},
            strict=True,
        ),
        ValueError,
        "requests[1].num_computed_tokens: expected 8 (request 'live': 2 hit blocks of 4 tokens, "
        "its new rows right after them), found 0",
    ),
    Case(
        "merged-rows-short",
        lambda w: w.store.read_merged(
            [ScheduledRequest("live", 3)], multimodal_outputs={"h": rows(2)}
        ),
        ValueError,
        "entry 'h': expected at least 3 rows, found 2",
    ),
    Case(
        "evicted-block-range",
        lambda w: w.store.on_block_evicted(8, BlockHash(H)),
        IndexError,
        "block_id: expected 0..7, found 8",
    ),
    Case(
        "invalidate-one-bad",
        lambda w: w.store.invalidate([0, 8]),
        IndexError,
        "block_ids[1]: expected 0..7, found 8",
    ),
    Case(
        "invalidate-float",
        lambda w: w.store.invalidate([1, 1.5]),  # type: ignore[list-item]
        TypeError,
        "block_ids: expected a flat sequence of int, found [1, 1.5]",
    ),
    Case(
        "stamp-block-range",
        lambda w: w.store.stamp_of("h", -1),
        IndexError,
        "block_id: expected 0..7, found -1",
    ),
    Case(
        "attach-geometry",
        lambda w: w.store.attach(BlockPool(4, 4)),
        ValueError,
        "pool: expected 8 blocks of 4 tokens, found 4 blocks of 4 tokens",
    ),
    Case(
        "outputs-numpy-hidden",
        lambda w: w.store.write_outputs([24], hidden_states=np.zeros((1, 3), np.float32)),  # type: ignore[arg-type]
        TypeError,
        "outputs['hidden_states']: expected torch.Tensor, found ndarray",
    ),
    Case(
        "stamp-float-id",
        lambda w: w.store.stamp_of("h", 1.5),  # type: ignore[arg-type]
        TypeError,
        "block_id: expected int, found float",
    ),
    Case(
        "stamp-bool-id",
        lambda w: w.store.stamp_of("h", True),
        TypeError,
        "block_id: expected int, found bool",
    ),
    Case(
        "evicted-float-id",
        lambda w: w.store.on_block_evicted(1.5, BlockHash(H)),  # type: ignore[arg-type]
        TypeError,
        "block_id: expected int, found float",
    ),
    Case(
        "read-buffers-negative",
        lambda w: w.store.new_read_buffers(-1),
        ValueError,
        "num_rows: expected int >= 0, found -1",
    ),
    Case(
        "read-buffers-float",
        lambda w: w.store.new_read_buffers(2.0),  # type: ignore[arg-type]
        TypeError,
        "num_rows: expected int, found float",
    ),
    Case(
        "merged-float-new-tokens",
        lambda w: w.store.read_merged(
            [ScheduledRequest("a", 1.0)],  # type: ignore[arg-type]
            multimodal_outputs={"h": rows(1)},
        ),
        TypeError,
        "requests[0].num_new_tokens: expected int, found float",
    ),
]


def test_the_table_is_large_and_ids_are_unique() -> None:
    assert len(CASES) >= 40
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_raises_exactly_and_changes_nothing(case: Case) -> None:
    world = build_world()
    before = snapshot(world)
    with pytest.raises(case.error, match=re.escape(case.fragment)) as info:
        case.call(world)
    assert type(info.value) is case.error
    assert snapshot(world) == before


def test_a_refused_commit_changes_nothing_but_its_counter() -> None:
    """A commit onto a block handed out since staging: refused, counted, nothing else."""
    world = build_world()
    live = world.cache.block_ids("live")
    world.store.invalidate([live[2]])
    before = snapshot(world)
    with pytest.raises(StaleCommitError) as info:
        world.store.commit("live", live, world.cache.block_hashes("live"))
    assert type(info.value) is StaleCommitError
    assert str(info.value) == (
        f"commit of request 'live': entry 'codes', token 8: expected block {live[2]} "
        "(block_ids[2]) held by the request since the row was staged, found it handed out "
        "again since (evicted or invalidated)"
    )
    stats = replace(before.store.stats, num_refused_commits=1)
    assert snapshot(world) == before._replace(store=before.store._replace(stats=stats))


def test_no_room_is_a_value_and_changes_nothing() -> None:
    """The documented "no room" results (None) leave the world as it was too."""
    world = build_world()
    before = snapshot(world)
    assert world.pool.allocate(6) is None
    big = AnnotatedTokens(list(range(40)))
    assert world.cache.add_request("big", big) is None
    assert snapshot(world) == before
    assert world.cache.append_tokens("live", list(range(30))) is None
    # NOTE: a refused append leaves its ids in the shared buffer past the
    # request's view; no view reads them, and the next append copies.
    after = snapshot(world)
    assert after._replace(buffer_lengths=before.buffer_lengths) == before
    assert after.buffer_lengths == (13, 40)
    assert world.cache.append_tokens("live", [7]) == []
    assert world.cache.num_tokens("live") == 11
    assert world.live.tolist() == [8, 8] + [IMG] * 5 + [9, 9, 9]


def test_the_world_snapshot_sees_every_kind_of_change() -> None:
    """Each part of the snapshot changes under a valid call (else it proves nothing)."""
    changes: list[Callable[[World], object]] = [
        lambda w: w.pool.touch([w.free_cached]),
        lambda w: w.pool.allocate(1),
        lambda w: w.pool.take_events(),
        lambda w: w.cache.mark_computed("live", 9),
        lambda w: w.cache.append_tokens("live", [1]),
        lambda w: w.store.write("h", rows(1, seed=9), [24]),
        lambda w: w.store.invalidate([0]),
        lambda w: w.store.discard("live"),
        lambda w: w.store.register("extra", 1, torch.int8),
        lambda w: w.store.read_blocks("h", [0], [w.pool.blocks[0].block_hash or BlockHash(H)]),
    ]
    for change in changes:
        world = build_world()
        before = snapshot(world)
        change(world)
        assert snapshot(world) != before
