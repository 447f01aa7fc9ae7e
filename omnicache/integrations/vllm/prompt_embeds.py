"""Prompt embeddings in block keys: one digest per block of rows, chained like token ids.

A request may carry ``prompt_embeds`` (one row per prompt position) instead
of, or mixed with, token ids. Its positions that are filled from the
embeddings get annotations whose digests cover the rows *of one block* only,
so that two requests whose embeddings share a prefix share those blocks, and
a change late in the tensor leaves the keys of earlier blocks alone (the
prefix property of `omnicache.block_hash`). The chain itself carries
everything before the block, as it does for token ids.

Which positions: all of the prompt's when ``prompt_is_token_ids`` is None
(the request has no token ids, or vLLM's worker reads its embeddings), else
those whose flag is False. A run of such positions is cut at every block
edge, and with lookahead block hashes (``L`` tokens) also ``L % block_size``
tokens into every block, so that a block's window ``[start, end + L)`` never
covers part of a piece. Each piece ``[lo, hi)`` (absolute positions) becomes::

    TokenRangeAnnotation(lo, hi - lo, prompt_embeds_digest(rows[lo:hi]), 0, hi - lo)

An embeddings piece that lies over positions of a multimodal item (vLLM keys
such a block by both the item and the rows) is cut at the item's edges too,
and each part over the item becomes one annotation that names both: the
item's place (``content_offset``, ``content_length``) and a digest of the rows
bound to the item's digest::

    TokenRangeAnnotation(lo, hi - lo, prompt_embeds_digest(rows[lo:hi], item=d),
                         offset of lo in the item, item length)

``prompt_embeds_digest`` is `hashing.hash_array` (dtype, shape and C-order
bytes: bf16 and f32 rows never collide) under the context
``{"scheme": "omnicache.prompt_embeds/v1", "item": d or None}``, so a rows
digest never equals the digest of an array handed in as an item, and the
same rows over another item (or over none) give another digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from hashing import Algorithm, ContentHash, hash_array, hash_array_rows
from omnicache.annotations import TokenRangeAnnotation
from omnicache.checks import type_name

__all__ = ["EMBEDS_SCHEME", "flag_runs", "prompt_embeds_annotations", "prompt_embeds_digest"]

EMBEDS_SCHEME = "omnicache.prompt_embeds/v1"


def prompt_embeds_digest(
    rows: Any, /, *, item: bytes | None = None, algorithm: Algorithm
) -> ContentHash:
    """Digest of embedding rows, bound to the item they lie over (None: no item).

    `hashing.hash_array` of ``rows`` under the context ``{"scheme":
    EMBEDS_SCHEME, "item": item}``.
    """
    return hash_array(rows, algorithm=algorithm, context={"scheme": EMBEDS_SCHEME, "item": item})


def flag_runs(flags: Any, length: int, where: str, unit: str) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of the true flags among ``length`` (all of them for None).

    Raises:
        ValueError: ``flags`` does not hold ``length`` flags.
    """
    if flags is None:
        return [(0, length)]
    values = flags.tolist() if hasattr(flags, "tolist") else list(flags)
    if len(values) != length:
        raise ValueError(f"{where}: expected {length} flags (one per {unit}), found {len(values)}")
    runs: list[tuple[int, int]] = []
    run_start = -1
    for index, flag in enumerate(values):
        if flag:
            if run_start < 0:
                run_start = index
        elif run_start >= 0:
            runs.append((run_start, index))
            run_start = -1
    if run_start >= 0:
        runs.append((run_start, length))
    return runs


def _embeds_positions(request: Any) -> list[tuple[int, int]]:
    """Runs of the prompt positions filled from ``request.prompt_embeds``."""
    num_prompt = request.num_prompt_tokens
    embeds = request.prompt_embeds
    shape = getattr(embeds, "shape", None)
    if shape is None:
        raise TypeError(
            f"prompt_embeds: expected a torch.Tensor or numpy.ndarray, found {type_name(embeds)}"
        )
    if len(shape) != 2 or shape[0] != num_prompt:
        raise ValueError(
            f"prompt_embeds: expected shape ({num_prompt}, hidden_size) (one row per prompt "
            f"token), found {tuple(shape)}"
        )
    mask = request.prompt_is_token_ids
    if mask is None:
        return [(0, num_prompt)]
    # Positions filled from the embeddings are those that are not token ids.
    flags = mask.tolist() if hasattr(mask, "tolist") else list(mask)
    return flag_runs(
        [not flag for flag in flags], num_prompt, "prompt_is_token_ids", "prompt token"
    )


