"""A small multimodal causal transformer, served through the prefix cache, with an oracle.

Three pieces:

- `Processor`: a toy, deterministic tokenizer (word ids derived with keyed
  blake3, never ``hash()``), chat markers, and one run of placeholder tokens
  per image (one token per ``image_patch_size`` square patch) or audio clip
  (one token per ``audio_frame_ms`` frame). `Processor.annotate` digests each
  distinct item once and builds the `AnnotatedTokens` the block keys cover.
- `TinyOmniModel`: a pre-LN causal transformer in float32 with fixed random
  weights (``torch.Generator`` seeded by the config). Image-patch and
  audio-frame embedders turn the actual pixels and samples into the
  embeddings at the placeholder positions, so another image changes every
  later hidden state.
- `ServingEngine`: serves requests one at a time with a `PrefixCache` per
  (tenant, salt) over one shared `BlockPool`, and a `TensorStore` attached to
  the pool's evictions that keeps, per block, each layer's keys and values
  (entries ``layer{i}.k``, ``layer{i}.v``) and the final hidden states
  (``hidden_states``). On a hit the model computes only the suffix, attending
  over the cached K/V, and the merged hidden states are read back through the
  store's stamped reads, so a stale block is counted, never served.

The exactness oracle (`run_cached`) computes every request from scratch
without the cache (`compute_reference`, right before serving it, so both
timings see the same machine load) and requires the hidden states of all
prompt tokens and the next-token logits served with the cache to match,
``torch.allclose(atol=ATOL, rtol=RTOL)`` with 1e-5 each. Both paths run the
same float32 kernels and differ only in how rows are grouped into matrix
products, which moves results by ~1e-6 at most on the demo.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import blake3
import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from hashing import Algorithm, ContentHash, hash_audio, hash_image
from omnicache.annotations import AnnotatedTokens
from omnicache.block_hash import DEFAULT_BLOCK_ALGORITHM, BlockHash, BlockHasher
from omnicache.block_pool import BlockPool
from omnicache.prefix_cache import PrefixCache
from omnicache.preprocess import annotate_prompt
from omnicache.store import BlockTier, ScheduledRequest, TensorStore
from omnicache.workloads import AudioItem, ImageItem, MediaItem, Message, Trace, TraceRequest

__all__ = [
    "ATOL",
    "AUDIO_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "RTOL",
    "CacheConfig",
    "ForwardOutput",
    "ModelConfig",
    "PlaceholderRun",
    "Processor",
    "Reference",
    "RunReport",
    "Served",
    "ServingEngine",
    "TinyOmniModel",
    "TokenizedPrompt",
    "best_hit_tokens",
    "check_fits",
    "compute_reference",
    "run_cached",
    "run_reference",
]

ATOL = 1e-5
RTOL = 1e-5

# Token ids below FIRST_WORD_ID are markers; words map into the rest.
BOS_TOKEN_ID = 1
IMAGE_TOKEN_ID = 2
AUDIO_TOKEN_ID = 3
END_TOKEN_ID = 7
_ROLE_TOKEN_IDS = {"system": 4, "user": 5, "assistant": 6}
FIRST_WORD_ID = 16

_WORD_RE = re.compile(r"\w+|[^\w\s]")
# A fixed key: word ids are the same in every process and on every machine.
_TOKENIZER_KEY = blake3.blake3(b"omnicache.demo.tokenizer/v1").digest()

# Features per image patch: the patch average-pooled to 8 x 8 RGB pixels.
_POOLED = 8
# Features per audio frame: the frame resampled to this many points.
_FRAME_POINTS = 64

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes of `TinyOmniModel` and of its placeholder runs."""

    vocab_size: int = 4096
    hidden_size: int = 384
    num_layers: int = 4
    num_heads: int = 6
    mlp_size: int = 1536
    # Longest prompt, in tokens.
    max_positions: int = 4096
    # Pixels on a side of one image patch (one placeholder token); a multiple of 8.
    image_patch_size: int = 32
    # Milliseconds of audio per placeholder token.
    audio_frame_ms: int = 40
    seed: int = 0
    name: str = "omnicache-tiny-omni"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "mlp_size",
            "max_positions",
            "image_patch_size",
            "audio_frame_ms",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, found {value!r}")
        if self.vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"vocab_size: expected > {FIRST_WORD_ID}, found {self.vocab_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size: expected a multiple of num_heads ({self.num_heads}), "
                f"found {self.hidden_size}"
            )
        if self.image_patch_size % _POOLED:
            raise ValueError(
                f"image_patch_size: expected a multiple of {_POOLED}, found {self.image_patch_size}"
            )

    @property
    def namespace(self) -> str:
        """Block-key namespace: another model (or other weights) never shares a chain."""
        return (
            f"{self.name}/v{self.vocab_size}-d{self.hidden_size}-l{self.num_layers}"
            f"-h{self.num_heads}-m{self.mlp_size}-p{self.image_patch_size}"
            f"-a{self.audio_frame_ms}-s{self.seed}"
        )

    def flops(self, num_tokens: int, num_cached: int = 0) -> int:
        """Multiply-adds x 2 to compute tokens ``num_cached .. num_tokens - 1`` of a prompt.

        Projections and MLP per new token, attention over every earlier token,
        and the next-token logits; embedders are not counted.
        """
        d, m = self.hidden_size, self.mlp_size
        num_new = num_tokens - num_cached
        per_token = 2 * (4 * d * d + 2 * d * m)
        # Each new token at position p attends to p + 1 keys (scores and sum).
        num_pairs = (num_tokens * (num_tokens + 1) - num_cached * (num_cached + 1)) // 2
        return self.num_layers * (num_new * per_token + 4 * d * num_pairs) + 2 * d * self.vocab_size


