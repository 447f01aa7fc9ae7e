"""Block keys for vLLM requests: omnicache keys from tokens, multimodal items, salt and LoRA.

`RequestBlockHasher` is a drop-in ``block_hasher`` for
``vllm.v1.request.Request``: it returns the omnicache keys
(`omnicache.block_hash.BlockHasher`) of the request's new full blocks, from
its token ids and its ``mm_features``. `install_block_hasher` puts it into an
``EngineCore``; `make_request` builds a bare ``Request`` with it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from hashing import (
    DEFAULT_ALGORITHM,
    Algorithm,
    ContentHash,
    digest_size,
    hash_array,
    hash_array_rows,
    hash_identifier,
)
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import DEFAULT_BLOCK_ALGORITHM, BlockHash, BlockHasher
from omnicache.checks import check_bool, check_int, check_str, type_name
from omnicache.integrations.vllm.common import vllm_series
from omnicache.integrations.vllm.identifiers import HEX_DIGEST, UUID_NAMESPACE

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

__all__ = [
    "RequestBlockHasher",
    "adapter_id",
    "install_block_hasher",
    "make_request",
    "prompt_embeds_digest",
]


def adapter_id(lora_request: object | None, /) -> str | None:
    """The adapter field of a request's keys: its LoRA name and path, or None.

    ``json.dumps([lora_name, lora_path])``: a name and a path never run into
    each other, and pointing a name at other weights changes the keys.
    """
    if lora_request is None:
        return None
    name = check_str("lora_request.lora_name", getattr(lora_request, "lora_name", None))
    path = check_str("lora_request.lora_path", getattr(lora_request, "lora_path", None))
    return json.dumps([name, path], ensure_ascii=False, separators=(",", ":"))


def _clip_runs(
    runs: Sequence[tuple[int, int]],
    base: int,
    length: int,
    content_hash: bytes,
    start: int,
    stop: int,
    out: list[TokenRangeAnnotation],
) -> None:
    """Appends the parts of ``runs`` (relative to token ``base``) inside ``[start, stop)``."""
    for lo, hi in runs:
        first = max(base + lo, start)
        end = min(base + hi, stop)
        if first < end:
            out.append(
                TokenRangeAnnotation(first - start, end - first, content_hash, first - base, length)
            )


class RequestBlockHasher:
    """A drop-in ``block_hasher`` for ``vllm.v1.request.Request`` that returns omnicache keys.

    vLLM calls it when a request is created and after every appended token,
    and appends what it returns to ``request.block_hashes``; it returns the
    keys of the full blocks that ``request.block_hashes`` does not cover yet
    (usually none during decode, at the cost of one comparison), chained from
    ``request.block_hashes[-1]``. The keys are exactly those of
    `omnicache.block_hash.BlockHasher` over the request's tokens annotated
    with its multimodal items:

    - tokens: ``request.all_token_ids`` (prompt, then output tokens);
    - per ``mm_features[i]``: ``TokenRangeAnnotation(offset, length, digest,
      0, length)`` from its ``mm_position``, the digest being
      ``bytes.fromhex(identifier)`` (a ``"<lora_name>:"`` prefix, which vLLM
      adds for tower-connector LoRA, is dropped: the adapter is in the root).
      An identifier that is not a 16- or 32-byte lowercase hex digest (a
      client's uuid) is hashed with `hashing.hash_identifier` under
      ``UUID_NAMESPACE/<modality>``, never used raw. When
      ``mm_position.is_embed`` is given, only the runs of positions that
      receive embeddings are annotated (each with its position in the
      placeholder range): the other placeholder tokens (image breaks, start
      and end markers) are ordinary tokens whose KV does not depend on the item;
    - prompt embeddings (``request.prompt_embeds``): over the positions they
      fill (all prompt positions, or those ``prompt_is_token_ids`` marks
      False), one annotation per block of rows, whose digest covers those
      rows only, so shared embedding prefixes share blocks; where the rows lie
      over a multimodal item, one annotation names both (see
      `omnicache.integrations.vllm.block_hasher`);
    - the root: ``namespace`` (the model), ``request.cache_salt`` and the
      request's LoRA (`adapter_id`), so tenants and adapters never share a
      chain.

    Token ids are ints in ``[0, 2**32)``; any other is a ValueError naming
    it. Real tokenizers never produce a negative id; vLLM's own tests use -1
    as a placeholder id, which is refused here.

    Args:
        block_size: vLLM's hash block size.
        algorithm: block key algorithm ("sha256" by default, see `BlockHasher`).
        namespace: what the keys are for, such as the model id.
        content_algorithm: algorithm of the digests this hasher makes itself
            (client uuids, prompt embeddings).
        max_roots: chain roots (one per salt and adapter) kept ready.
        lookahead: vLLM 0.33's ``num_hash_lookahead_tokens`` (L, for EAGLE-
            style drafters): block i's key is returned only once the L tokens
            after it exist, and covers those tokens and the annotations over
            them too, so two requests share block i only if they also agree
            on the next L tokens (`BlockHasher`'s ``lookahead``). 0 (the
            default) keys each block by its own tokens.
        trust_hex_identifiers: take an identifier that reads as a hex digest
            as that digest (True, the default: identifiers come from
            `multi_modal_uuids` or vLLM's own hasher). Pass False where
            clients may send ``multi_modal_uuids``: a client could otherwise
            name another item's digest while sending different content, and
            poison that item's blocks within its salt. Every identifier is
            then hashed under ``UUID_NAMESPACE/<modality>`` (keys stay
            deterministic, but no longer equal `BlockHasher` keys over the
            content digests).
    """

    __slots__ = (
        "_algorithm",
        "_block_size",
        "_content_algorithm",
        "_hashers",
        "_lock",
        "_lookahead",
        "_max_roots",
        "_namespace",
        "_trust_hex_identifiers",
    )

    def __init__(
        self,
        block_size: int,
        *,
        algorithm: Algorithm = DEFAULT_BLOCK_ALGORITHM,
        namespace: str = "",
        content_algorithm: Algorithm = DEFAULT_ALGORITHM,
        max_roots: int = 1024,
        trust_hex_identifiers: bool = True,
        lookahead: int = 0,
    ) -> None:
        base = BlockHasher(
            block_size, algorithm=algorithm, namespace=namespace, lookahead=lookahead
        )
        check_bool("trust_hex_identifiers", trust_hex_identifiers)
        digest_size(content_algorithm)  # ValueError for an unknown algorithm
        check_int("max_roots", max_roots, minimum=1)
        self._block_size = block_size
        self._algorithm = algorithm
        self._namespace = namespace
        self._content_algorithm = content_algorithm
        self._max_roots = max_roots
        self._trust_hex_identifiers = trust_hex_identifiers
        self._lookahead = lookahead
        self._hashers: dict[tuple[str | None, str | None], BlockHasher] = {(None, None): base}
        # NOTE: vLLM 0.33 keys a request on its input thread and its new
        # tokens on the scheduler's: the roots are added and dropped under it.
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def algorithm(self) -> Algorithm:
        return self._algorithm

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def lookahead(self) -> int:
        """Tokens after each block that its key covers (vLLM's ``num_hash_lookahead_tokens``)."""
        return self._lookahead

    def __repr__(self) -> str:
        lookahead = f", lookahead={self._lookahead}" if self._lookahead else ""
        return (
            f"RequestBlockHasher(block_size={self._block_size}, algorithm={self._algorithm!r}, "
            f"namespace={self._namespace!r}{lookahead})"
        )

    def hasher_for(self, cache_salt: str | None, adapter: str | None) -> BlockHasher:
        """The `BlockHasher` of one salt and adapter (kept, up to ``max_roots``)."""
        key = (cache_salt, adapter)
        hasher = self._hashers.get(key)
        if hasher is not None:
            return hasher
        hasher = BlockHasher(
            self._block_size,
            algorithm=self._algorithm,
            namespace=self._namespace,
            cache_salt=cache_salt,
            adapter=adapter,
            lookahead=self._lookahead,
        )
        with self._lock:
            found = self._hashers.get(key)
            if found is not None:
                return found  # another thread made it meanwhile
            if len(self._hashers) >= self._max_roots:
                # Oldest first: a dropped root costs one digest to rebuild.
                del self._hashers[next(iter(self._hashers))]
            self._hashers[key] = hasher
        return hasher

    def __call__(self, request: Request) -> list[BlockHash]:
        """Keys of the request's full blocks beyond ``request.block_hashes``.

        With ``lookahead`` (L) tokens, block i gets its key once the L tokens
        after it exist, and the key covers them too (see `BlockHasher`).
        """
        block_hashes = request.block_hashes
        num_done = len(block_hashes)
        block_size = self._block_size
        num_hashable = request.num_tokens - self._lookahead
        if (num_done + 1) * block_size > num_hashable:
            return []
        start = num_done * block_size
        stop = num_hashable - num_hashable % block_size + self._lookahead
        tokens = AnnotatedTokens(
            request.all_token_ids[start:stop], self._annotations(request, start, stop)
        )
        hasher = self.hasher_for(request.cache_salt, adapter_id(request.lora_request))
        return hasher.hash_blocks(tokens, parent=block_hashes[-1] if num_done else None)

    def annotations(self, request: Request) -> tuple[TokenRangeAnnotation, ...]:
        """The annotations of all of the request's tokens, as the keys cover them."""
        return tuple(self._annotations(request, 0, request.num_tokens))

    def _annotations(self, request: Request, start: int, stop: int) -> list[TokenRangeAnnotation]:
        """Annotations overlapping tokens ``[start, stop)``, clipped and re-based to ``start``."""
        out: list[TokenRangeAnnotation] = []
        features = request.mm_features
        if features:
            last = features[-1].mm_position
            # NOTE: decode windows lie past the last item: nothing to scan.
            if last.offset + last.length > start:
                self._feature_annotations(request, start, stop, out)
        if request.prompt_embeds is not None and start < request.num_prompt_tokens:
            return prompt_embeds_annotations(
                request,
                out,
                start,
                stop,
                block_size=self._block_size,
                lookahead=self._lookahead,
                algorithm=self._content_algorithm,
            )
        return out

    def _feature_annotations(
        self, request: Request, start: int, stop: int, out: list[TokenRangeAnnotation]
    ) -> None:
        lora = request.lora_request
        lora_prefix = None if lora is None else f"{lora.lora_name}:"
        num_tokens = request.num_tokens
        prev_end = 0
        for index, feature in enumerate(request.mm_features):
            where = f"mm_features[{index}]"
            position = feature.mm_position
            offset = check_int(f"{where}.mm_position.offset", position.offset, minimum=0)
            length = check_int(f"{where}.mm_position.length", position.length, minimum=1)
            if offset < prev_end:
                raise ValueError(
                    f"{where}.mm_position: expected offset >= {prev_end} (features sorted by "
                    f"offset, not overlapping), found {offset}"
                )
            end = offset + length
            if end > num_tokens:
                raise ValueError(
                    f"{where}.mm_position: expected offset + length <= {num_tokens} (tokens of "
                    f"the request), found {offset} + {length} = {end}"
                )
            prev_end = end
            if end <= start or offset >= stop:
                continue
            runs = flag_runs(
                position.is_embed, length, f"{where}.mm_position.is_embed", "placeholder token"
            )
            content_hash = self._content_hash(feature, lora_prefix, where)
            _clip_runs(runs, offset, length, content_hash, start, stop, out)

    def _content_hash(self, feature: Any, lora_prefix: str | None, where: str) -> bytes:
        identifier = check_str(f"{where}.identifier", feature.identifier, nonempty=True)
        if self._trust_hex_identifiers and HEX_DIGEST.fullmatch(identifier):
            return bytes.fromhex(identifier)
        if (
            self._trust_hex_identifiers
            and lora_prefix is not None
            and identifier.startswith(lora_prefix)
        ):
            digest = identifier[len(lora_prefix) :]
            if HEX_DIGEST.fullmatch(digest):
                return bytes.fromhex(digest)
        modality = feature.modality
        return hash_identifier(
            identifier,
            namespace=f"{UUID_NAMESPACE}/{modality}",
            algorithm=self._content_algorithm,
        )


def install_block_hasher(
    engine_core: Any,
    /,
    *,
    namespace: str | None = None,
    algorithm: Algorithm = DEFAULT_BLOCK_ALGORITHM,
    content_algorithm: Algorithm = DEFAULT_ALGORITHM,
    trust_hex_identifiers: bool = True,
) -> RequestBlockHasher:
    """Makes an ``EngineCore`` key its requests' blocks with omnicache keys.

    Sets ``engine_core.request_block_hasher``, which the engine hands to every
    ``Request`` it creates. Call it before the first request arrives.

    Args:
        engine_core: a ``vllm.v1.engine.core.EngineCore`` with prefix caching.
        namespace: the keys' namespace; default the served model's id.
        trust_hex_identifiers: see `RequestBlockHasher`; False for a server
            that accepts clients' ``multi_modal_uuids``.

    Returns:
        The hasher installed.

    With vLLM 0.33's lookahead block hashes (``num_hash_lookahead_tokens``,
    for EAGLE-style drafters) the hasher's ``lookahead`` is that setting, so a
    block gets its key when vLLM's own hasher would give it one; vLLM 0.32
    has no such setting.

    Raises:
        ValueError: prefix caching is off.
        RuntimeError: the scheduler already holds requests keyed otherwise.
    """
    series = vllm_series()
    from vllm.v1.engine.core import EngineCore

    if not isinstance(engine_core, EngineCore):
        raise TypeError(f"engine_core: expected an EngineCore, found {type_name(engine_core)}")
    if engine_core.request_block_hasher is None:
        raise ValueError(
            "engine_core: expected prefix caching enabled (a request_block_hasher), found none"
        )
    scheduler = engine_core.scheduler
    num_requests = len(getattr(scheduler, "requests", ()))
    if num_requests:
        raise RuntimeError(
            f"engine_core: expected no requests yet, found {num_requests} keyed by the "
            "previous block hasher"
        )
    hasher = scheduler_block_hasher(
        engine_core.vllm_config,
        scheduler.hash_block_size,
        series=series,
        namespace=namespace,
        algorithm=algorithm,
        content_algorithm=content_algorithm,
        trust_hex_identifiers=trust_hex_identifiers,
    )
    engine_core.request_block_hasher = hasher
    return hasher


def scheduler_block_hasher(
    vllm_config: Any,
    hash_block_size: int,
    /,
    *,
    series: str,
    namespace: str | None = None,
    algorithm: Algorithm = DEFAULT_BLOCK_ALGORITHM,
    content_algorithm: Algorithm = DEFAULT_ALGORITHM,
    trust_hex_identifiers: bool = True,
) -> RequestBlockHasher:
    """The `RequestBlockHasher` of an engine of ``vllm_config`` (see `install_block_hasher`).

    Its ``lookahead`` is ``vllm_config.num_hash_lookahead_tokens`` on vLLM
    0.33 and 0 on 0.32, which has no lookahead block hashes.
    """
    lookahead = 0
    if series != "0.32.":
        lookahead = check_int(
            "vllm_config.num_hash_lookahead_tokens",
            vllm_config.num_hash_lookahead_tokens,
            minimum=0,
        )
    return RequestBlockHasher(
        hash_block_size,
        algorithm=algorithm,
        namespace=vllm_config.model_config.model if namespace is None else namespace,
        content_algorithm=content_algorithm,
        trust_hex_identifiers=trust_hex_identifiers,
        lookahead=lookahead,
    )


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    /,
    block_hasher: Callable[[Request], list[BlockHash]] | None,
    *,
    mm_features: Sequence[MultiModalFeatureSpec] | None = None,
    cache_salt: str | None = None,
    lora_request: object | None = None,
    max_tokens: int = 16,
) -> Request:
    """A bare vLLM ``Request`` (outside an engine) keyed by ``block_hasher``.

    Its ``block_hashes`` are computed on creation and extended by
    ``append_output_token_ids``, as inside the engine.
    """
    vllm_series()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        mm_features=None if mm_features is None else list(mm_features),
        lora_request=lora_request,
        cache_salt=cache_salt,
        block_hasher=block_hasher,
    )


