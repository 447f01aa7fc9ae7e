"""Token sequences annotated with the multimodal content behind placeholder runs.

A multimodal prompt stands for an image or an audio clip with a run of
placeholder tokens. Two prompts can share those placeholder ids and still mean
different things, so each run carries a `TokenRangeAnnotation`: the digest of
the item, and which part of the item the run is. `AnnotatedTokens` keeps the
token ids and their annotations together, immutably, so that slicing a
sequence into blocks also slices the annotations, and a block key can cover
exactly the part of each item that lies inside the block.
"""

from __future__ import annotations

import operator
import sys
import threading
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import NamedTuple, NoReturn, overload

__all__ = [
    "MAX_TOKEN_ID",
    "AnnotatedTokens",
    "TokenBlock",
    "TokenRangeAnnotation",
]

# Token ids are stored as unsigned 32-bit ints; see AnnotatedTokens.
MAX_TOKEN_ID = 2**32 - 1
_TYPECODE = "I" if array("I").itemsize == 4 else "L"
if array(_TYPECODE).itemsize != 4:  # pragma: no cover - no such CPython platform known
    raise ImportError("omnicache needs a 4-byte unsigned array typecode ('I' or 'L')")
_LITTLE_ENDIAN = sys.byteorder == "little"

# NOTE: extending a sequence appends in place to a buffer that older, shorter
# views share (they only ever read their own prefix). The lock makes "is this
# view the buffer's full length? then append" one step, so two threads that
# extend the same view never both append to the shared buffer.
_APPEND_LOCK = threading.Lock()


class TokenRangeAnnotation(NamedTuple):
    """Which part of which item a run of tokens stands for.

    Tokens ``[token_index, token_index + token_count)`` carry positions
    ``[content_offset, content_offset + token_count)`` of an item whose whole
    placeholder run is ``content_length`` tokens long and whose digest is
    ``content_hash`` (a `hashing.ContentHash` in practice).

    An annotation for a whole item has ``content_offset == 0`` and
    ``token_count == content_length``; `clip` cuts it into the parts that fall
    into blocks, and each part keeps ``content_length``, so that the first 8
    tokens of a 16-token item never look like a whole 8-token item.

    Example: an image whose placeholder run is 10 tokens long sits at tokens
    6..15 of a prompt cut into blocks of 8 tokens.

    >>> image = TokenRangeAnnotation(6, 10, b"img", 0, 10)
    >>> image.clip(0, 8)  # tokens 6, 7 of block 0 are image positions 0, 1
    TokenRangeAnnotation(token_index=6, token_count=2, content_hash=b'img', \
content_offset=0, content_length=10)
    >>> image.clip(8, 16)  # all of block 1 is image positions 2..9
    TokenRangeAnnotation(token_index=0, token_count=8, content_hash=b'img', \
content_offset=2, content_length=10)
    >>> image.clip(16, 24) is None  # block 2 holds none of the image
    True
    """

    token_index: int
    token_count: int
    content_hash: bytes
    content_offset: int
    content_length: int

    @property
    def token_end(self) -> int:
        """One past the last token of the run: ``token_index + token_count``."""
        return self.token_index + self.token_count

    def clip(self, start: int, end: int) -> TokenRangeAnnotation | None:
        """The part of this run inside tokens ``[start, end)``, re-based to ``start``.

        Args:
            start: first token of the window (for example a block's first token).
            end: one past the last token of the window; ``end >= start``.

        Returns:
            The overlap with ``token_index`` counted from ``start`` and
            ``content_offset`` advanced by the tokens cut off at the front, or
            None when the run and the window do not overlap.
        """
        if start < 0 or end < start:
            raise ValueError(f"expected a window 0 <= start <= end, found [{start}, {end})")
        lo = max(start, self.token_index)
        hi = min(end, self.token_index + self.token_count)
        if lo >= hi:
            return None
        return TokenRangeAnnotation(
            lo - start,
            hi - lo,
            self.content_hash,
            self.content_offset + (lo - self.token_index),
            self.content_length,
        )