# -- processor ----------------------------------------------------------------------


class PlaceholderRun(NamedTuple):
    """Tokens ``[offset, offset + length)`` of a prompt stand for ``item``."""

    item: MediaItem
    offset: int
    length: int


class TokenizedPrompt(NamedTuple):
    token_ids: list[int]
    runs: tuple[PlaceholderRun, ...]


class Processor:
    """Turns a request's messages into token ids, placeholder runs and annotated tokens.

    Args:
        config: The model's sizes (vocabulary, patch size, frame length).
        algorithm: Content-digest algorithm for images and audio.
    """

    def __init__(self, config: ModelConfig, *, algorithm: Algorithm = "blake3") -> None:
        self.config = config
        self.algorithm: Algorithm = algorithm
        self._word_ids: dict[str, int] = {}
        # id(item) -> (item, digest); the item is kept so that its id stays its own.
        self._digests: dict[int, tuple[MediaItem, ContentHash]] = {}
        self.num_items_hashed = 0

    def encode_text(self, text: str) -> list[int]:
        """Word and punctuation ids of ``text``."""
        ids = []
        span = self.config.vocab_size - FIRST_WORD_ID
        word_ids = self._word_ids
        for word in _WORD_RE.findall(text):
            token_id = word_ids.get(word)
            if token_id is None:
                digest = blake3.blake3(word.encode("utf-8"), key=_TOKENIZER_KEY).digest(8)
                token_id = FIRST_WORD_ID + int.from_bytes(digest, "little") % span
                word_ids[word] = token_id
            ids.append(token_id)
        return ids

    def num_item_tokens(self, item: MediaItem) -> int:
        """Placeholder tokens of an item: image patches, or audio frames."""
        if isinstance(item, ImageItem):
            patch = self.config.image_patch_size
            width, height = item.image.size
            return -(-width // patch) * -(-height // patch)
        frame_samples = item.sample_rate * self.config.audio_frame_ms
        return max(1, -(-item.num_samples * 1000 // frame_samples))

    def tokenize(self, messages: Sequence[Message]) -> TokenizedPrompt:
        """``BOS, (ROLE, parts..., END) per message, ASSISTANT``: the generation prompt.

        A conversation's next turn repeats its earlier messages, so its tokens
        extend the earlier prompt's tokens exactly.
        """
        token_ids = [BOS_TOKEN_ID]
        runs: list[PlaceholderRun] = []
        for message in messages:
            token_ids.append(_ROLE_TOKEN_IDS[message.role])
            for part in message.parts:
                if isinstance(part, str):
                    token_ids.extend(self.encode_text(part))
                    continue
                length = self.num_item_tokens(part)
                placeholder = IMAGE_TOKEN_ID if isinstance(part, ImageItem) else AUDIO_TOKEN_ID
                runs.append(PlaceholderRun(part, len(token_ids), length))
                token_ids.extend([placeholder] * length)
            token_ids.append(END_TOKEN_ID)
        token_ids.append(_ROLE_TOKEN_IDS["assistant"])
        return TokenizedPrompt(token_ids, tuple(runs))

    def content_hash(self, item: MediaItem) -> ContentHash:
        """The item's content digest, computed once per item object."""
        cached = self._digests.get(id(item))
        if cached is not None:
            return cached[1]
        if isinstance(item, ImageItem):
            digest = hash_image(item.image, algorithm=self.algorithm)
        else:
            digest = hash_audio(item.waveform, item.sample_rate, algorithm=self.algorithm)
        self._digests[id(item)] = (item, digest)
        self.num_items_hashed += 1
        return digest

    def annotate(self, prompt: TokenizedPrompt) -> AnnotatedTokens:
        """The prompt as annotated tokens: each run tagged with its item's digest."""
        return annotate_prompt(
            prompt.token_ids,
            [self.content_hash(run.item) for run in prompt.runs],
            placeholder_ranges=[(run.offset, run.length) for run in prompt.runs],
            algorithm=self.algorithm,
        )


# -- model ----------------------------------------------------------------------


class ForwardOutput(NamedTuple):
    """What one forward pass over tokens ``start .. start + n - 1`` computed."""

    # (n, hidden) after the final norm.
    hidden_states: torch.Tensor
    # Per layer, (n, hidden) keys and values of the new tokens.
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # (vocab,) next-token logits of the last token.
    logits: torch.Tensor


@dataclass(slots=True, eq=False)
class _Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    out: torch.Tensor
    norm2: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def _image_pixels(image: ImageItem) -> npt.NDArray[np.float32]:
    rgb = image.image if image.image.mode == "RGB" else image.image.convert("RGB")
    return np.asarray(rgb, dtype=np.float32) / 255.0


class TinyOmniModel:
    """A pre-LN causal transformer with image-patch and audio-frame embedders.

    Weights are drawn once from ``torch.Generator().manual_seed(config.seed)``:
    the same config gives the same model in every process. Float32 on CPU,
    no autograd.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        cfg = ModelConfig() if config is None else config
        self.config = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        d, m = cfg.hidden_size, cfg.mlp_size

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen) / math.sqrt(rows)

        def gain() -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(d, generator=gen)

        self.token_embedding = torch.randn(cfg.vocab_size, d, generator=gen)
        self._logit_scale = 1.0 / math.sqrt(d)
        self.layers = [
            _Layer(gain(), weight(d, 3 * d), weight(d, d), gain(), weight(d, m), weight(m, d))
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = gain()
        patch_features = _POOLED * _POOLED * 3
        self.image_in = weight(patch_features, d)
        self.image_out = weight(d, d)
        self.image_type = torch.randn(d, generator=gen)
        self.audio_in = weight(_FRAME_POINTS, d)
        self.audio_out = weight(d, d)
        self.audio_type = torch.randn(d, generator=gen)
        positions = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None]
        freqs = torch.exp(-math.log(10_000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
        table = torch.zeros(cfg.max_positions, d, dtype=torch.float64)
        table[:, 0::2] = torch.sin(positions * freqs)
        table[:, 1::2] = torch.cos(positions * freqs)
        # NOTE: a table, not sin() per call: a position's encoding must be the
        # same bits whether it is computed in a full prompt or in a suffix.
        self.position_table = table.to(torch.float32)

    # -- embedders ----------------------------------------------------------

    def embed_image(self, image: ImageItem) -> torch.Tensor:
        """(patches, hidden): one row per patch, row-major, edges zero-padded."""
        patch = self.config.image_patch_size
        pixels = _image_pixels(image)
        height, width = pixels.shape[:2]
        rows, cols = -(-height // patch), -(-width // patch)
        padded = np.zeros((rows * patch, cols * patch, 3), np.float32)
        padded[:height, :width] = pixels
        pool = patch // _POOLED
        pooled = padded.reshape(rows, patch, cols, patch, 3).transpose(0, 2, 1, 3, 4)
        pooled = pooled.reshape(rows * cols, _POOLED, pool, _POOLED, pool, 3).mean(axis=(2, 4))
        features = torch.from_numpy(np.ascontiguousarray(pooled.reshape(rows * cols, -1)))
        return torch.tanh(features @ self.image_in) @ self.image_out + self.image_type

    def embed_audio(self, clip: AudioItem) -> torch.Tensor:
        """(frames, hidden): the mono mix of each frame resampled to a fixed size."""
        mono = clip.waveform if clip.waveform.ndim == 1 else clip.waveform.mean(axis=0)
        mono64 = mono.astype(np.float64)
        num_frames = max(
            1, -(-clip.num_samples * 1000 // (clip.sample_rate * self.config.audio_frame_ms))
        )
        frame_len = clip.sample_rate * self.config.audio_frame_ms / 1000.0
        # Sample points at the centres of _FRAME_POINTS equal slices of each frame.
        points = np.arange(num_frames)[:, None] + (np.arange(_FRAME_POINTS) + 0.5) / _FRAME_POINTS
        features = np.interp(points * frame_len, np.arange(mono64.size), mono64, right=0.0)
        rows = torch.from_numpy(features.astype(np.float32))
        return torch.tanh(rows @ self.audio_in) @ self.audio_out + self.audio_type

    def embed(self, prompt: TokenizedPrompt, start: int = 0) -> tuple[torch.Tensor, int]:
        """Input embeddings of tokens ``start ..`` of a prompt.

        Returns:
            ``(rows, num_items_encoded)``: placeholder rows come from their
            item's embedder; an item entirely before ``start`` is not encoded.
        """
        ids = torch.tensor(prompt.token_ids[start:], dtype=torch.int64)
        rows = self.token_embedding[ids]
        num_encoded = 0
        for run in prompt.runs:
            end = run.offset + run.length
            if end <= start:
                continue
            item = run.item
            encoded = (
                self.embed_image(item) if isinstance(item, ImageItem) else self.embed_audio(item)
            )
            lo = max(run.offset, start)
            rows[lo - start : end - start] = encoded[lo - run.offset :]
            num_encoded += 1
        return rows, num_encoded

    # -- transformer --------------------------------------------------------

    def forward(
        self,
        embeds: torch.Tensor,
        start: int = 0,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> ForwardOutput:
        """Runs tokens ``start .. start + n - 1`` given the K/V of tokens ``0 .. start - 1``.

        Args:
            embeds: ``(n, hidden)`` input embeddings, n >= 1.
            start: Position of the first row.
            past: Per layer, ``(start, hidden)`` keys and values of the
                earlier tokens; None or empty only when ``start`` is 0.
        """
        cfg = self.config
        num_new = embeds.shape[0]
        end = start + num_new
        if num_new < 1 or end > cfg.max_positions:
            raise ValueError(
                f"tokens {start}..{end - 1}: expected 1 to {cfg.max_positions - start} new "
                f"tokens (max_positions {cfg.max_positions}), found {num_new}"
            )
        if start and (past is None or len(past) != cfg.num_layers):
            raise ValueError(
                f"past: expected keys and values of {cfg.num_layers} layers for start={start}, "
                f"found {None if past is None else len(past)}"
            )
        d, num_heads = cfg.hidden_size, cfg.num_heads
        head = d // num_heads
        mask = torch.arange(start, end)[:, None] >= torch.arange(end)[None, :]
        x = embeds + self.position_table[start:end]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        with torch.inference_mode():
            for index, layer in enumerate(self.layers):
                h = F.layer_norm(x, (d,), layer.norm1)
                q, k, v = (h @ layer.qkv).chunk(3, dim=1)
                keys.append(k)
                values.append(v)
                if start:
                    assert past is not None
                    past_k, past_v = past[index]
                    k = torch.cat((past_k, k))
                    v = torch.cat((past_v, v))
                attn = F.scaled_dot_product_attention(
                    q.view(num_new, num_heads, head).transpose(0, 1),
                    k.view(end, num_heads, head).transpose(0, 1),
                    v.view(end, num_heads, head).transpose(0, 1),
                    attn_mask=mask,
                )
                x = x + attn.transpose(0, 1).reshape(num_new, d) @ layer.out
                h = F.layer_norm(x, (d,), layer.norm2)
                x = x + F.gelu(h @ layer.up) @ layer.down
            hidden = F.layer_norm(x, (d,), self.final_norm)
            # Scaled so that logits are O(1), like the hidden states: the
            # oracle's tolerance is absolute as well as relative.
            logits = self.token_embedding @ hidden[-1] * self._logit_scale
        return ForwardOutput(hidden, keys, values, logits)


# -- serving with the cache ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The cache's geometry and keys."""

    num_blocks: int = 160
    block_size: int = 16
    # Block-key algorithm (None: omnicache's default, DEFAULT_BLOCK_ALGORITHM).
    algorithm: Algorithm | None = None
    # Deployment-wide salt, mixed into every tenant's salt.
    salt: str = ""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, found {value!r}")

    @property
    def block_algorithm(self) -> Algorithm:
        return DEFAULT_BLOCK_ALGORITHM if self.algorithm is None else self.algorithm


def _salt_of(cache_config: CacheConfig, request: TraceRequest) -> str:
    # NOTE: the tenant is part of the salt, so two tenants never share a
    # chain even when their own salts are equal or missing. JSON of a list
    # is injective over (deployment salt, tenant, request salt).
    return json.dumps([cache_config.salt, request.tenant, request.cache_salt])


class Served(NamedTuple):
    """One request served with the cache."""

    hidden_states: torch.Tensor
    logits: torch.Tensor
    num_tokens: int
    num_hit_tokens: int
    # Prompt tokens the model computed (the whole prompt after a stale read).
    num_computed_tokens: int
    num_items_encoded: int
    stale: bool
    # Hit tokens whose blocks came from the tier (a part of num_hit_tokens).
    num_tier_hit_tokens: int = 0


class ServingEngine:
    """Serves requests one at a time with per-block K/V and hidden states cached.

    One `BlockPool` and one `TensorStore` (attached to the pool's evictions)
    are shared by every tenant; each (tenant, salt) gets its own
    `BlockHasher` and `PrefixCache` over that pool, so tenants compete for
    room but never share a block.

    With a ``tier`` (a `BlockTier`, such as a `RedisTier` that other engine
    processes share), every block the store stamps is offered to it, and the
    blocks that follow a local hit are looked up there before they are
    computed: what the tier holds is filled in and served as a hit.
    """

    def __init__(
        self,
        model: TinyOmniModel,
        processor: Processor,
        cache_config: CacheConfig,
        *,
        tier: BlockTier | None = None,
    ) -> None:
        self.model = model
        self.processor = processor
        self.cache_config = cache_config
        cfg = model.config
        self.pool = BlockPool(cache_config.num_blocks, cache_config.block_size)
        self.store = TensorStore(
            cache_config.num_blocks,
            cache_config.block_size,
            hidden_size=cfg.hidden_size,
            hidden_dtype=torch.float32,
            tier=tier,
        )
        self.kv_names = [
            name for i in range(cfg.num_layers) for name in (f"layer{i}.k", f"layer{i}.v")
        ]
        for name in self.kv_names:
            self.store.register(name, cfg.hidden_size, torch.float32)
        self.store.attach(self.pool)
        self._no_rows = torch.empty(0, cfg.hidden_size)
        self._caches: dict[str, PrefixCache] = {}

    def prefix_cache(self, request: TraceRequest) -> PrefixCache:
        """The request's (tenant, salt) facade over the shared pool."""
        salt = _salt_of(self.cache_config, request)
        cache = self._caches.get(salt)
        if cache is None:
            hasher = BlockHasher(
                self.cache_config.block_size,
                algorithm=self.cache_config.block_algorithm,
                namespace=self.model.config.namespace,
                cache_salt=salt,
            )
            cache = self._caches[salt] = PrefixCache(self.pool, hasher)
        return cache

    def block_hashes(self, request: TraceRequest, prompt: AnnotatedTokens) -> list[BlockHash]:
        """Keys of the prompt's full blocks in the request's chain."""
        return self.prefix_cache(request).block_hasher.hash_blocks(prompt)

    def serve(self, request: TraceRequest) -> Served:
        """Prefill one prompt: cached prefix from the store, the rest computed and stored."""
        tokenized = self.processor.tokenize(request.messages)
        prompt = self.processor.annotate(tokenized)
        cache = self.prefix_cache(request)
        rid = request.request_id
        admitted = cache.add_request(rid, prompt)
        if admitted is None:
            raise RuntimeError(
                f"request {rid!r}: {len(prompt)} tokens do not fit in "
                f"{self.pool.num_free_blocks} free blocks with no request running"
            )
        try:
            num_hit = admitted.num_cached_tokens
            num_tier = self._read_through(cache, rid, admitted.block_ids, num_hit, len(prompt))
            served = self._prefill(cache, rid, tokenized, admitted.block_ids, num_hit + num_tier)
            return served._replace(num_tier_hit_tokens=num_tier)
        finally:
            cache.free(rid)

    def _read_through(
        self,
        cache: PrefixCache,
        rid: str,
        block_ids: Sequence[int],
        num_hit: int,
        num_tokens: int,
    ) -> int:
        """Fills the blocks after the local hit from the tier; returns the tokens filled.

        The hit stays capped at ``num_tokens - 1`` tokens in whole blocks (the
        last prompt token is always computed), as for a local hit.
        """
        if self.store.tier is None:
            return 0
        bs = self.cache_config.block_size
        first = num_hit // bs
        last = (num_tokens - 1) // bs
        if last <= first:
            return 0
        keys = cache.block_hashes(rid)[first:last]
        num_found = self.store.read_through(block_ids[first:last], keys)
        if num_found:
            # NOTE: registered like computed blocks, so later requests hit
            # them locally and the pool's evictions clear their stamps.
            cache.mark_computed(rid, (first + num_found) * bs)
        return num_found * bs

    def _prefill(
        self,
        cache: PrefixCache,
        rid: str,
        tokenized: TokenizedPrompt,
        block_ids: Sequence[int],
        num_hit: int,
    ) -> Served:
        model, store = self.model, self.store
        bs = self.cache_config.block_size
        num_tokens = len(tokenized.token_ids)
        keys = cache.block_hashes(rid)
        num_hit_blocks = num_hit // bs
        hit_ids = list(block_ids[:num_hit_blocks])
        hit_keys = keys[:num_hit_blocks]
        start = num_hit
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        stale = False
        if num_hit_blocks:
            read = store.read_merged(
                [ScheduledRequest(rid, 0, 0, hit_ids, hit_keys)],
                multimodal_outputs={name: self._no_rows for name in self.kv_names},
            )
            if read.misses:
                # NOTE: never served: the prompt is recomputed from its start,
                # and the hit blocks (shared with others) are not written.
                stale = True
                start = 0
            else:
                rows = read.tensors
                past = [
                    (rows[f"layer{i}.k"][rid], rows[f"layer{i}.v"][rid])
                    for i in range(model.config.num_layers)
                ]
        embeds, num_encoded = model.embed(tokenized, start)
        out = model.forward(embeds, start, past)
        new = slice(num_hit - start, None)
        if stale:
            hidden = out.hidden_states
        else:
            merged = store.read_merged(
                [ScheduledRequest(rid, num_tokens - num_hit, num_hit, hit_ids, hit_keys)],
                hidden_states=out.hidden_states[new],
            )
            if merged.misses:
                raise RuntimeError(
                    f"request {rid!r}: hit blocks lost their stamps while the request held them"
                )
            hidden = merged.hidden_states[rid]
        positions = np.arange(num_hit, num_tokens)
        ids = np.asarray(block_ids, dtype=np.int64)
        slots = ids[positions // bs] * bs + positions % bs
        # Stamp the new full blocks, except one whose key another block already
        # holds (a fully cached, block-aligned prompt recomputes its last
        # block): the pool keeps that key on the other block.
        block_keys = {
            block_ids[b]: keys[b]
            for b in range(num_hit_blocks, num_tokens // bs)
            if self.pool.get_cached_block(keys[b]) is None
        }
        outputs: dict[str, object] = {}
        for i in range(model.config.num_layers):
            # NOTE: keys and values are column slices of the fused QKV product;
            # the store copies rows by viewing them, which needs them packed.
            outputs[f"layer{i}.k"] = out.keys[i][new].contiguous()
            outputs[f"layer{i}.v"] = out.values[i][new].contiguous()
        store.write_outputs(
            slots, hidden_states=out.hidden_states[new], multimodal_outputs=outputs,
            block_keys=block_keys,
        )  # fmt: skip
        cache.mark_computed(rid, num_tokens)
        return Served(
            hidden_states=hidden,
            logits=out.logits,
            num_tokens=num_tokens,
            num_hit_tokens=num_hit,
            num_computed_tokens=num_tokens - start,
            num_items_encoded=num_encoded,
            stale=stale,
        )


def best_hit_tokens(
    prompts: Iterable[Sequence[BlockHash]], num_tokens: Iterable[int], block_size: int
) -> list[int]:
    """Per prompt, the hit an infinite cache gives when prompts arrive in this order.

    Every full block of every earlier prompt is cached; a hit is the longest
    run of leading keys seen before, capped at ``num_tokens - 1`` tokens in
    whole blocks (the last prompt token is always computed).

    Args:
        prompts: Per prompt, the keys of its full blocks.
        num_tokens: Per prompt, its length in tokens.
        block_size: Tokens per block.
    """
    seen: set[BlockHash] = set()
    hits: list[int] = []
    for keys, length in zip(prompts, num_tokens, strict=True):
        cap = (length - 1) // block_size
        num_hit = 0
        while num_hit < cap and keys[num_hit] in seen:
            num_hit += 1
        hits.append(num_hit * block_size)
        seen.update(keys)
    return hits


# -- runs ------------------------------------------------------------------------------


class Reference(NamedTuple):
    """A request computed from scratch without the cache."""

    hidden_states: torch.Tensor
    logits: torch.Tensor
    seconds: float
    num_items_encoded: int


def compute_reference(
    model: TinyOmniModel, processor: Processor, request: TraceRequest
) -> Reference:
    """Computes one prompt from scratch, without the cache, and times it."""
    t0 = time.perf_counter()
    tokenized = processor.tokenize(request.messages)
    embeds, num_encoded = model.embed(tokenized)
    out = model.forward(embeds)
    return Reference(out.hidden_states, out.logits, time.perf_counter() - t0, num_encoded)


def run_reference(
    model: TinyOmniModel,
    processor: Processor,
    trace: Trace,
    progress: ProgressFn | None = None,
) -> list[Reference]:
    """Computes every prompt of the trace from scratch: the oracle's answers and baseline time."""
    references: list[Reference] = []
    for index, request in enumerate(trace.requests):
        references.append(compute_reference(model, processor, request))
        if progress is not None:
            progress(index + 1, trace.num_requests)
    return references


@dataclass(slots=True)
class RunReport:
    """Totals of one pass over a trace with the cache, checked against the references."""

    num_blocks: int
    block_size: int
    block_algorithm: str
    content_algorithm: str
    num_requests: int = 0
    num_tenants: int = 0
    num_prompt_tokens: int = 0
    num_hit_tokens: int = 0
    # Hit tokens filled from the tier (a part of num_hit_tokens).
    num_tier_hit_tokens: int = 0
    num_best_hit_tokens: int = 0
    # Distinct full-block keys in the trace: a pool this large never evicts.
    num_distinct_blocks: int = 0
    flops_full: int = 0
    flops_cached: int = 0
    num_items: int = 0
    num_items_encoded: int = 0
    seconds_reference: float = 0.0
    seconds_cached: float = 0.0
    num_evictions: int = 0
    num_stale_reads: int = 0
    num_mismatches: int = 0
    max_abs_diff: float = 0.0
    mismatched_requests: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        total = self.num_prompt_tokens
        return self.num_best_hit_tokens / total if total else 0.0

    @property
    def flops_saved(self) -> float:
        return 1.0 - self.flops_cached / self.flops_full if self.flops_full else 0.0

    @property
    def speedup(self) -> float:
        return self.seconds_reference / self.seconds_cached if self.seconds_cached else 0.0

    @property
    def ok(self) -> bool:
        return self.num_mismatches == 0 and self.num_stale_reads == 0


def check_fits(
    model: TinyOmniModel, processor: Processor, trace: Trace, cache_config: CacheConfig
) -> int:
    """Checks that every prompt fits the model and the pool; returns the longest prompt's tokens.

    Raises:
        ValueError: A prompt is longer than ``max_positions``, or needs more
            blocks than the pool has (it could never be admitted).
    """
    longest = 0
    longest_id = ""
    for request in trace.requests:
        num_tokens = len(processor.tokenize(request.messages).token_ids)
        if num_tokens > longest:
            longest, longest_id = num_tokens, request.request_id
    max_positions = model.config.max_positions
    if longest > max_positions:
        raise ValueError(
            f"request {longest_id!r}: expected at most {max_positions} tokens "
            f"(the model's max_positions), found {longest}"
        )
    bs = cache_config.block_size
    needed = -(-longest // bs)
    if needed > cache_config.num_blocks:
        raise ValueError(
            f"num_blocks: expected at least {needed} (request {longest_id!r} has {longest} "
            f"tokens, {needed} blocks of {bs}), found {cache_config.num_blocks}"
        )
    return longest


def run_cached(
    model: TinyOmniModel,
    processor: Processor,
    trace: Trace,
    cache_config: CacheConfig,
    references: MutableSequence[Reference],
    progress: ProgressFn | None = None,
    *,
    engine: ServingEngine | None = None,
) -> RunReport:
    """Serves the trace with the cache and checks every request against its reference.

    Args:
        model, processor: As for `run_reference`.
        trace: The requests, served in order.
        cache_config: The cache's geometry and keys.
        references: References of the first ``len(references)`` requests
            (`run_reference`); each missing one is computed right before its
            request is served with the cache and appended, so that both
            timings of a request see the same machine load.
        progress: Called as ``progress(done, total)`` after each request.
        engine: An engine to serve with (default: a new one from ``cache_config``).

    Returns:
        The totals; ``report.ok`` is False when any request mismatched its
        reference or hit a stale block.
    """
    if len(references) > trace.num_requests:
        raise ValueError(
            f"references: expected at most {trace.num_requests} (one per request), "
            f"found {len(references)}"
        )
    check_fits(model, processor, trace, cache_config)
    if engine is None:
        engine = ServingEngine(model, processor, cache_config)
    bs = cache_config.block_size
    report = RunReport(
        num_blocks=cache_config.num_blocks,
        block_size=bs,
        block_algorithm=cache_config.block_algorithm,
        content_algorithm=processor.algorithm,
        num_requests=trace.num_requests,
        num_tenants=len({_salt_of(cache_config, r) for r in trace.requests}),
    )
    # The best any cache could do, from the keys alone (not timed).
    all_keys: list[list[BlockHash]] = []
    lengths: list[int] = []
    for request in trace.requests:
        prompt = processor.annotate(processor.tokenize(request.messages))
        all_keys.append(engine.block_hashes(request, prompt))
        lengths.append(len(prompt))
    report.num_best_hit_tokens = sum(best_hit_tokens(all_keys, lengths, bs))
    report.num_distinct_blocks = len({key for keys in all_keys for key in keys})
    evictions_before = engine.pool.num_evictions
    for index, request in enumerate(trace.requests):
        if index == len(references):
            references.append(compute_reference(model, processor, request))
        ref = references[index]
        t0 = time.perf_counter()
        served = engine.serve(request)
        report.seconds_cached += time.perf_counter() - t0
        report.seconds_reference += ref.seconds
        report.num_prompt_tokens += served.num_tokens
        report.num_hit_tokens += served.num_hit_tokens
        report.num_tier_hit_tokens += served.num_tier_hit_tokens
        report.flops_full += model.config.flops(served.num_tokens)
        report.flops_cached += model.config.flops(
            served.num_tokens, served.num_tokens - served.num_computed_tokens
        )
        report.num_items += ref.num_items_encoded
        report.num_items_encoded += served.num_items_encoded
        report.num_stale_reads += int(served.stale)
        same_shape = served.hidden_states.shape == ref.hidden_states.shape
        if same_shape:
            diff = max(
                float((served.hidden_states - ref.hidden_states).abs().max()),
                float((served.logits - ref.logits).abs().max()),
            )
            report.max_abs_diff = max(report.max_abs_diff, diff)
        if not (
            same_shape
            and torch.allclose(served.hidden_states, ref.hidden_states, atol=ATOL, rtol=RTOL)
            and torch.allclose(served.logits, ref.logits, atol=ATOL, rtol=RTOL)
        ):
            report.num_mismatches += 1
            report.mismatched_requests.append(request.request_id)
        if progress is not None:
            progress(index + 1, trace.num_requests)
    report.num_evictions = engine.pool.num_evictions - evictions_before
    return report
