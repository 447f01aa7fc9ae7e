"""Hypothesis strategies shared by the test modules."""

from __future__ import annotations

from hypothesis import strategies as st

from omnicache.annotations import TokenRangeAnnotation


@st.composite
def ids_and_annotations(
    draw: st.DrawFn,
    *,
    max_tokens: int,
    token_ids: st.SearchStrategy[int],
    digests: st.SearchStrategy[bytes],
    max_pad: int,
) -> tuple[list[int], list[TokenRangeAnnotation]]:
    """Random ids and sorted, disjoint annotations, some adjacent.

    Each item has up to ``max_pad`` positions before and after the tokens
    that carry it, so some annotations are only part of their item.
    """
    num_tokens = draw(st.integers(0, max_tokens))
    ids = draw(st.lists(token_ids, min_size=num_tokens, max_size=num_tokens))
    num_annotations = draw(st.integers(0, 6))
    points = sorted(
        draw(
            st.lists(
                st.integers(0, num_tokens),
                min_size=2 * num_annotations,
                max_size=2 * num_annotations,
            )
        )
    )
    anns = []
    for lo, hi in zip(points[::2], points[1::2], strict=True):
        if lo == hi:
            continue
        before = draw(st.integers(0, max_pad))
        after = draw(st.integers(0, max_pad))
        digest = draw(digests)
        anns.append(TokenRangeAnnotation(lo, hi - lo, digest, before, before + (hi - lo) + after))
    return ids, anns