class TokenBlock(NamedTuple):
    """One full block: its token ids and the annotations clipped to it."""

    token_ids: tuple[int, ...]
    annotations: tuple[TokenRangeAnnotation, ...]


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pack_token_ids(token_ids: Iterable[int]) -> array[int]:
    """Token ids as a fresh uint32 array; ValueError names the first bad id."""
    kind = type(token_ids)
    if kind is list or kind is tuple:  # the common case, checked first for decode steps
        try:
            return array(_TYPECODE, token_ids)
        except (OverflowError, TypeError):
            _raise_bad_token_id(token_ids)
    if isinstance(token_ids, AnnotatedTokens):
        return token_ids._buf[: token_ids._num_tokens]
    # NOTE: array() would reinterpret bytes as raw machine words and iterate a
    # str by character; neither is a sequence of token ids.
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            "token_ids: expected a list, tuple, range, array or other iterable of int, "
            f"found {type(token_ids).__name__}"
        )
    if not isinstance(token_ids, (list, tuple, range, array)):
        token_ids = list(token_ids)
    try:
        return array(_TYPECODE, token_ids)
    except (OverflowError, TypeError):
        _raise_bad_token_id(token_ids)


def _raise_bad_token_id(token_ids: Iterable[int]) -> NoReturn:
    for index, token_id in enumerate(token_ids):
        try:
            value = operator.index(token_id)
        except TypeError:
            value = -1
        if not 0 <= value <= MAX_TOKEN_ID:
            raise ValueError(
                f"token_ids[{index}]: expected an int in [0, {MAX_TOKEN_ID}], "
                f"found {_describe(token_id)}"
            ) from None
    raise RuntimeError("array() rejected token ids that each passed validation")


def _check_annotations(
    annotations: tuple[TokenRangeAnnotation, ...], num_tokens: int
) -> tuple[int, ...]:
    """Validate annotations against a sequence of ``num_tokens``; return their ends."""
    ends: list[int] = []
    prev_end = 0
    for i, ann in enumerate(annotations):
        where = f"annotations[{i}]"
        if not isinstance(ann, TokenRangeAnnotation):
            raise TypeError(f"{where}: expected a TokenRangeAnnotation, found {type(ann).__name__}")
        for name in ("token_index", "token_count", "content_offset", "content_length"):
            value = getattr(ann, name)
            if not _is_int(value):
                raise ValueError(f"{where}.{name}: expected an int, found {_describe(value)}")
        if not isinstance(ann.content_hash, bytes) or not ann.content_hash:
            found = _describe(ann.content_hash)
            raise ValueError(f"{where}.content_hash: expected non-empty bytes, found {found}")
        if ann.token_count < 1:
            raise ValueError(f"{where}.token_count: expected >= 1, found {ann.token_count}")
        if ann.content_offset < 0:
            raise ValueError(f"{where}.content_offset: expected >= 0, found {ann.content_offset}")
        if not 1 <= ann.content_length <= MAX_TOKEN_ID:
            raise ValueError(
                f"{where}.content_length: expected an int in [1, {MAX_TOKEN_ID}], "
                f"found {ann.content_length}"
            )
        if ann.content_offset + ann.token_count > ann.content_length:
            raise ValueError(
                f"{where}: expected content_offset + token_count <= content_length "
                f"({ann.content_length}), found {ann.content_offset} + {ann.token_count} = "
                f"{ann.content_offset + ann.token_count}"
            )
        if ann.token_index < prev_end:
            what = f"end of annotations[{i - 1}]" if i else "start of the sequence"
            raise ValueError(
                f"{where}: expected token_index >= {prev_end} ({what}; annotations are sorted "
                f"and do not overlap), found {ann.token_index}"
            )
        end = ann.token_index + ann.token_count
        if end > num_tokens:
            raise ValueError(
                f"{where}: expected token_index + token_count <= {num_tokens} (number of "
                f"tokens), found {ann.token_index} + {ann.token_count} = {end}"
            )
        ends.append(end)
        prev_end = end
    return tuple(ends)