# -- prompt_embeds -------------------------------------------------------------
# Prompt embeddings in block keys: one digest per block of rows, chained like token ids.
#
# A request may carry ``prompt_embeds`` (one row per prompt position) instead
# of, or mixed with, token ids. Its positions that are filled from the
# embeddings get annotations whose digests cover the rows *of one block* only,
# so that two requests whose embeddings share a prefix share those blocks, and
# a change late in the tensor leaves the keys of earlier blocks alone (the
# prefix property of `omnicache.block_hash`). The chain itself carries
# everything before the block, as it does for token ids.
#
# Which positions: all of the prompt's when ``prompt_is_token_ids`` is None
# (the request has no token ids, or vLLM's worker reads its embeddings), else
# those whose flag is False. A run of such positions is cut at every block
# edge, and with lookahead block hashes (``L`` tokens) also ``L % block_size``
# tokens into every block, so that a block's window ``[start, end + L)`` never
# covers part of a piece. Each piece ``[lo, hi)`` (absolute positions) becomes::
#
#     TokenRangeAnnotation(lo, hi - lo, prompt_embeds_digest(rows[lo:hi]), 0, hi - lo)
#
# An embeddings piece that lies over positions of a multimodal item (vLLM keys
# such a block by both the item and the rows) is cut at the item's edges too,
# and each part over the item becomes one annotation that names both: the
# item's place (``content_offset``, ``content_length``) and a digest of the rows
# bound to the item's digest::
#
#     TokenRangeAnnotation(lo, hi - lo, prompt_embeds_digest(rows[lo:hi], item=d),
#                          offset of lo in the item, item length)
#
# ``prompt_embeds_digest`` is `hashing.hash_array` (dtype, shape and C-order
# bytes: bf16 and f32 rows never collide) under the context
# ``{"scheme": "omnicache.prompt_embeds/v1", "item": d or None}``, so a rows
# digest never equals the digest of an array handed in as an item, and the
# same rows over another item (or over none) give another digest.

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
