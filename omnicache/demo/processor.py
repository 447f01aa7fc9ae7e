"""Prompts to tokens: a toy, deterministic processor for the demo's model.

`Processor` turns a request's messages into token ids (word ids derived with
keyed blake3, never ``hash()``), chat markers, and one run of placeholder
tokens per image (one token per ``image_patch_size`` square patch) or audio
clip (one token per ``audio_frame_ms`` frame). `Processor.annotate` digests
each distinct item once and builds the `AnnotatedTokens` the block keys cover.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

import blake3

from hashing import Algorithm, ContentHash
from omnicache.annotations import AnnotatedTokens
from omnicache.demo.config import (
    AUDIO_TOKEN_ID,
    BOS_TOKEN_ID,
    END_TOKEN_ID,
    FIRST_WORD_ID,
    IMAGE_TOKEN_ID,
    ROLE_TOKEN_IDS,
    ModelConfig,
)
from omnicache.demo.workloads import ImageItem, MediaItem, Message
from omnicache.identity import item_identity
from omnicache.preprocess import annotate_prompt

__all__ = ["Processor", "TokenizedPrompt"]

_WORD_RE = re.compile(r"\w+|[^\w\s]")
# A fixed key: word ids are the same in every process and on every machine.
_TOKENIZER_KEY = blake3.blake3(b"omnicache.demo.tokenizer/v1").digest()


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
            token_ids.append(ROLE_TOKEN_IDS[message.role])
            for part in message.parts:
                if isinstance(part, str):
                    token_ids.extend(self.encode_text(part))
                    continue
                length = self.num_item_tokens(part)
                placeholder = IMAGE_TOKEN_ID if isinstance(part, ImageItem) else AUDIO_TOKEN_ID
                runs.append(PlaceholderRun(part, len(token_ids), length))
                token_ids.extend([placeholder] * length)
            token_ids.append(END_TOKEN_ID)
        token_ids.append(ROLE_TOKEN_IDS["assistant"])
        return TokenizedPrompt(token_ids, tuple(runs))

    def content_hash(self, item: MediaItem) -> ContentHash:
        """The item's identity (`omnicache.identity`), computed once per item object."""
        cached = self._digests.get(id(item))
        if cached is not None:
            return cached[1]
        if isinstance(item, ImageItem):
            digest = item_identity(item.image, modality="image", algorithm=self.algorithm)
        else:
            clip = (item.waveform, item.sample_rate)
            digest = item_identity(clip, modality="audio", algorithm=self.algorithm)
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