class AnnotatedTokens:
    """An immutable sequence of token ids with the annotations of its placeholder runs.

    Annotations are validated on construction: each a `TokenRangeAnnotation`,
    sorted by ``token_index``, non-overlapping, inside the sequence, with
    ``content_offset + token_count <= content_length``. A bad one is a
    ValueError naming ``annotations[i]``, what was expected and what was found.

    Token ids are ints in ``[0, MAX_TOKEN_ID]`` (2**32 - 1), stored packed as
    unsigned 32-bit ints in an ``array('I')``; a negative, larger or non-int id
    is a ValueError naming ``token_ids[i]``. Why this storage (32768 ids from a
    Python list, 2-core EPYC under load ~2.4, medians; ``python
    benchmarks/bench_block_hash.py --storage`` reprints them):

    =============  ===========  =============  =========================
    storage        from a list  copy + append  one 16-id block as bytes
    =============  ===========  =============  =========================
    array('I')     0.18 ms      2.6 µs         0.13 µs (slice)
    array('i')     0.52 ms      2.8 µs         0.13 µs
    array('l')     0.56 ms      6.0 µs         0.62 µs (repack to 4 B)
    numpy uint32   0.55 ms      4.9 µs         0.18-0.36 µs
    tuple          0.04 ms      41-83 µs       0.21 µs (struct.pack)
    =============  ===========  =============  =========================

    ``array('I')`` converts a list 3x faster than the other packed forms,
    holds 4 bytes per id (a block of 16 is 64 bytes, so a block key hashes
    ~100 bytes: two SHA-256 compressions), slices to bytes with one copy,
    grows in place (so appends below need no copy at all), and needs no
    numpy. A tuple converts fastest but costs a struct.pack per block and a
    full copy per appended token.

    Appending (``+`` or `extend`) returns a new sequence and leaves this one
    unchanged. NOTE: the new sequence appends in place to the buffer this one
    reads when this one is the buffer's longest view, so a decode loop
    ``tokens = tokens + [next_id]`` costs O(1) amortized rather than a copy of
    the whole prompt per token; every view reads only its own first
    ``len(view)`` ids, so earlier views never change. Prefix slices
    (``tokens[:k]``) share the buffer too; other slices copy their ids.

    Slicing (step 1 only) clips the annotations to the slice. Decoding slices
    the tail of the sequence every step, after the last annotation: that case
    skips the annotations entirely.

    It is a `collections.abc.Sequence` of ints by registration rather than
    inheritance: an ABC base class would route every ``isinstance`` check on
    the decode path through ``ABCMeta.__instancecheck__``.
    """

    __slots__ = ("_annotations", "_buf", "_ends", "_num_tokens")

    _buf: array[int]
    _num_tokens: int
    _annotations: tuple[TokenRangeAnnotation, ...]
    _ends: tuple[int, ...]

    def __init__(
        self,
        token_ids: Iterable[int],
        annotations: Iterable[TokenRangeAnnotation] = (),
    ) -> None:
        """Validate and pack ``token_ids`` and ``annotations``; the inputs are not kept.

        Args:
            token_ids: ints in ``[0, MAX_TOKEN_ID]``: a list, tuple, range,
                array, another AnnotatedTokens (its annotations are not
                taken), or any iterable of ints.
            annotations: sorted, non-overlapping annotations of the
                placeholder runs inside the sequence.
        """
        buf = _pack_token_ids(token_ids)
        anns = tuple(annotations)
        self._ends = _check_annotations(anns, len(buf))
        self._buf = buf
        self._num_tokens = len(buf)
        self._annotations = anns

    @classmethod
    def _from_parts(
        cls,
        buf: array[int],
        num_tokens: int,
        annotations: tuple[TokenRangeAnnotation, ...],
        ends: tuple[int, ...],
    ) -> AnnotatedTokens:
        # NOTE: callers guarantee the invariants __init__ checks.
        self = cls.__new__(cls)
        self._buf = buf
        self._num_tokens = num_tokens
        self._annotations = annotations
        self._ends = ends
        return self

    @property
    def annotations(self) -> tuple[TokenRangeAnnotation, ...]:
        """The annotations, sorted by ``token_index``."""
        return self._annotations

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def __len__(self) -> int:
        return self._num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> AnnotatedTokens: ...

    def __getitem__(self, index: int | slice) -> int | AnnotatedTokens:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._num_tokens)
            if step != 1:
                raise ValueError(f"expected a slice with step 1, found step {step}")
            return self._slice(start, max(start, stop))
        i = operator.index(index)
        num_tokens = self._num_tokens
        if i < 0:
            i += num_tokens
        if not 0 <= i < num_tokens:
            raise IndexError(
                f"token index: expected -{num_tokens} <= index < {num_tokens}, found {index}"
            )
        return self._buf[i]

    def _slice(self, start: int, stop: int) -> AnnotatedTokens:
        ends = self._ends
        if not ends or start >= ends[-1]:
            # Fast path: past the last annotation (every decode step).
            return AnnotatedTokens._from_parts(self._buf[start:stop], stop - start, (), ())
        if start == 0:
            # A prefix shares the buffer and keeps every annotation that ends
            # inside it unchanged; only one can straddle ``stop``.
            num_whole = bisect_right(ends, stop)
            anns = self._annotations[:num_whole]
            new_ends = ends[:num_whole]
            if num_whole < len(ends):
                part = self._annotations[num_whole].clip(0, stop)
                if part is not None:
                    anns += (part,)
                    new_ends += (stop,)
            return AnnotatedTokens._from_parts(self._buf, stop, anns, new_ends)
        anns = self.clipped_annotations(start, stop)
        new_ends = tuple(a.token_index + a.token_count for a in anns)
        return AnnotatedTokens._from_parts(self._buf[start:stop], stop - start, anns, new_ends)

    def clipped_annotations(self, start: int, stop: int) -> tuple[TokenRangeAnnotation, ...]:
        """The annotations overlapping tokens ``[start, stop)``, clipped and re-based to ``start``.

        Args:
            start: first token, ``0 <= start``.
            stop: one past the last token, ``start <= stop``.
        """
        if start < 0 or stop < start:
            raise ValueError(f"expected a window 0 <= start <= stop, found [{start}, {stop})")
        ends = self._ends
        if not ends or start >= ends[-1] or start == stop:
            return ()
        anns = self._annotations
        out: list[TokenRangeAnnotation] = []
        for i in range(bisect_right(ends, start), len(anns)):
            ann = anns[i]
            if ann.token_index >= stop:
                break
            part = ann.clip(start, stop)
            if part is None:
                raise RuntimeError(f"annotations[{i}] overlaps [{start}, {stop}) but clips to None")
            out.append(part)
        return tuple(out)

    def __iter__(self) -> Iterator[int]:
        return islice(self._buf, self._num_tokens)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._buf[: self._num_tokens])

    def __contains__(self, value: object) -> bool:
        return value in self._buf[: self._num_tokens]

    def count(self, value: object) -> int:
        """How many times ``value`` occurs among the token ids."""
        if not isinstance(value, int):
            return 0
        return self._buf[: self._num_tokens].count(value)

    def index(self, value: object, start: int = 0, stop: int | None = None) -> int:
        """The first position of ``value`` in ``[start, stop)``; ValueError if absent."""
        num_tokens = self._num_tokens
        if not isinstance(value, int):
            raise ValueError(f"{value!r} is not in the token ids")
        return self._buf[:num_tokens].index(value, start, num_tokens if stop is None else stop)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AnnotatedTokens):
            return NotImplemented
        return (
            self._num_tokens == other._num_tokens
            and self._annotations == other._annotations
            and self._buf[: self._num_tokens] == other._buf[: other._num_tokens]
        )

    def __hash__(self) -> int:
        return hash((self.packed(), self._annotations))

    def __repr__(self) -> str:
        head = self._buf[: min(self._num_tokens, 8)].tolist()
        more = ", ..." if self._num_tokens > 8 else ""
        return (
            f"AnnotatedTokens(num_tokens={self._num_tokens}, "
            f"token_ids=[{', '.join(map(str, head))}{more}], annotations={self._annotations!r})"
        )

    def tolist(self) -> list[int]:
        """The token ids as a new list."""
        return self._buf[: self._num_tokens].tolist()

    def packed(self, start: int = 0, stop: int | None = None) -> bytes:
        """Token ids ``[start, stop)`` as little-endian uint32 bytes (4 bytes per id).

        Args:
            start: first token, ``0 <= start <= stop``.
            stop: one past the last token, at most ``len(self)``; None for the end.
        """
        num_tokens = self._num_tokens
        if stop is None:
            stop = num_tokens
        if not 0 <= start <= stop <= num_tokens:
            raise ValueError(
                f"expected 0 <= start <= stop <= {num_tokens}, found start={start}, stop={stop}"
            )
        part = self._buf[start:stop]
        if not _LITTLE_ENDIAN:  # pragma: no cover - no big-endian test machine
            part.byteswap()
        return part.tobytes()

    def __add__(self, other: Iterable[int]) -> AnnotatedTokens:
        """A new sequence: these tokens followed by ``other``.

        ``other`` may be an AnnotatedTokens (its annotations are shifted
        behind this sequence) or any iterable of token ids.
        """
        num_tokens = self._num_tokens
        if isinstance(other, AnnotatedTokens):
            tail = other._buf[: other._num_tokens]
            annotations = self._annotations + tuple(
                a._replace(token_index=a.token_index + num_tokens) for a in other._annotations
            )
            ends = self._ends + tuple(end + num_tokens for end in other._ends)
        else:
            tail = _pack_token_ids(other)
            annotations = self._annotations
            ends = self._ends
        with _APPEND_LOCK:
            buf = self._buf
            if len(buf) == num_tokens:
                buf.extend(tail)
            else:
                buf = buf[:num_tokens]
                buf.extend(tail)
        return AnnotatedTokens._from_parts(buf, num_tokens + len(tail), annotations, ends)

    def extend(self, token_ids: Iterable[int]) -> AnnotatedTokens:
        """A new sequence with ``token_ids`` appended; this one is unchanged.

        Same as ``self + token_ids``; named for the decode loop that appends
        sampled tokens.
        """
        return self + token_ids

    def blocks(self, block_size: int, /, *, start_block: int = 0) -> Iterator[TokenBlock]:
        """Yield every full block from ``start_block`` on, with its clipped annotations.

        Args:
            block_size: tokens per block, >= 1.
            start_block: index of the first block to yield, at most the
                number of full blocks.

        Returns:
            An iterator of `TokenBlock`; a trailing partial block is not yielded.
        """
        num_full_blocks = self._check_block_range(block_size, start_block)
        return self._iter_blocks(block_size, start_block, num_full_blocks)

    def _iter_blocks(
        self, block_size: int, start_block: int, num_full_blocks: int
    ) -> Iterator[TokenBlock]:
        buf = self._buf
        for block in range(start_block, num_full_blocks):
            start = block * block_size
            stop = start + block_size
            yield TokenBlock(tuple(buf[start:stop]), self.clipped_annotations(start, stop))

    def _check_block_range(self, block_size: int, start_block: int) -> int:
        """Validate a block size and first block; return the number of full blocks."""
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size: expected an int >= 1, found {_describe(block_size)}")
        num_full_blocks = self._num_tokens // block_size
        if not _is_int(start_block) or not 0 <= start_block <= num_full_blocks:
            raise ValueError(
                f"start_block: expected an int in [0, {num_full_blocks}] (full blocks of "
                f"{block_size} in {self._num_tokens} tokens), found {_describe(start_block)}"
            )
        return num_full_blocks


Sequence.register(AnnotatedTokens)
