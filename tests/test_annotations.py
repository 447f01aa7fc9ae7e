"""TokenRangeAnnotation and AnnotatedTokens: clipping, validation, slicing, appending, blocks."""

from __future__ import annotations

import doctest
import re
import sys
import threading
from array import array
from collections.abc import Sequence
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ids_and_annotations

import omnicache.annotations as annotations_module
from omnicache.annotations import (
    MAX_TOKEN_ID,
    AnnotatedTokens,
    TokenBlock,
    TokenRangeAnnotation,
)

T = TokenRangeAnnotation
H1 = b"\x01" * 32
H2 = b"\x02" * 32


def reference_clip(ann: TokenRangeAnnotation, start: int, end: int) -> TokenRangeAnnotation | None:
    """The clip rule of docs/architecture.md, written independently of the library."""
    lo = max(start, ann.token_index)
    hi = min(end, ann.token_index + ann.token_count)
    if lo >= hi:
        return None
    return T(
        lo - start,
        hi - lo,
        ann.content_hash,
        ann.content_offset + lo - ann.token_index,
        ann.content_length,
    )


def reference_slice_annotations(
    anns: Sequence[TokenRangeAnnotation], start: int, stop: int
) -> tuple[TokenRangeAnnotation, ...]:
    out = []
    for ann in anns:
        part = reference_clip(ann, start, stop)
        if part is not None:
            out.append(part)
    return tuple(out)


def annotated(max_tokens: int = 120) -> st.SearchStrategy[tuple[list[int], list[T]]]:
    """Random ids and sorted, disjoint annotations (some partial items, some adjacent)."""
    return ids_and_annotations(
        max_tokens=max_tokens,
        token_ids=st.one_of(st.integers(0, 50), st.just(MAX_TOKEN_ID)),
        digests=st.binary(min_size=1, max_size=32),
        max_pad=4,
    )


# --- TokenRangeAnnotation.clip ---------------------------------------------------------------


def test_docstring_worked_example_holds() -> None:
    result = doctest.testmod(annotations_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted == 4
    assert result.failed == 0


def test_clip_rebases_and_advances_offset() -> None:
    image = T(6, 10, H1, 0, 10)
    assert image.clip(0, 8) == T(6, 2, H1, 0, 10)
    assert image.clip(8, 16) == T(0, 8, H1, 2, 10)
    assert image.clip(10, 12) == T(0, 2, H1, 4, 10)
    assert image.clip(6, 16) == T(0, 10, H1, 0, 10)
    assert image.clip(0, 100) == T(6, 10, H1, 0, 10)


def test_clip_keeps_offset_of_a_partial_item() -> None:
    tail_of_item = T(0, 5, H1, 11, 16)
    assert tail_of_item.clip(2, 4) == T(0, 2, H1, 13, 16)


def test_clip_without_overlap_is_none() -> None:
    image = T(6, 10, H1, 0, 10)
    assert image.clip(0, 6) is None
    assert image.clip(16, 24) is None
    assert image.clip(8, 8) is None


def test_clip_rejects_a_reversed_window() -> None:
    with pytest.raises(
        ValueError, match=re.escape("expected a window 0 <= start <= end, found [8, 4)")
    ):
        T(6, 10, H1, 0, 10).clip(8, 4)
    with pytest.raises(ValueError, match=re.escape("found [-1, 4)")):
        T(6, 10, H1, 0, 10).clip(-1, 4)


def test_token_end() -> None:
    assert T(6, 10, H1, 0, 10).token_end == 16


@settings(max_examples=60, deadline=None)
@given(annotated(), st.lists(st.integers(0, 120), max_size=8))
def test_clipping_and_reassembling_reproduces_each_annotation(
    sample: tuple[list[int], list[T]], cuts: list[int]
) -> None:
    ids, anns = sample
    bounds = sorted({0, len(ids), *(c for c in cuts if c <= len(ids))})
    for ann in anns:
        pieces = []
        for start, end in pairwise(bounds):
            part = ann.clip(start, end)
            if part is not None:
                pieces.append(part._replace(token_index=part.token_index + start))
        # Consecutive pieces continue each other in tokens and in content positions.
        for prev, cur in pairwise(pieces):
            assert cur.token_index == prev.token_index + prev.token_count
            assert cur.content_offset == prev.content_offset + prev.token_count
        merged = pieces[0]._replace(token_count=sum(p.token_count for p in pieces))
        assert merged == ann


# --- construction and validation -----------------------------------------------------------


def test_construct_from_list_tuple_range_array_generator() -> None:
    expected = [0, 1, 2, 3]
    for source in (
        [0, 1, 2, 3],
        (0, 1, 2, 3),
        range(4),
        array("q", [0, 1, 2, 3]),
        (i for i in range(4)),
    ):
        tokens = AnnotatedTokens(source)
        assert tokens.tolist() == expected
        assert len(tokens) == 4
        assert tokens.annotations == ()


def test_construct_from_annotated_tokens_takes_ids_only() -> None:
    original = AnnotatedTokens([5, 6, 7], [T(0, 2, H1, 0, 2)])
    copy = AnnotatedTokens(original)
    assert copy.tolist() == [5, 6, 7]
    assert copy.annotations == ()


def test_input_list_is_not_kept_or_modified() -> None:
    ids = [1, 2, 3]
    anns = [T(0, 2, H1, 0, 2)]
    tokens = AnnotatedTokens(ids, anns)
    ids.append(4)
    anns.append(T(2, 1, H2, 0, 1))
    assert tokens.tolist() == [1, 2, 3]
    assert tokens.annotations == (T(0, 2, H1, 0, 2),)
    longer = tokens + [9]  # noqa: RUF005
    assert ids == [1, 2, 3, 4]
    assert longer.tolist() == [1, 2, 3, 9]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, -1], "token_ids[1]: expected an int in [0, 4294967295], found -1 (int)"),
        ([2**32], "token_ids[0]: expected an int in [0, 4294967295], found 4294967296 (int)"),
        ([0, 1, 2.0], "token_ids[2]: expected an int in [0, 4294967295], found 2.0 (float)"),
        (["7"], "token_ids[0]: expected an int in [0, 4294967295], found '7' (str)"),
        ((3, None), "token_ids[1]: expected an int in [0, 4294967295], found None (NoneType)"),
        (range(-1, 2), "token_ids[0]: expected an int in [0, 4294967295], found -1 (int)"),
    ],
)
def test_bad_token_ids_are_value_errors_naming_the_index(ids: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        AnnotatedTokens(ids)  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [b"\x01\x00\x00\x00", "abc", bytearray(4), memoryview(b"1234")])
def test_bytes_and_str_are_not_token_sequences(ids: object) -> None:
    with pytest.raises(
        TypeError, match=f"token_ids: expected a list, .*found {type(ids).__name__}"
    ):
        AnnotatedTokens(ids)  # type: ignore[arg-type]


