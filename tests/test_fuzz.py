"""Fuzzing against reference models: annotate_prompt, AnnotatedTokens, BlockHasher,
BlockPool and TensorStore.

Each target has a ``check_*(rng)`` function that draws one input from a
`random.Random`, runs it through omnicache and through a small reference model
written here from the documented behaviour, and asserts they agree exactly. It
returns the number of operations it checked.

Hypothesis drives the checks through ``st.randoms()`` (its draws shrink like
any other); ``scripts/fuzz_long.py`` drives the same checks for millions of
inputs outside CI.
"""

from __future__ import annotations

import hashlib
import io
import random
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from hashing import ALGORITHMS, ContentHash, hash_identifier
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import BlockHash, BlockHasher
from omnicache.identity import item_identity
from omnicache.preprocess import annotate_prompt
from omnicache.reference.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    PoolEvent,
)
from omnicache.store import ScheduledRequest, StaleBlockError, TensorStore

__all__ = ["CHECKS", "check_annotate", "check_block_hasher", "check_pool", "check_store"]

# Placeholder ids sit above every text id the generators draw.
PLACEHOLDERS = (1000, 1001)


# == annotate_prompt ============================================================


def _item(rng: random.Random, pool_of_ids: list[str]) -> object:
    kind = rng.randrange(5)
    if kind == 0:
        return ContentHash(rng.randbytes(32))
    if kind == 1:
        return rng.choice(pool_of_ids)
    if kind == 2:
        shape = (rng.randint(1, 3), rng.randint(1, 3)) + (
            (rng.choice((1, 3, 4)),) * rng.randrange(2)
        )
        return np.frombuffer(rng.randbytes(int(np.prod(shape))), dtype=np.uint8).reshape(shape)
    if kind == 3:
        wave = np.array([rng.uniform(-1, 1) for _ in range(rng.randint(1, 8))], dtype=np.float32)
        return (wave, rng.choice((8000, 16000)))
    # A PNG file's bytes.
    side = (rng.randint(1, 4), rng.randint(1, 4))
    pixels = np.frombuffer(rng.randbytes(side[0] * side[1] * 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.reshape(*side, 3), "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _expected_digest(item: object, namespace: str) -> bytes:
    if isinstance(item, ContentHash):
        return item
    if isinstance(item, str):
        return hash_identifier(item, namespace=namespace)
    if isinstance(item, tuple):
        return item_identity(item, modality="audio")
    if isinstance(item, bytes):
        with Image.open(io.BytesIO(item)) as picture:
            return item_identity(picture.convert("RGB"), modality="image")
    return item_identity(item, modality="image")


def _runs_of(tokens: list[int], ids: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(tokens):
        if token in ids:
            if runs and runs[-1][0] + runs[-1][1] == index:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((index, 1))
    return runs


def check_annotate(rng: random.Random) -> int:
    """One prompt: placeholder runs (by id or by ranges), items of every kind."""
    namespace = rng.choice(("default", "tenant-a"))
    ids_pool = ["a", "b", "photo-1"]
    num_items = rng.randrange(5)
    items = [_item(rng, ids_pool) for _ in range(num_items)]
    if rng.random() < 0.3 and items:
        items.append(items[rng.randrange(len(items))])  # the same object twice
    by_id = rng.random() < 0.5
    tokens: list[int] = [rng.randrange(100) for _ in range(rng.randrange(4))]
    spans: list[tuple[int, int]] = []
    placeholder: int | set[int] = PLACEHOLDERS[0] if rng.random() < 0.6 else set(PLACEHOLDERS)
    ids = {placeholder} if isinstance(placeholder, int) else placeholder
    for _ in items:
        length = rng.randint(1, 9)
        if by_id:
            run = [rng.choice(sorted(ids)) for _ in range(length)]
        else:
            run = [rng.randrange(2000) for _ in range(length)]
        spans.append((len(tokens), length))
        tokens += run
        # Ranges may touch; runs found by id must be apart (one text token at least).
        gap = rng.randrange(3) if not by_id else rng.randint(0, 3)
        tokens += [rng.randrange(100) for _ in range(gap)]
    if by_id:
        expected_spans = _runs_of(tokens, ids)
        order = list(range(len(items)))
        kwargs: dict[str, Any] = {"placeholder_token_id": placeholder}
    else:
        expected_spans = spans
        order = list(range(len(items)))
        rng.shuffle(order)
        kwargs = {"placeholder_ranges": [spans[i] for i in order]}
    call_items = [items[i] for i in order]
    if not items and rng.random() < 0.5:
        kwargs = {}
    if by_id and len(expected_spans) != len(items):
        with pytest.raises(ValueError, match=rf"expected {len(items)} \(one per item\)"):
            annotate_prompt(tokens, call_items, identifier_namespace=namespace, **kwargs)
        return 1
    result = annotate_prompt(tokens, call_items, identifier_namespace=namespace, **kwargs)
    # By id, the k-th run belongs to the k-th item; by ranges, range i to item order[i].
    expected = sorted(
        TokenRangeAnnotation(offset, length, _expected_digest(items[k], namespace), 0, length)
        for k, (offset, length) in enumerate(expected_spans if by_id else spans)
    )
    assert result.tolist() == tokens
    assert list(result.annotations) == expected
    return 1


# == AnnotatedTokens ==============================================================

# Per token: (item id, digest, position in item, item length) or None for text.
Label = tuple[int, bytes, int, int] | None


@dataclass
class TokensModel:
    tokens: list[int]
    labels: list[Label]

    def annotations(self, start: int = 0, stop: int | None = None) -> list[TokenRangeAnnotation]:
        """Maximal runs of one item in ``[start, stop)``, re-based to ``start``."""
        stop = len(self.tokens) if stop is None else stop
        out: list[TokenRangeAnnotation] = []
        prev: Label = None
        for index in range(start, stop):
            label = self.labels[index]
            if label is None:
                prev = None
                continue
            item, digest, pos, length = label
            if prev is not None and prev[0] == item and prev[2] + 1 == pos:
                last = out[-1]
                out[-1] = last._replace(token_count=last.token_count + 1)
            else:
                out.append(TokenRangeAnnotation(index - start, 1, digest, pos, length))
            prev = label
        return out


_next_item = iter(range(1 << 62))


def random_annotated(
    rng: random.Random, max_tokens: int = 40
) -> tuple[AnnotatedTokens, TokensModel]:
    """Tokens with sorted, disjoint annotations; some items start or end mid-way."""
    num_tokens = rng.randrange(max_tokens + 1)
    tokens = [rng.randrange(1 << rng.choice((4, 16, 32))) for _ in range(num_tokens)]
    labels: list[Label] = [None] * num_tokens
    annotations = []
    index = rng.randrange(4)
    while index < num_tokens:
        count = rng.randint(1, min(12, num_tokens - index))
        offset = rng.randrange(3) if rng.random() < 0.3 else 0
        length = offset + count + (rng.randrange(3) if rng.random() < 0.3 else 0)
        digest = rng.choice((b"\x01" * 32, b"\x02" * 32, rng.randbytes(rng.choice((16, 32)))))
        item = next(_next_item)
        annotations.append(TokenRangeAnnotation(index, count, digest, offset, length))
        for k in range(count):
            labels[index + k] = (item, digest, offset + k, length)
        index += count + rng.randrange(4)
    return AnnotatedTokens(tokens, annotations), TokensModel(tokens, labels)


def assert_tokens_match(real: AnnotatedTokens, model: TokensModel) -> None:
    assert len(real) == len(model.tokens)
    assert real.tolist() == model.tokens
    assert list(real) == model.tokens
    assert list(real.annotations) == model.annotations()
    assert real.packed() == struct.pack(f"<{len(model.tokens)}I", *model.tokens)


def check_annotated_tokens(rng: random.Random) -> int:
    """Random slices, appends and block cuts of one sequence, every view re-checked."""
    real, model = random_annotated(rng)
    views = [(real, model)]
    num_ops = 0
    for _ in range(rng.randint(1, 8)):
        base, base_model = rng.choice(views)
        n = len(base_model.tokens)
        op = rng.randrange(6)
        num_ops += 1
        if op == 0:
            start = rng.randint(0, n)
            stop = rng.randint(start, n)
            if rng.random() < 0.4:
                start = 0
            new = base[start:stop]
            new_model = TokensModel(base_model.tokens[start:stop], base_model.labels[start:stop])
        elif op == 1:
            tail = [rng.randrange(1 << 32) for _ in range(rng.randrange(5))]
            new = base.extend(tail) if rng.random() < 0.5 else base + tail
            new_model = TokensModel(
                base_model.tokens + tail, base_model.labels + [None] * len(tail)
            )
        elif op == 2:
            other, other_model = rng.choice(views)
            new = base + other
            # The appended annotations are new items, even where one continues another.
            renamed: dict[int, int] = {}
            labels = [
                None if lb is None else (renamed.setdefault(lb[0], next(_next_item)), *lb[1:])
                for lb in other_model.labels
            ]
            new_model = TokensModel(
                base_model.tokens + other_model.tokens, base_model.labels + labels
            )
        elif op == 3:
            block_size = rng.randint(1, 9)
            start_block = rng.randint(0, n // block_size)
            blocks = list(base.blocks(block_size, start_block=start_block))
            assert [b.token_ids for b in blocks] == [
                tuple(base_model.tokens[i * block_size : (i + 1) * block_size])
                for i in range(start_block, n // block_size)
            ]
            assert [list(b.annotations) for b in blocks] == [
                base_model.annotations(i * block_size, (i + 1) * block_size)
                for i in range(start_block, n // block_size)
            ]
            continue
        elif op == 4:
            start = rng.randint(0, n + 3)
            stop = rng.randint(start, n + 5)
            assert list(base.clipped_annotations(start, stop)) == base_model.annotations(
                min(start, n), min(stop, n)
            )
            if stop <= n:
                assert base.packed(start, stop) == struct.pack(
                    f"<{stop - start}I", *base_model.tokens[start:stop]
                )
            continue
        else:
            if n:
                index = rng.randrange(-n, n)
                assert base[index] == base_model.tokens[index]
            other, other_model = rng.choice(views)
            same = (other_model.tokens, other_model.annotations()) == (
                base_model.tokens,
                base_model.annotations(),
            )
            assert (base == other) is same
            if same:
                assert hash(base) == hash(other)
            continue
        assert_tokens_match(new, new_model)
        views.append((new, new_model))
    # NOTE: appends share buffers with older views; every view must still read its own ids.
    for view, view_model in views:
        assert_tokens_match(view, view_model)
    return num_ops


# == BlockHasher ================================================================

_NEW: dict[str, Callable[[bytes], Any]] = {
    "sha256": hashlib.sha256,
    "blake3": blake3.blake3,
    "xxh3_128": xxhash.xxh3_128,
}


def _field(tag: int, value: str | int | None) -> bytes:
    if value is None:
        return struct.pack("<BBI", tag, 0, 0)
    if isinstance(value, str):
        data = value.encode()
        return struct.pack("<BBI", tag, 1, len(data)) + data
    return struct.pack("<BBIQ", tag, 2, 8, value)


def reference_keys(
    model: TokensModel,
    block_size: int,
    algorithm: str,
    namespace: str,
    salt: str | None,
    adapter: str | None,
) -> list[bytes]:
    """Block keys written from the byte layout in ``omnicache.block_hash``'s docstring."""
    new = _NEW[algorithm]
    root = new(
        _field(1, "omnicache.block/v1")
        + _field(2, algorithm)
        + _field(3, namespace)
        + _field(4, salt)
        + _field(5, adapter)
        + _field(6, block_size)
    ).digest()
    keys: list[bytes] = []
    parent: bytes = root
    for block in range(len(model.tokens) // block_size):
        start = block * block_size
        data = parent + struct.pack(f"<{block_size}I", *model.tokens[start : start + block_size])
        for ann in model.annotations(start, start + block_size):
            data += struct.pack(
                "<IIIII",
                ann.token_index,
                ann.token_count,
                ann.content_offset,
                ann.content_length,
                len(ann.content_hash),
            )
            data += ann.content_hash
        parent = new(data).digest()
        keys.append(parent)
    return keys


def check_block_hasher(rng: random.Random) -> int:
    """One sequence keyed whole, from a middle block, from a suffix, and while decoding."""
    real, model = random_annotated(rng, max_tokens=rng.choice((12, 40, 90)))
    block_size = rng.randint(1, 9)
    algorithm = rng.choice(ALGORITHMS)
    namespace = rng.choice(("", "model-a"))
    salt = rng.choice((None, "", "s"))
    adapter = rng.choice((None, "", "lora"))
    hasher = BlockHasher(
        block_size, algorithm=algorithm, namespace=namespace, cache_salt=salt, adapter=adapter
    )
    expected = reference_keys(model, block_size, algorithm, namespace, salt, adapter)
    keys = hasher.hash_blocks(real)
    assert keys == expected
    num_blocks = len(keys)
    cut = rng.randint(1, num_blocks) if num_blocks else 0
    if cut:
        parent = keys[cut - 1]
        assert hasher.hash_blocks(real, parent=parent, start_block=cut) == expected[cut:]
        suffix = real[cut * block_size :]
        assert hasher.hash_blocks(suffix, parent=parent) == expected[cut:]
    # Decode: append a few tokens at a time, key only the new blocks.
    done = hasher.hash_blocks(real[: rng.randint(0, len(real))])
    grown = real[: len(done) * block_size]
    grown_model = TokensModel(model.tokens[: len(grown)], model.labels[: len(grown)])
    steps = 0
    while len(grown) < len(real) + 2 * block_size and steps < 12:
        chunk = [rng.randrange(1 << 16) for _ in range(rng.randrange(block_size + 2))]
        grown = grown + chunk
        grown_model = TokensModel(
            grown_model.tokens + chunk, grown_model.labels + [None] * len(chunk)
        )
        done = done + hasher.hash_new_blocks(grown, done)
        steps += 1
    assert done == reference_keys(grown_model, block_size, algorithm, namespace, salt, adapter)
    return 3 + steps


# == BlockPool ==================================================================


@dataclass
class PoolModel:
    """The pool as lists: free queue front first, ref counts, keys, a dict table."""

    num_blocks: int
    block_size: int
    free: list[int] = field(default_factory=list)
    ref: list[int] = field(default_factory=list)
    key: list[bytes | None] = field(default_factory=list)
    table: dict[bytes, int] = field(default_factory=dict)
    events: list[PoolEvent] = field(default_factory=list)
    evicted: list[tuple[int, bytes]] = field(default_factory=list)
    num_evictions: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        self.ref = [0] * self.num_blocks
        self.key = [None] * self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        taken, self.free = self.free[:n], self.free[n:]
        lost = []
        for block in taken:
            self.ref[block] = 1
            old = self.key[block]
            if old is not None:
                del self.table[old]
                self.key[block] = None
                lost.append((block, old))
        if lost:
            self.num_evictions += len(lost)
            self.events.append(BlockRemoved(tuple(BlockHash(k) for _, k in lost)))
            self.evicted += lost
        return taken

    def touch(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1

    def release(self, blocks: list[int]) -> None:
        front: list[int] = []
        back: list[int] = []
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (back if self.key[block] is not None else front).append(block)
        self.free = front + self.free + back

    def cache(self, blocks: list[int], keys: list[bytes], num_cached: int, num_full: int) -> int:
        stored: list[int] = []
        for index in range(num_cached, num_full):
            block, key = blocks[index], keys[index]
            if self.key[block] is None and key not in self.table:
                self.table[key] = block
                self.key[block] = key
                stored.append(index)
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] + 1 == index:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            self.events.append(
                BlockStored(
                    tuple(BlockHash(keys[i]) for i in run),
                    BlockHash(keys[run[0] - 1]) if run[0] > 0 else None,
                    len(run) * self.block_size,
                    self.block_size,
                )
            )
        return len(stored)

    def hit(self, keys: list[bytes], cap: int) -> list[int]:
        out = []
        for key in keys[:cap]:
            if key not in self.table:
                break
            out.append(self.table[key])
        return out

    def reset(self) -> bool:
        if len(self.free) != self.num_blocks:
            return False
        lost = [(block, key) for key, block in self.table.items()]
        for block, _ in lost:
            self.key[block] = None
        self.table = {}
        self.events.append(AllBlocksCleared())
        self.evicted += lost
        return True


def assert_pool_matches(
    pool: BlockPool, model: PoolModel, evicted: list[tuple[int, bytes]]
) -> None:
    assert [b.block_id for b in pool.free_block_queue] == model.free
    assert [b.ref_cnt for b in pool.blocks] == model.ref
    assert [b.block_hash for b in pool.blocks] == model.key
    assert {k: b.block_id for k, b in pool.hash_to_block.items()} == model.table
    assert pool.num_free_blocks == len(model.free)
    assert pool.num_cached_blocks == len(model.table)
    assert pool.num_evictions == model.num_evictions
    assert evicted == model.evicted


def check_pool(rng: random.Random) -> int:
    """A random sequence of requests against one pool and the model."""
    num_blocks = rng.randint(1, 10)
    block_size = rng.randint(1, 4)
    pool = BlockPool(num_blocks, block_size)
    model = PoolModel(num_blocks, block_size)
    evicted: list[tuple[int, bytes]] = []
    pool.add_eviction_listener(lambda block, key: evicted.append((block, key)))
    key_space = [hashlib.sha256(bytes([i])).digest() for i in range(rng.randint(2, 12))]
    # A request: its blocks (first first) and the keys it would give them.
    requests: list[tuple[list[int], list[bytes], int]] = []
    num_ops = rng.randint(1, 40)
    for _ in range(num_ops):
        op = rng.choices(range(9), weights=(3, 0, 3, 4, 2, 0, 1, 1, 1))[0]
        if op <= 1:  # a new request: look up a chain, touch the hit, allocate the rest
            chain_len = rng.randint(0, num_blocks + 1)
            start = rng.randrange(len(key_space))
            keys = [key_space[(start + i) % len(key_space)] for i in range(chain_len)]
            cap = chain_len if rng.random() < 0.7 else rng.randint(0, chain_len)
            hit = pool.find_longest_cache_hit([BlockHash(k) for k in keys], cap)
            hit_ids = model.hit(keys, cap)
            assert [b.block_id for b in hit] == hit_ids
            if rng.random() < 0.5:
                pool.touch(hit)
                model.touch(hit_ids)
                requests.append((hit_ids, keys, len(hit_ids)))
        elif op == 2:
            n = rng.randint(0, num_blocks + 1)
            got = pool.allocate(n)
            want = model.allocate(n)
            assert (None if got is None else [b.block_id for b in got]) == want
            if want is not None:
                # Mostly a chain (as prompts give), sometimes any keys (duplicates too).
                start = rng.randrange(len(key_space))
                keys = [key_space[(start + i) % len(key_space)] for i in range(len(want))]
                if rng.random() < 0.2:
                    keys = [rng.choice(key_space) for _ in want]
                requests.append((want, keys, 0))
        elif op == 3 and requests:  # register some of a request's blocks
            index = rng.randrange(len(requests))
            blocks, keys, num_cached = requests[index]
            num_full = min(len(blocks), len(keys))
            if rng.random() < 0.3:
                num_full = rng.randint(num_cached, num_full)
            consistent = all(
                model.key[blocks[i]] in (None, keys[i]) for i in range(num_cached, num_full)
            )
            distinct = len(set(blocks[num_cached:num_full])) == num_full - num_cached
            in_use = all(model.ref[blocks[i]] > 0 for i in range(num_cached, num_full))
            if not (consistent and distinct and in_use):
                continue
            got_n = pool.cache_full_blocks(
                [pool.blocks[b] for b in blocks], [BlockHash(k) for k in keys], num_cached, num_full
            )
            assert got_n == model.cache(blocks, keys, num_cached, num_full)
            requests[index] = (blocks, keys, num_full)
        elif op in (4, 5) and requests:  # finish a request, last block first
            blocks, _, _ = requests.pop(rng.randrange(len(requests)))
            pool.free([pool.blocks[b] for b in reversed(blocks)])
            model.release(list(reversed(blocks)))
        elif op == 6:  # a double free: refused, nothing changes
            idle = [b for b in range(num_blocks) if model.ref[b] == 0]
            held = [b for blocks, _, _ in requests for b in blocks]
            if idle:
                victims = [*held[:2], rng.choice(idle)]
                with pytest.raises(RuntimeError, match="freed more often than allocated"):
                    pool.free([pool.blocks[b] for b in victims])
        elif op == 7:
            assert pool.reset() == model.reset()
        else:
            assert pool.take_events() == model.events
            model.events = []
        assert_pool_matches(pool, model, evicted)
    assert pool.take_events() == model.events
    return num_ops


# == TensorStore ==================================================================

# Entries exercising each row width: 12-byte rows (int32 moves), 16-byte rows
# (complex128 moves), bfloat16 rows and a 2-D row shape.
ENTRIES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((3,), torch.float32),
    "b": ((4,), torch.float32),
    "c": ((8,), torch.bfloat16),
    "d": ((2, 3), torch.int16),
}


@dataclass
class StoreModel:
    num_blocks: int
    block_size: int
    rows: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)
    stamps: dict[str, list[bytes | None]] = field(default_factory=dict)
    filled: dict[str, list[int]] = field(default_factory=dict)

    def add(self, name: str, width: int) -> None:
        self.rows[name] = np.zeros((self.num_blocks * self.block_size, width), dtype=np.float64)
        self.stamps[name] = [None] * self.num_blocks
        self.filled[name] = [0] * self.num_blocks

    def write(
        self, name: str, values: np.ndarray[Any, Any], slots: list[int], keys: Mapping[int, bytes]
    ) -> tuple[list[int], list[int]]:
        bs = self.block_size
        self.rows[name][slots] = values
        filled = self.filled[name]
        touched: list[int] = []
        index = 0
        while index < len(slots):
            block, offset = divmod(slots[index], bs)
            length = 1
            while (
                index + length < len(slots)
                and slots[index + length] == slots[index + length - 1] + 1
                and slots[index + length] % bs != 0
            ):
                length += 1
            if offset == 0:
                filled[block] = length
            elif filled[block] == offset:
                filled[block] = offset + length
            else:
                filled[block] = -1
            if block not in touched:
                touched.append(block)
            index += length
        stamped, incomplete = [], []
        for block in touched:
            key = keys.get(block)
            if key is not None and filled[block] == bs:
                self.stamps[name][block] = key
                stamped.append(block)
            else:
                self.stamps[name][block] = None
                if key is not None:
                    incomplete.append(block)
        return sorted(stamped), sorted(incomplete)

    def evict(self, block: int) -> None:
        for name in self.rows:
            self.stamps[name][block] = None
            self.filled[name][block] = 0

    def num_valid(self, names: list[str], blocks: Sequence[int], keys: Sequence[bytes]) -> int:
        for index, (block, key) in enumerate(zip(blocks, keys, strict=True)):
            if any(self.stamps[name][block] != key for name in names):
                return index
        return len(blocks)

    def block_rows(self, name: str, blocks: list[int]) -> np.ndarray[Any, Any]:
        bs = self.block_size
        slots = [b * bs + o for b in blocks for o in range(bs)]
        return self.rows[name][slots]


def _values(rng: random.Random, n: int, width: int) -> np.ndarray[Any, Any]:
    # Small integers: exact in every dtype used, so the model compares exactly.
    values = np.zeros((n, width), dtype=np.float64)
    for index in range(n):
        values[index] = [rng.randint(-100, 100) for _ in range(width)]
    return values


def _tensor(
    values: np.ndarray[Any, Any], shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    return torch.from_numpy(values).to(dtype).reshape(len(values), *shape)


def _random_slots(rng: random.Random, num_blocks: int, bs: int) -> list[int]:
    kind = rng.randrange(4)
    if kind == 0:  # whole blocks
        blocks = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
        return [b * bs + o for b in blocks for o in range(bs)]
    if kind == 1:  # one run of consecutive slots, across block edges
        start = rng.randrange(num_blocks * bs)
        return list(range(start, rng.randint(start + 1, num_blocks * bs)))
    if kind == 2:  # a request's next tokens in its blocks, from some position
        blocks = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
        first = rng.randrange(len(blocks) * bs)
        last = rng.randint(first + 1, len(blocks) * bs)
        return [blocks[p // bs] * bs + p % bs for p in range(first, last)]
    return rng.sample(range(num_blocks * bs), rng.randint(1, num_blocks * bs))


def _assert_store_matches(store: TensorStore, model: StoreModel, names: list[str]) -> None:
    num_slots = model.num_blocks * model.block_size
    for name in names:
        shape, dtype = ENTRIES[name]
        stamps = [store.stamp_of(name, b) for b in range(model.num_blocks)]
        assert stamps == model.stamps[name]
        assert [store.filled_of(name, b) for b in range(model.num_blocks)] == model.filled[name]
        cache = store.cached_rows(name).reshape(num_slots, -1)
        assert torch.equal(cache, _tensor(model.rows[name], (int(np.prod(shape)),), dtype))


def check_store(rng: random.Random) -> int:
    """A random sequence of writes, evictions and reads against one store and the model."""
    num_blocks = rng.randint(1, 6)
    bs = rng.randint(1, 4)
    store = TensorStore(num_blocks, bs)
    model = StoreModel(num_blocks, bs)
    names = rng.sample(sorted(ENTRIES), rng.randint(1, len(ENTRIES)))
    for name in names:
        shape, dtype = ENTRIES[name]
        store.register(name, shape, dtype)
        model.add(name, int(np.prod(shape)))
    key_space = [BlockHash(bytes([i]) * 32) for i in range(4)]
    num_ops = rng.randint(1, 25)
    for _ in range(num_ops):
        op = rng.randrange(8)
        name = rng.choice(names)
        shape, dtype = ENTRIES[name]
        width = int(np.prod(shape))
        if op <= 2:
            slots = _random_slots(rng, num_blocks, bs)
            values = _values(rng, len(slots), width)
            keys = {b: rng.choice(key_space) for b in range(num_blocks) if rng.random() < 0.7}
            pad = rng.randrange(3)
            form = rng.randrange(3)
            mapping: Any = slots + [0] * pad
            if form == 1:
                mapping = np.array(mapping, dtype=np.int64)
            elif form == 2:
                mapping = torch.tensor(mapping, dtype=rng.choice((torch.int32, torch.int64)))
            rows = _tensor(np.vstack([values, np.zeros((pad, width))]), shape, dtype)
            result = store.write(
                name, rows, mapping, block_keys=keys, num_tokens=len(slots) if pad else None
            )
            want = model.write(name, values, slots, keys)
            assert (sorted(result.stamped_block_ids), sorted(result.incomplete_block_ids)) == want
            assert result.num_rows == len(slots)
        elif op == 3:
            blocks = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
            keys_list = [rng.choice(key_space) for _ in blocks]
            values = _values(rng, len(blocks) * bs, width)
            store.write_blocks(name, _tensor(values, shape, dtype), blocks, block_keys=keys_list)
            slots = [b * bs + o for b in blocks for o in range(bs)]
            model.write(name, values, slots, dict(zip(blocks, keys_list, strict=True)))
        elif op == 4:
            block = rng.randrange(num_blocks)
            store.on_block_evicted(block, BlockHash(rng.choice(key_space)))
            model.evict(block)
        elif op == 5:
            blocks = [rng.randrange(num_blocks) for _ in range(rng.randint(0, 3))]
            read_keys: list[bytes] = [
                model.stamps[name][b] or rng.choice(key_space)
                if rng.random() < 0.8
                else key_space[0]
                for b in blocks
            ]
            num_valid = model.num_valid([name], blocks, read_keys)
            stale_before = store.stats.num_stale_reads
            if num_valid == len(blocks):
                got = store.read_blocks(name, blocks, [BlockHash(k) for k in read_keys])
                expected = _tensor(model.block_rows(name, blocks), shape, dtype)
                assert torch.equal(got, expected)
            else:
                with pytest.raises(StaleBlockError) as info:
                    store.read_blocks(name, blocks, [BlockHash(k) for k in read_keys])
                assert info.value.block_index == num_valid
                assert store.stats.num_stale_reads == stale_before + 1
            assert store.probe(blocks, [BlockHash(k) for k in read_keys]) == model.num_valid(
                names, blocks, read_keys
            )
        elif op == 6:
            requests = []
            for index in range(rng.randint(1, 3)):
                hit = [rng.randrange(num_blocks) for _ in range(rng.randint(0, 2))]
                hit_keys = [model.stamps[name][b] or key_space[0] for b in hit]
                requests.append(
                    ScheduledRequest(
                        f"r{index}",
                        rng.randint(0, 3),
                        len(hit) * bs,
                        hit,
                        [BlockHash(k) for k in hit_keys],
                    )
                )
            total = sum(r.num_new_tokens for r in requests)
            new_values = _values(rng, total, width)
            merged = store.read_merged(
                requests, multimodal_outputs={name: _tensor(new_values, shape, dtype), "meta": 1}
            )
            assert merged.passthrough == {"meta": 1}
            start = 0
            for request in requests:
                stop = start + request.num_new_tokens
                valid = model.num_valid(
                    [name], list(request.hit_block_ids), list(request.hit_block_keys)
                ) == len(request.hit_block_ids)
                if valid:
                    expected_values = np.vstack(
                        [
                            model.block_rows(name, list(request.hit_block_ids)),
                            new_values[start:stop],
                        ]
                    )
                    got = merged.tensors[name][request.req_id]
                    assert torch.equal(got, _tensor(expected_values, shape, dtype))
                else:
                    assert request.req_id not in merged.tensors[name]
                    assert request.req_id in [m.req_id for m in merged.misses]
                start = stop
        else:
            blocks = rng.sample(range(num_blocks), rng.randint(0, num_blocks))
            store.invalidate(blocks)
            for block in blocks:
                model.evict(block)
        # Writes and reads touch one entry: check it now, and every entry at the end.
        _assert_store_matches(store, model, names if op in (4, 7) else [name])
    _assert_store_matches(store, model, names)
    return num_ops


# == hypothesis entry points =========================================================

CHECKS: dict[str, Callable[[random.Random], int]] = {
    "annotate_prompt": check_annotate,
    "AnnotatedTokens": check_annotated_tokens,
    "BlockHasher": check_block_hasher,
    "BlockPool": check_pool,
    "TensorStore": check_store,
}

_FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@_FUZZ
@given(st.randoms(use_true_random=False))
def test_annotate_prompt_matches_the_model(rng: random.Random) -> None:
    check_annotate(rng)


@_FUZZ
@given(st.randoms(use_true_random=False))
def test_annotated_tokens_match_the_model(rng: random.Random) -> None:
    check_annotated_tokens(rng)


@_FUZZ
@given(st.randoms(use_true_random=False))
def test_block_hasher_matches_the_documented_bytes(rng: random.Random) -> None:
    check_block_hasher(rng)


@_FUZZ
@given(st.randoms(use_true_random=False))
def test_block_pool_matches_the_model(rng: random.Random) -> None:
    check_pool(rng)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(st.randoms(use_true_random=False))
def test_tensor_store_matches_the_model(rng: random.Random) -> None:
    check_store(rng)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fixed_seeds_run_every_check(name: str) -> None:
    """A few hundred seeded inputs per target, the same on every run."""
    rng = random.Random(f"omnicache-fuzz-{name}")
    assert sum(CHECKS[name](rng) for _ in range(40)) >= 40


def test_the_pool_model_is_not_vacuous() -> None:
    """The pool fuzz reaches hits, evictions, resets and refused double frees."""
    rng = random.Random(7)
    seen: dict[str, int] = {}
    original_hit, original_allocate = PoolModel.hit, PoolModel.allocate

    def hit(self: PoolModel, keys: list[bytes], cap: int) -> list[int]:
        out = original_hit(self, keys, cap)
        seen["hits"] = seen.get("hits", 0) + bool(out)
        return out

    def allocate(self: PoolModel, n: int) -> list[int] | None:
        before = self.num_evictions
        out = original_allocate(self, n)
        seen["evictions"] = seen.get("evictions", 0) + (self.num_evictions - before)
        return out

    PoolModel.hit = hit  # type: ignore[method-assign]
    PoolModel.allocate = allocate  # type: ignore[method-assign]
    try:
        for _ in range(200):
            check_pool(rng)
    finally:
        PoolModel.hit = original_hit  # type: ignore[method-assign]
        PoolModel.allocate = original_allocate  # type: ignore[method-assign]
    assert seen["hits"] > 50
    assert seen["evictions"] > 50


def test_store_and_prompt_fuzz_reach_every_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stamped blocks, valid and stale reads, merged misses, refused prompts."""
    seen: dict[str, int] = {}

    def count(name: str, amount: int = 1) -> None:
        seen[name] = seen.get(name, 0) + amount

    write, read, merged = TensorStore.write, TensorStore.read_blocks, TensorStore.read_merged

    def counted_write(self: TensorStore, *args: Any, **kwargs: Any) -> Any:
        result = write(self, *args, **kwargs)
        count("stamped", len(result.stamped_block_ids))
        count("incomplete", len(result.incomplete_block_ids))
        return result

    def counted_read(self: TensorStore, *args: Any, **kwargs: Any) -> Any:
        try:
            out = read(self, *args, **kwargs)
        except StaleBlockError:
            count("stale")
            raise
        count("read")
        return out

    def counted_merged(self: TensorStore, *args: Any, **kwargs: Any) -> Any:
        out = merged(self, *args, **kwargs)
        count("misses", len(out.misses))
        return out

    monkeypatch.setattr(TensorStore, "write", counted_write)
    monkeypatch.setattr(TensorStore, "read_blocks", counted_read)
    monkeypatch.setattr(TensorStore, "read_merged", counted_merged)
    rng = random.Random(11)
    for _ in range(60):
        check_store(rng)
    assert min(seen.values()) > 10, seen
    assert len(seen) == 5

    refused = 0
    original = annotate_prompt

    def counted_annotate(*args: Any, **kwargs: Any) -> Any:
        nonlocal refused
        try:
            return original(*args, **kwargs)
        except ValueError:
            refused += 1
            raise

    monkeypatch.setitem(globals(), "annotate_prompt", counted_annotate)
    for _ in range(200):
        check_annotate(rng)
    assert 10 < refused < 150


def test_reference_block_keys_match_a_hand_computed_block() -> None:
    """The reference model itself, checked on one block by hand."""
    digest = b"\x07" * 32
    tokens = AnnotatedTokens([5, 6], [TokenRangeAnnotation(1, 1, digest, 2, 4)])
    model = TokensModel([5, 6], [None, (0, digest, 2, 4)])
    root = hashlib.sha256(
        b"\x01\x01\x12\x00\x00\x00omnicache.block/v1"
        b"\x02\x01\x06\x00\x00\x00sha256"
        b"\x03\x01\x00\x00\x00\x00"
        b"\x04\x00\x00\x00\x00\x00"
        b"\x05\x00\x00\x00\x00\x00"
        b"\x06\x02\x08\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00"
    ).digest()
    block = (
        root
        + b"\x05\x00\x00\x00\x06\x00\x00\x00"
        + b"\x01\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\x04\x00\x00\x00\x20\x00\x00\x00"
        + digest
    )
    expected = [hashlib.sha256(block).digest()]
    assert reference_keys(model, 2, "sha256", "", None, None) == expected
    assert BlockHasher(2).hash_blocks(tokens) == expected
