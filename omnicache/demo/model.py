"""The demo's model: a small multimodal causal transformer in float32.

`TinyOmniModel` is a pre-LN causal transformer with fixed random weights
(``torch.Generator`` seeded by the config). Image-patch and audio-frame
embedders turn the actual pixels and samples into the embeddings at the
placeholder positions, so another image changes every later hidden state.
`TinyOmniModel.forward` computes a suffix of a prompt given the keys and
values of the tokens before it, which is what a prefix-cache hit hands it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from omnicache.demo.config import PATCH_POOL, ModelConfig
from omnicache.demo.processor import TokenizedPrompt
from omnicache.demo.workloads import AudioItem, ImageItem

__all__ = ["ForwardOutput", "TinyOmniModel"]

# Features per audio frame: the frame resampled to this many points.
_FRAME_POINTS = 64


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
        patch_features = PATCH_POOL * PATCH_POOL * 3
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
        pool = patch // PATCH_POOL
        pooled = padded.reshape(rows, patch, cols, patch, 3).transpose(0, 2, 1, 3, 4)
        pooled = pooled.reshape(rows * cols, PATCH_POOL, pool, PATCH_POOL, pool, 3).mean(
            axis=(2, 4)
        )
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