def test_largest_token_id_round_trips() -> None:
    tokens = AnnotatedTokens([MAX_TOKEN_ID, 0])
    assert tokens[0] == 4294967295
    assert tokens.packed() == b"\xff\xff\xff\xff\x00\x00\x00\x00"


@pytest.mark.parametrize(
    ("anns", "message"),
    [
        (
            [T(0, 2, H1, 0, 2), T(1, 2, H2, 0, 2)],
            "annotations[1]: expected token_index >= 2 (end of annotations[0]; annotations are "
            "sorted and do not overlap), found 1",
        ),
        (
            [T(4, 2, H1, 0, 2), T(0, 2, H2, 0, 2)],
            "annotations[1]: expected token_index >= 6 (end of annotations[0]; annotations are "
            "sorted and do not overlap), found 0",
        ),
        (
            [T(8, 3, H1, 0, 3)],
            "annotations[0]: expected token_index + token_count <= 10 (number of tokens), "
            "found 8 + 3 = 11",
        ),
        (
            [T(-1, 2, H1, 0, 2)],
            "annotations[0]: expected token_index >= 0 (start of the sequence; annotations are "
            "sorted and do not overlap), found -1",
        ),
        ([T(0, 0, H1, 0, 2)], "annotations[0].token_count: expected >= 1, found 0"),
        ([T(0, 2, H1, -1, 2)], "annotations[0].content_offset: expected >= 0, found -1"),
        (
            [T(0, 2, H1, 0, 0)],
            "annotations[0].content_length: expected an int in [1, 4294967295], found 0",
        ),
        (
            [T(0, 4, H1, 2, 5)],
            "annotations[0]: expected content_offset + token_count <= content_length (5), "
            "found 2 + 4 = 6",
        ),
        ([T(0, 2, b"", 0, 2)], "annotations[0].content_hash: expected non-empty bytes, found b''"),
        (
            [T(0, 2, "ab", 0, 2)],  # type: ignore[arg-type]
            "annotations[0].content_hash: expected non-empty bytes, found 'ab' (str)",
        ),
        (
            [T(0, 2.0, H1, 0, 2)],  # type: ignore[arg-type]
            "annotations[0].token_count: expected an int, found 2.0 (float)",
        ),
        ([T(True, 2, H1, 0, 2)], "annotations[0].token_index: expected an int, found True (bool)"),
    ],
)
def test_bad_annotations_are_value_errors_naming_the_annotation(
    anns: list[T], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        AnnotatedTokens(range(10), anns)


def test_annotation_of_wrong_type_is_a_type_error() -> None:
    with pytest.raises(
        TypeError, match=re.escape("annotations[0]: expected a TokenRangeAnnotation, found tuple")
    ):
        AnnotatedTokens(range(10), [(0, 2, H1, 0, 2)])  # type: ignore[list-item]


def test_adjacent_annotations_are_allowed() -> None:
    tokens = AnnotatedTokens(range(6), [T(0, 3, H1, 0, 3), T(3, 3, H2, 0, 3)])
    assert len(tokens.annotations) == 2


# --- sequence behaviour --------------------------------------------------------------------


def test_indexing_and_iteration() -> None:
    tokens = AnnotatedTokens([10, 11, 12, 13])
    assert tokens[0] == 10
    assert tokens[-1] == 13
    assert list(tokens) == [10, 11, 12, 13]
    assert list(reversed(tokens)) == [13, 12, 11, 10]
    assert 12 in tokens
    assert 99 not in tokens
    assert tokens.count(11) == 1
    assert tokens.index(12) == 2
    with pytest.raises(IndexError, match=re.escape("expected -4 <= index < 4, found 4")):
        tokens[4]
    with pytest.raises(IndexError, match=re.escape("expected -4 <= index < 4, found -5")):
        tokens[-5]
    assert isinstance(tokens, Sequence)


def test_slices_clip_annotations() -> None:
    tokens = AnnotatedTokens(range(40), [T(6, 10, H1, 0, 10), T(20, 5, H2, 3, 9)])
    part = tokens[8:22]
    assert part.tolist() == list(range(8, 22))
    assert part.annotations == (T(0, 8, H1, 2, 10), T(12, 2, H2, 3, 9))
    assert tokens[:10].annotations == (T(6, 4, H1, 0, 10),)
    assert tokens[:16].annotations == (T(6, 10, H1, 0, 10),)
    assert tokens[-15:].annotations == ()
    assert tokens[-15:].tolist() == list(range(25, 40))
    assert tokens[30:10].tolist() == []
    assert len(tokens[30:10]) == 0


def test_slice_with_a_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected a slice with step 1, found step 2"):
        AnnotatedTokens(range(4))[::2]


def test_packed_is_little_endian_uint32() -> None:
    tokens = AnnotatedTokens([1, 256, 65536 + 2])
    assert tokens.packed() == bytes([1, 0, 0, 0, 0, 1, 0, 0, 2, 0, 1, 0])
    assert tokens.packed(1, 2) == bytes([0, 1, 0, 0])
    with pytest.raises(
        ValueError, match=re.escape("expected 0 <= start <= stop <= 3, found start=2, stop=4")
    ):
        tokens.packed(2, 4)


def test_equality_and_hash() -> None:
    a = AnnotatedTokens([1, 2, 3], [T(0, 2, H1, 0, 2)])
    b = AnnotatedTokens((1, 2, 3), (T(0, 2, H1, 0, 2),))
    c = AnnotatedTokens([1, 2, 3], [T(0, 2, H2, 0, 2)])
    assert a == b
    assert hash(a) == hash(b)
    assert a != c
    assert a != AnnotatedTokens([1, 2, 4], [T(0, 2, H1, 0, 2)])
    assert a != [1, 2, 3]


def test_repr_is_short() -> None:
    tokens = AnnotatedTokens(range(100))
    assert repr(tokens) == (
        "AnnotatedTokens(num_tokens=100, token_ids=[0, 1, 2, 3, 4, 5, 6, 7, ...], annotations=())"
    )


# --- appending -----------------------------------------------------------------------------


def test_append_returns_a_new_sequence_and_leaves_the_old_one() -> None:
    base = AnnotatedTokens([1, 2], [T(0, 2, H1, 0, 2)])
    longer = base + [3]  # noqa: RUF005
    longest = longer.extend((4, 5))
    assert base.tolist() == [1, 2]
    assert longer.tolist() == [1, 2, 3]
    assert longest.tolist() == [1, 2, 3, 4, 5]
    assert longest.annotations == (T(0, 2, H1, 0, 2),)
    assert len(base) == 2
    assert list(base) == [1, 2]
    assert base[-1] == 2


def test_two_appends_to_one_sequence_do_not_see_each_other() -> None:
    base = AnnotatedTokens([1, 2])
    first = base.extend([3])
    second = base.extend([4])  # base is no longer the longest view: this copies
    assert first.tolist() == [1, 2, 3]
    assert second.tolist() == [1, 2, 4]
    assert first.extend([5]).tolist() == [1, 2, 3, 5]
    assert first.tolist() == [1, 2, 3]


def test_prefix_slice_stays_a_prefix_after_appends() -> None:
    tokens = AnnotatedTokens(range(10), [T(4, 6, H1, 0, 6)])
    prefix = tokens[:6]
    grown = tokens.extend([100, 101])
    regrown = prefix.extend([200])
    assert prefix.tolist() == [0, 1, 2, 3, 4, 5]
    assert prefix.annotations == (T(4, 2, H1, 0, 6),)
    assert grown.tolist() == [*range(10), 100, 101]
    assert regrown.tolist() == [0, 1, 2, 3, 4, 5, 200]
    assert tokens.tolist() == list(range(10))


def test_appending_annotated_tokens_shifts_their_annotations() -> None:
    left = AnnotatedTokens([1, 2, 3], [T(1, 2, H1, 0, 2)])
    right = AnnotatedTokens([4, 5], [T(0, 2, H2, 1, 3)])
    joined = left + right
    assert joined.tolist() == [1, 2, 3, 4, 5]
    assert joined.annotations == (T(1, 2, H1, 0, 2), T(3, 2, H2, 1, 3))
    assert joined[3:].annotations == (T(0, 2, H2, 1, 3),)


def test_appending_bad_ids_changes_nothing() -> None:
    base = AnnotatedTokens([1, 2])
    with pytest.raises(
        ValueError,
        match=re.escape("token_ids[1]: expected an int in [0, 4294967295], found -3 (int)"),
    ):
        base.extend([3, -3])
    assert base.tolist() == [1, 2]
    assert base.extend([7]).tolist() == [1, 2, 7]


def test_concurrent_appends_to_one_view_stay_separate() -> None:
    base = AnnotatedTokens(range(1000))
    results: dict[int, AnnotatedTokens] = {}
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        barrier.wait()
        tokens = base
        for _ in range(200):
            tokens += [k]
        results[k] = tokens

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    for k in range(4):
        assert results[k].tolist() == [*range(1000), *([k] * 200)]
    assert base.tolist() == list(range(1000))


# --- properties: slicing and blocks ----------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    annotated(),
    st.integers(-130, 130),
    st.integers(-130, 130),
    st.integers(-130, 130),
    st.integers(-130, 130),
)
def test_slicing_twice_equals_slicing_once(
    sample: tuple[list[int], list[T]], a: int, b: int, c: int, d: int
) -> None:
    ids, anns = sample
    tokens = AnnotatedTokens(ids, anns)
    twice = tokens[a:b][c:d]
    outer = range(len(ids))[a:b]
    inner = outer[c:d]
    start = inner.start if len(inner) else 0
    once = tokens[start : start + len(inner)]
    assert twice == once
    assert twice.tolist() == ids[a:b][c:d]
    assert once.annotations == reference_slice_annotations(anns, start, start + len(inner))


