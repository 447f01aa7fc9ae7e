"""The demo's configuration: the model's sizes and vocabulary layout, the cache's geometry.

`ModelConfig` sizes `TinyOmniModel` and the placeholder runs `Processor`
emits; the marker token ids below `FIRST_WORD_ID` are part of it, as a
model's config names its special tokens. `CacheConfig` is what
`ServingEngine` builds its pool, store and block keys from.
"""

from __future__ import annotations

from dataclasses import dataclass

from hashing import ALGORITHMS, Algorithm
from omnicache.block_hash import DEFAULT_BLOCK_ALGORITHM
from omnicache.checks import check_int, check_optional_str, check_str

__all__ = ["CacheConfig", "ModelConfig"]

# Token ids below FIRST_WORD_ID are markers; words map into the rest.
BOS_TOKEN_ID = 1
IMAGE_TOKEN_ID = 2
AUDIO_TOKEN_ID = 3
END_TOKEN_ID = 7
ROLE_TOKEN_IDS = {"system": 4, "user": 5, "assistant": 6}
FIRST_WORD_ID = 16

# Features per image patch: the patch average-pooled to PATCH_POOL x PATCH_POOL RGB pixels.
PATCH_POOL = 8


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
        # Words need at least one id above the markers.
        check_int("vocab_size", self.vocab_size, minimum=FIRST_WORD_ID + 1)
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "mlp_size",
            "max_positions",
            "image_patch_size",
            "audio_frame_ms",
        ):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_str("name", self.name, nonempty=True)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size: expected a multiple of num_heads ({self.num_heads}), "
                f"found {self.hidden_size}"
            )
        if self.image_patch_size % PATCH_POOL:
            raise ValueError(
                f"image_patch_size: expected a multiple of {PATCH_POOL}, "
                f"found {self.image_patch_size}"
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
        check_int("num_blocks", self.num_blocks, minimum=1)
        check_int("block_size", self.block_size, minimum=1)
        algorithm = check_optional_str("algorithm", self.algorithm)
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm: expected one of {', '.join(ALGORITHMS)} or None, found {algorithm!r}"
            )
        check_str("salt", self.salt)

    @property
    def block_algorithm(self) -> Algorithm:
        return DEFAULT_BLOCK_ALGORITHM if self.algorithm is None else self.algorithm
