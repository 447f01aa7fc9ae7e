"""Chained block keys over annotated token sequences (scheme ``omnicache.block/v1``).

A prompt is cut into blocks of ``block_size`` tokens; each *full* block gets a
key that covers the key before it, its token ids, and the part of every item
(image, audio clip, ...) whose placeholder run overlaps the block. Equal
prefixes give equal keys; a change in block i changes the keys of block i and
every later block and of no earlier one.

Exact bytes (all integers unsigned little-endian; ``H`` is the hasher's
algorithm, ``D`` its digest size: 32 bytes for sha256 and blake3, 16 for
xxh3_128)::

    root = H(field(1, "omnicache.block/v1") | field(2, algorithm) | field(3, namespace)
             | field(4, cache_salt) | field(5, adapter) | field(6, block_size))

    field:  +---------+----------+-------------+-------------------------+
            | tag: u8 | type: u8 | length: u32 | payload: length bytes   |
            +---------+----------+-------------+-------------------------+
            type 0: None (length 0, no payload)
            type 1: str (payload: UTF-8)
            type 2: int (length 8, payload: u64)

    key(i) = H(parent | tokens | record ... record)

            +--------------------+---------------------------+------------------------+
            | parent: D bytes    | tokens: block_size x u32  | one record per         |
            | key(i-1), or root  | (the block's token ids)   | annotation overlapping |
            | for the 1st block  |                           | the block, in order    |
            +--------------------+---------------------------+------------------------+

    record: +------------+------------+-----------------+-----------------+-------------+-------+
            | start: u32 | count: u32 | content_offset: | content_length: | hash_len L: | hash: |
            | in block   |            | u32             | u32             | u32         | L B   |
            +------------+------------+-----------------+-----------------+-------------+-------+

``start`` and ``count`` are the annotation clipped to the block (its tokens
``[start, start + count)`` of the block), ``content_offset`` the item
position of the first of them, ``content_length`` the item's whole run length
(`TokenRangeAnnotation.clip`).

Lookahead (``lookahead`` = L > 0, vLLM's ``num_hash_lookahead_tokens`` for
speculative decoding): the root gets one more field, ``field(7, L)`` after
``field(6, block_size)``, and key(i) covers the block's *window*, its tokens
and the L tokens after it: ``tokens`` is ``(block_size + L) x u32`` (tokens
``[i * block_size, (i + 1) * block_size + L)``) and the records are those of
the annotations clipped to that window (``start`` counted from the window's
first token). A block gets its key only once its window is complete. Without
lookahead (L = 0) the root has six fields and the window is the block, as
above, so those keys are unchanged.

NOTE: the encoding is injective. Within one chain ``D``, ``block_size`` and ``L``
are fixed (all are in the root), so parent and tokens have a fixed length,
and each record states its own length, so a preimage parses one way only: a
block without annotations is exactly ``D + 4 * (block_size + L)`` bytes and any
record makes it longer. The root's fields are tagged, typed and framed, so a
salt and an adapter given the same string differ, and None differs from "".

Keys are ``bytes`` (`BlockHash`); routers and event consumers that want text
or an int take `block_hash_hex` or `block_hash_low64`. Golden vectors in
``tests/vectors/block_v1.json`` (``scripts/make_block_vectors.py``) pin these
bytes; a change to them is a new scheme version.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any, NewType

import blake3
import xxhash

from hashing import ALGORITHMS, Algorithm, digest_size
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.checks import check_int, check_optional_str, check_str, type_name

__all__ = [
    "DEFAULT_BLOCK_ALGORITHM",
    "SCHEME",
    "BlockHash",
    "BlockHasher",
    "block_hash_hex",
    "block_hash_low64",
]

BlockHash = NewType("BlockHash", bytes)

SCHEME = "omnicache.block/v1"

# sha256 is the default because per-call cost dominates on the ~100-byte
# preimages of a 16-token block (32-byte parent + 64 bytes of ids), and there
# OpenSSL's SHA-NI sha256 beats blake3-py: 0.35-0.39 µs against 0.49-0.58 µs a
# call on the 2-core EPYC (xxh3_128: 0.06-0.12 µs, but not collision
# resistant); benchmarks/bench_block_hash.py prints the per-call figures.
DEFAULT_BLOCK_ALGORITHM: Algorithm = "sha256"

_FIELD = struct.Struct("<BBI")
_U64 = struct.Struct("<Q")
_RECORD_HEAD = struct.Struct("<III")  # start, count, content_offset
_RECORD_TAIL = struct.Struct("<II")  # content_length, hash_len
_TYPE_NONE, _TYPE_STR, _TYPE_INT = 0, 1, 2
_TAG_SCHEME, _TAG_ALGORITHM, _TAG_NAMESPACE, _TAG_SALT, _TAG_ADAPTER, _TAG_BLOCK_SIZE = range(1, 7)
_TAG_LOOKAHEAD = 7
_MAX_BLOCK_SIZE = 2**32 - 1

# Per algorithm: an incremental constructor (``new(data).digest()``) and, where
# the library has one, a one-shot digest function, which saves a call per block.
_DIGESTERS: dict[str, tuple[Callable[[bytes], Any], Callable[[bytes], bytes] | None]] = {
    "sha256": (hashlib.sha256, None),
    "blake3": (blake3.blake3, None),
    "xxh3_128": (xxhash.xxh3_128, xxhash.xxh3_128_digest),
}
if set(_DIGESTERS) != set(ALGORITHMS):  # pragma: no cover - guards an edit to either list
    raise RuntimeError(f"block digesters {sorted(_DIGESTERS)} != algorithms {ALGORITHMS}")

_token_end = attrgetter("token_end")


def block_hash_hex(key: bytes, /) -> str:
    """A key as lowercase hex (two characters per byte, first byte first)."""
    if not isinstance(key, bytes):
        raise TypeError(f"key: expected bytes, found {type_name(key)}")
    return key.hex()


def block_hash_low64(key: bytes, /) -> int:
    """The low 64 bits of a key read as a big-endian unsigned integer.

    That is its last 8 bytes, most significant first, in ``[0, 2**64)``: the
    convention vLLM uses for int block hashes in KV cache events, so a router
    that reads those events matches these keys. Two keys that differ only in
    their first ``D - 8`` bytes share this value: use it to route, never as a
    cache key.
    """
    if not isinstance(key, bytes):
        raise TypeError(f"key: expected bytes, found {type_name(key)}")
    if len(key) < 8:
        raise ValueError(f"key: expected at least 8 bytes, found {len(key)}")
    return int.from_bytes(key[-8:], "big")


def _field(tag: int, value: str | int | None, name: str) -> bytes:
    if value is None:
        return _FIELD.pack(tag, _TYPE_NONE, 0)
    if isinstance(value, str):
        try:
            payload = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name}: expected a str encodable as UTF-8, found {value!r}") from exc
        return _FIELD.pack(tag, _TYPE_STR, len(payload)) + payload
    return _FIELD.pack(tag, _TYPE_INT, _U64.size) + _U64.pack(value)


def _describe_key(key: object) -> str:
    if isinstance(key, bytes):
        return f"{len(key)} bytes"
    return type(key).__name__


class BlockHasher:
    """Computes chained keys of full token blocks for one configuration.

    Args:
        block_size: tokens per block, an int >= 1.
        algorithm: "sha256" (default), "blake3", or "xxh3_128". The default
            is the faster collision-resistant one on a block's ~100-byte
            preimage, where per-call cost dominates: sha256 0.35-0.39 µs a
            call, blake3 0.49-0.58 µs (2-core EPYC with SHA-NI; the benchmark
            prints both). xxh3_128 (0.06-0.12 µs, 16-byte keys) is NOT
            collision resistant: only for trusted single-tenant deployments.
        namespace: what the keys are for, such as the model id; chains in
            two namespaces never share a key.
        cache_salt: a tenant's secret salt; None (no salt) differs from "".
        adapter: the adapter (LoRA) id; None (no adapter) differs from "".
        lookahead: tokens after each block that its key covers as well (vLLM's
            ``num_hash_lookahead_tokens``); 0, the default, for none. A block
            then gets a key only once those tokens exist.

    All of these enter the root (`root`), from which every chain starts, so
    tenants, adapters, models and block sizes never share a chain.
    """

    __slots__ = (
        "_adapter",
        "_algorithm",
        "_block_size",
        "_cache_salt",
        "_digest_size",
        "_lookahead",
        "_namespace",
        "_new",
        "_oneshot",
        "_root",
    )

    def __init__(
        self,
        block_size: int = 16,
        *,
        algorithm: Algorithm = DEFAULT_BLOCK_ALGORITHM,
        namespace: str = "",
        cache_salt: str | None = None,
        adapter: str | None = None,
        lookahead: int = 0,
    ) -> None:
        check_int("block_size", block_size, minimum=1, maximum=_MAX_BLOCK_SIZE)
        check_int("lookahead", lookahead, minimum=0, maximum=_MAX_BLOCK_SIZE - block_size)
        self._digest_size = digest_size(algorithm)  # ValueError for an unknown algorithm
        check_str("namespace", namespace)
        self._algorithm = algorithm
        self._block_size = block_size
        self._namespace = namespace
        self._cache_salt = check_optional_str("cache_salt", cache_salt)
        self._adapter = check_optional_str("adapter", adapter)
        self._lookahead = lookahead
        self._new, self._oneshot = _DIGESTERS[algorithm]
        preimage = b"".join(
            (
                _field(_TAG_SCHEME, SCHEME, "scheme"),
                _field(_TAG_ALGORITHM, algorithm, "algorithm"),
                _field(_TAG_NAMESPACE, namespace, "namespace"),
                _field(_TAG_SALT, cache_salt, "cache_salt"),
                _field(_TAG_ADAPTER, adapter, "adapter"),
                _field(_TAG_BLOCK_SIZE, block_size, "block_size"),
            )
        )
        if lookahead:
            preimage += _field(_TAG_LOOKAHEAD, lookahead, "lookahead")
        self._root = BlockHash(self._new(preimage).digest())

    @property
    def root(self) -> BlockHash:
        """The chain's seed: the parent of every first block."""
        return self._root

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def algorithm(self) -> Algorithm:
        return self._algorithm

    @property
    def digest_size(self) -> int:
        """Bytes in every key: 32 (sha256, blake3) or 16 (xxh3_128)."""
        return self._digest_size

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def cache_salt(self) -> str | None:
        return self._cache_salt

    @property
    def adapter(self) -> str | None:
        return self._adapter

    @property
    def lookahead(self) -> int:
        """Tokens after each block that its key covers (0: none)."""
        return self._lookahead

    def __repr__(self) -> str:
        # NOTE: a salt isolates a tenant; it does not belong in logs.
        salt = None if self._cache_salt is None else "<set>"
        lookahead = f", lookahead={self._lookahead}" if self._lookahead else ""
        return (
            f"BlockHasher(block_size={self._block_size}, algorithm={self._algorithm!r}, "
            f"namespace={self._namespace!r}, cache_salt={salt}, adapter={self._adapter!r}"
            f"{lookahead})"
        )

    def hash_blocks(
        self,
        tokens: AnnotatedTokens | Iterable[int],
        /,
        *,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Keys of the full blocks of ``tokens`` from ``start_block`` on.

        Hashing blocks k and onward with ``parent=key(k-1)`` gives the same
        keys as hashing everything at once; so does hashing
        ``tokens[k * block_size:]`` with ``parent=key(k-1)``.

        Args:
            tokens: an AnnotatedTokens, or token ids without annotations.
            parent: the key of block ``start_block - 1``; None means the root
                and is allowed only when ``start_block`` is 0.
            start_block: the first block to key, at most the number of full
                blocks.

        Returns:
            One key per full block ``start_block, start_block + 1, ...``; a
            trailing partial block gets none, and with ``lookahead`` (L) nor
            does a block followed by fewer than L tokens.
        """
        if not isinstance(tokens, AnnotatedTokens):
            tokens = AnnotatedTokens(tokens)
        block_size = self._block_size
        num_full_blocks = max(0, len(tokens) - self._lookahead) // block_size
        check_int("start_block", start_block)
        if not 0 <= start_block <= num_full_blocks:
            raise ValueError(
                f"start_block: expected an int in [0, {num_full_blocks}] (full blocks of "
                f"{block_size} in {len(tokens)} tokens), found {start_block}"
            )
        if parent is None:
            if start_block != 0:
                raise ValueError(
                    f"parent: expected the key of block {start_block - 1} for "
                    f"start_block={start_block}, found None"
                )
            parent = self._root
        elif not isinstance(parent, bytes):
            raise TypeError(f"parent: expected bytes or None, found {type_name(parent)}")
        elif len(parent) != self._digest_size:
            raise ValueError(
                f"parent: expected a {self._digest_size}-byte {self._algorithm} key, "
                f"found {len(parent)} bytes"
            )
        return self._chain(tokens, parent, start_block, num_full_blocks)

    def hash_new_blocks(
        self, tokens: AnnotatedTokens, /, block_hashes: Sequence[BlockHash]
    ) -> list[BlockHash]:
        """Keys of the full blocks of ``tokens`` that ``block_hashes`` does not cover yet.

        The decode path: after appending sampled tokens, only the blocks they
        completed are hashed (none until a block fills, at O(1) cost).

        Args:
            tokens: the whole sequence so far.
            block_hashes: the keys of its first ``len(block_hashes)`` blocks,
                as this hasher returned them.

        Returns:
            The keys of blocks ``len(block_hashes), ...``, often empty.
        """
        num_done = len(block_hashes)
        block_size = self._block_size
        num_full_blocks = max(0, len(tokens) - self._lookahead) // block_size
        if num_done >= num_full_blocks:
            if num_done > num_full_blocks:
                raise ValueError(
                    f"block_hashes: expected at most {num_full_blocks} keys (full blocks of "
                    f"{block_size} in {len(tokens)} tokens), found {num_done}"
                )
            return []
        if not isinstance(tokens, AnnotatedTokens):
            raise TypeError(f"tokens: expected an AnnotatedTokens, found {type(tokens).__name__}")
        if num_done == 0:
            return self._chain(tokens, self._root, 0, num_full_blocks)
        parent = block_hashes[-1]
        if not isinstance(parent, bytes) or len(parent) != self._digest_size:
            raise ValueError(
                f"block_hashes[-1]: expected a {self._digest_size}-byte {self._algorithm} key, "
                f"found {_describe_key(parent)}"
            )
        if num_full_blocks - num_done == 1 and not self._lookahead:
            return [self._one_block(tokens, parent, num_done)]
        return self._chain(tokens, parent, num_done, num_full_blocks)

    def _one_block(self, tokens: AnnotatedTokens, parent: bytes, block: int) -> BlockHash:
        """Key of one block: `_chain` for a single block, minus its per-call setup."""
        block_size = self._block_size
        start = block * block_size
        preimage = parent + tokens.packed(start, start + block_size)
        annotations = tokens.annotations
        if annotations:
            last = annotations[-1]
            if last.token_index + last.token_count > start:
                records = self._records(annotations, block, 1)
                if records is not None:
                    preimage += records[0]
        oneshot = self._oneshot
        if oneshot is not None:
            return BlockHash(oneshot(preimage))
        return BlockHash(self._new(preimage).digest())

    def _chain(
        self, tokens: AnnotatedTokens, parent: bytes, start_block: int, num_full_blocks: int
    ) -> list[BlockHash]:
        block_size = self._block_size
        num_blocks = num_full_blocks - start_block
        if num_blocks == 0:
            return []
        if self._lookahead:
            return self._chain_windows(tokens, parent, start_block, num_full_blocks)
        data = tokens.packed(start_block * block_size, num_full_blocks * block_size)
        records = self._records(tokens.annotations, start_block, num_blocks)
        step = 4 * block_size
        offsets = range(0, len(data), step)
        # list[Any]: wrapping each key in BlockHash() would cost a call per block.
        keys: list[Any] = []
        append = keys.append
        oneshot = self._oneshot
        new = self._new
        # NOTE: four copies of one loop: at ~0.4 µs a block, an extra call or
        # an empty concatenation per block would cost 5-15%.
        if records is None:
            if oneshot is not None:
                for offset in offsets:
                    parent = oneshot(parent + data[offset : offset + step])
                    append(parent)
            else:
                for offset in offsets:
                    parent = new(parent + data[offset : offset + step]).digest()
                    append(parent)
        elif oneshot is not None:
            for offset, record in zip(offsets, records, strict=True):
                parent = oneshot(parent + data[offset : offset + step] + record)
                append(parent)
        else:
            for offset, record in zip(offsets, records, strict=True):
                parent = new(parent + data[offset : offset + step] + record).digest()
                append(parent)
        return keys

    def _chain_windows(
        self, tokens: AnnotatedTokens, parent: bytes, start_block: int, num_full_blocks: int
    ) -> list[BlockHash]:
        """`_chain` with lookahead: each key covers its block and the next L tokens."""
        block_size = self._block_size
        span = block_size + self._lookahead
        new = self._new
        keys: list[BlockHash] = []
        for block in range(start_block, num_full_blocks):
            start = block * block_size
            preimage = parent + tokens.packed(start, start + span)
            for ann in tokens.clipped_annotations(start, start + span):
                content_hash = ann.content_hash
                preimage += (
                    _RECORD_HEAD.pack(ann.token_index, ann.token_count, ann.content_offset)
                    + _RECORD_TAIL.pack(ann.content_length, len(content_hash))
                    + content_hash
                )
            parent = new(preimage).digest()
            keys.append(BlockHash(parent))
        return keys

    def _records(
        self,
        annotations: tuple[TokenRangeAnnotation, ...],
        start_block: int,
        num_blocks: int,
    ) -> list[bytes] | None:
        """The annotation records of blocks ``start_block ...``, or None when there are none."""
        block_size = self._block_size
        first_token = start_block * block_size
        stop_token = first_token + num_blocks * block_size
        if not annotations:
            return None
        last = annotations[-1]
        if last.token_index + last.token_count <= first_token:
            return None
        records = [b""] * num_blocks
        pack_head = _RECORD_HEAD.pack
        # Annotations are sorted and disjoint, so their ends are sorted too.
        first = bisect_right(annotations, first_token, key=_token_end)
        for ann in annotations[first:]:
            token_index = ann.token_index
            if token_index >= stop_token:
                break
            # Clip to the blocks being hashed; block starts are re-based below.
            lo_token = max(token_index, first_token)
            hi_token = min(token_index + ann.token_count, stop_token)
            content_hash = ann.content_hash
            # The part of a record that is the same in every block of this item.
            tail = _RECORD_TAIL.pack(ann.content_length, len(content_hash)) + content_hash
            offset_shift = ann.content_offset - token_index
            # Blocks the item covers whole (most of them), then the partial ends.
            inner_lo = -(-lo_token // block_size)
            inner_hi = hi_token // block_size
            if inner_lo < inner_hi:
                records[inner_lo - start_block : inner_hi - start_block] = [
                    pack_head(0, block_size, block_start + offset_shift) + tail
                    for block_start in range(
                        inner_lo * block_size, inner_hi * block_size, block_size
                    )
                ]
            ends: tuple[tuple[int, int], ...]
            if inner_lo <= inner_hi:
                ends = ((lo_token, inner_lo * block_size), (inner_hi * block_size, hi_token))
            else:  # inside one block, touching neither of its edges
                ends = ((lo_token, hi_token),)
            for lo, hi in ends:
                if lo >= hi:
                    continue
                block = lo // block_size
                block_start = block * block_size
                records[block - start_block] += (
                    pack_head(lo - block_start, hi - lo, lo + offset_shift) + tail
                )
        return records