@settings(max_examples=80, deadline=None)
@given(annotated(), st.integers(0, 130), st.integers(0, 130))
def test_slices_match_the_reference_clip(
    sample: tuple[list[int], list[T]], start: int, stop: int
) -> None:
    ids, anns = sample
    tokens = AnnotatedTokens(ids, anns)
    start, stop = min(start, len(ids)), min(max(start, stop), len(ids))
    part = tokens[start:stop]
    assert part.tolist() == ids[start:stop]
    assert part.annotations == reference_slice_annotations(anns, start, stop)
    assert tokens.clipped_annotations(start, stop) == part.annotations
    # A slice is a valid sequence on its own: rebuilding it validates the annotations.
    assert AnnotatedTokens(part.tolist(), part.annotations) == part


@settings(max_examples=60, deadline=None)
@given(annotated(), st.integers(1, 20))
def test_blocks_cover_every_full_block(sample: tuple[list[int], list[T]], block_size: int) -> None:
    ids, anns = sample
    tokens = AnnotatedTokens(ids, anns)
    blocks = list(tokens.blocks(block_size))
    num_full = len(ids) // block_size
    assert len(blocks) == num_full
    assert [t for block in blocks for t in block.token_ids] == ids[: num_full * block_size]
    for i, block in enumerate(blocks):
        start = i * block_size
        assert isinstance(block, TokenBlock)
        assert block.annotations == reference_slice_annotations(anns, start, start + block_size)
    start_block = num_full // 2
    assert list(tokens.blocks(block_size, start_block=start_block)) == blocks[start_block:]


def test_blocks_exact() -> None:
    tokens = AnnotatedTokens(range(20), [T(3, 10, H1, 0, 10)])
    assert list(tokens.blocks(8)) == [
        TokenBlock((0, 1, 2, 3, 4, 5, 6, 7), (T(3, 5, H1, 0, 10),)),
        TokenBlock((8, 9, 10, 11, 12, 13, 14, 15), (T(0, 5, H1, 5, 10),)),
    ]


def test_blocks_reject_bad_arguments() -> None:
    tokens = AnnotatedTokens(range(20))
    with pytest.raises(
        ValueError, match=re.escape("block_size: expected an int >= 1, found 0 (int)")
    ):
        tokens.blocks(0)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "start_block: expected an int in [0, 2] (full blocks of 8 in 20 tokens), found 3 (int)"
        ),
    ):
        tokens.blocks(8, start_block=3)