def _pieces(
    runs: Sequence[tuple[int, int]], start: int, stop: int, block_size: int, lookahead: int
) -> list[tuple[int, int]]:
    """The runs inside ``[start, stop)``, cut at every block edge and ``lookahead`` past it."""
    shift = lookahead % block_size
    pieces: list[tuple[int, int]] = []
    for run_lo, run_hi in runs:
        lo = max(run_lo, start)
        hi = min(run_hi, stop)
        while lo < hi:
            block_start = lo - lo % block_size
            cut = block_start + shift
            if cut <= lo:
                cut = block_start + block_size
            end = min(cut, hi)
            pieces.append((lo, end))
            lo = end
    return pieces


def prompt_embeds_annotations(
    request: Any,
    features: Sequence[TokenRangeAnnotation],
    start: int,
    stop: int,
    *,
    block_size: int,
    lookahead: int,
    algorithm: Algorithm,
) -> list[TokenRangeAnnotation]:
    """The annotations of tokens ``[start, stop)``: ``features`` with the embeddings merged in.

    Args:
        request: a vLLM ``Request`` with ``prompt_embeds``.
        features: the multimodal items' annotations, clipped and re-based to
            ``start``, sorted and not overlapping.
        start: the first token, a block edge.
        stop: one past the last token.
        block_size, lookahead: where embedding runs are cut (see the module).
        algorithm: the digests' algorithm.

    Returns:
        Sorted, non-overlapping annotations re-based to ``start``: the
        features' parts outside the embeddings as they were, the embeddings'
        pieces, and one annotation per piece over an item.
    """
    runs = _embeds_positions(request)
    pieces = _pieces(runs, start, min(stop, request.num_prompt_tokens), block_size, lookahead)
    if not pieces:
        return list(features)
    # Items as absolute [lo, hi) with their annotation.
    items = [(start + f.token_index, start + f.token_end, f) for f in features]
    edges = sorted(
        {edge for lo, hi in pieces for edge in (lo, hi)}
        | {edge for lo, hi, _ in items for edge in (lo, hi)}
    )
    # Each stretch between two edges: rows alone, an item alone, or rows over an item.
    parts: list[tuple[int, int, TokenRangeAnnotation | None, bool]] = []
    piece_index = item_index = 0
    for lo, hi in pairwise(edges):
        while piece_index < len(pieces) and pieces[piece_index][1] <= lo:
            piece_index += 1
        while item_index < len(items) and items[item_index][1] <= lo:
            item_index += 1
        in_piece = piece_index < len(pieces) and pieces[piece_index][0] <= lo
        feature = None
        if item_index < len(items) and items[item_index][0] <= lo:
            feature = items[item_index][2]
        if feature is not None or in_piece:
            parts.append((lo, hi, feature, in_piece))
    digests = _rows_digests(request.prompt_embeds, parts, algorithm)
    out: list[TokenRangeAnnotation] = []
    for index, (lo, hi, feature, in_piece) in enumerate(parts):
        if feature is None:
            out.append(TokenRangeAnnotation(lo - start, hi - lo, digests[index], 0, hi - lo))
            continue
        offset = feature.content_offset + (lo - start - feature.token_index)
        content_hash = digests[index] if in_piece else feature.content_hash
        out.append(
            TokenRangeAnnotation(lo - start, hi - lo, content_hash, offset, feature.content_length)
        )
    return out


def _rows_digests(
    embeds: Any,
    parts: Sequence[tuple[int, int, TokenRangeAnnotation | None, bool]],
    algorithm: Algorithm,
) -> dict[int, bytes]:
    """`prompt_embeds_digest` of the rows of every part that has rows, by part index.

    NOTE: one `hashing.hash_array_rows` call per item (and one for rows over
    no item) converts the rows once, not once a block.
    """
    by_item: dict[bytes | None, list[int]] = {}
    for index, (_, _, feature, in_piece) in enumerate(parts):
        if in_piece:
            by_item.setdefault(None if feature is None else feature.content_hash, []).append(index)
    if not by_item:
        return {}
    base = min(parts[i][0] for indices in by_item.values() for i in indices)
    top = max(parts[i][1] for indices in by_item.values() for i in indices)
    window = embeds[base:top]
    digests: dict[int, bytes] = {}
    for item, indices in by_item.items():
        bounds = [(parts[i][0] - base, parts[i][1] - base) for i in indices]
        found = hash_array_rows(
            window, bounds, algorithm=algorithm, context={"scheme": EMBEDS_SCHEME, "item": item}
        )
        digests.update(zip(indices, found, strict=True))
    return digests
