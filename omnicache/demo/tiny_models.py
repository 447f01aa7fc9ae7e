"""Tiny models for a live vLLM engine, built here with random weights: nothing is downloaded.

`build_text_model` makes a Qwen2 causal LM (hidden 128, 2 layers, 4 heads, 2
KV heads), `build_vl_model` a Qwen2-VL with a 2-layer, 64-wide vision tower
(patch 14, spatial merge 2), `build_audio_model` a Qwen2-Audio with a
2-layer, 64-wide Whisper-style audio encoder (128 mel bins at 16 kHz, 25 audio
tokens a second) and `build_omni_model` the thinker of a Qwen2.5-Omni (the
stage that reads text, images and audio and writes text) with both towers.
All share a byte-level BPE tokenizer trained here on a few sentences (at most
512 learned ids, then the special tokens Qwen's chat template and
placeholders use), wrapped as a ``PreTrainedTokenizerFast`` with a chat
template. Each is a directory of a few MB that vLLM serves as a model.
Weights come from a fixed seed, so a directory built twice is the same model.

Building needs transformers, tokenizers and safetensors (the live engine's
environment has them); they are imported when a model is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "AUDIO_PAD",
    "AUDIO_SAMPLE_RATE",
    "IMAGE_PAD",
    "OMNI_AUDIO_PLACEHOLDER",
    "OMNI_IMAGE_PLACEHOLDER",
    "build_audio_model",
    "build_omni_model",
    "build_talker_model",
    "build_text_model",
    "build_vl_model",
]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
IMAGE_PAD = "<|image_pad|>"
# Qwen2-Audio's: an audio clip is <|audio_bos|>, one <|AUDIO|> per audio token, <|audio_eos|>.
AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
AUDIO_PAD = "<|AUDIO|>"
AUDIO_SAMPLE_RATE = 16000  # Whisper's feature extractor; vLLM resamples nothing at this rate
# Qwen2.5-Omni's placeholders: an image is <|vision_start|><|IMAGE|><|vision_end|>, an
# audio clip <|audio_bos|><|AUDIO|><|audio_eos|>; vLLM repeats the pad once per token.
OMNI_IMAGE_PAD = "<|IMAGE|>"
OMNI_AUDIO_PAD = AUDIO_PAD
OMNI_IMAGE_PLACEHOLDER = f"<|vision_start|>{OMNI_IMAGE_PAD}<|vision_end|>"
OMNI_AUDIO_PLACEHOLDER = f"<|audio_bos|>{OMNI_AUDIO_PAD}<|audio_eos|>"
OMNI_TOKENS = ["<|IMAGE|>", "<|VIDEO|>", *AUDIO_TOKENS]
# The names Qwen2.5-Omni's processor reads from its tokenizer.
OMNI_TOKEN_NAMES = {
    "image_token": OMNI_IMAGE_PAD,
    "video_token": "<|VIDEO|>",
    "audio_token": OMNI_AUDIO_PAD,
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# The talker's own tokens (Qwen2.5-Omni's talker has these among its codec ids).
TALKER_TOKENS = ["<|codec_mask|>", "<|codec_pad|>", "<|codec_bos|>"]
VOCAB_SIZE = 512  # learned ids; the special tokens follow them
PADDED_VOCAB = 576  # the embedding's rows: every id, rounded up
# Small images stay small: 224x224 pixels make 16x16 patches of 14, 64 image tokens.
IMAGE_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

AUDIO_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>",
    "{% if part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>",
)

OMNI_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>",
    f"{{% if part['type'] == 'image' %}}{OMNI_IMAGE_PLACEHOLDER}"
    f"{{% elif part['type'] == 'audio' %}}{OMNI_AUDIO_PLACEHOLDER}",
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefix cache keeps the keys and values of tokens it has seen before.",
    "Describe the picture in one sentence, please, and name every colour in it.",
    "Images, audio and video enter the model as embeddings between text tokens.",
    "0123456789 !?.,;:-+*/=()[]{}<>'\"",
]

# NOTE: transformers and tokenizers objects are Any here (no stubs are
# followed, see pyproject's mypy overrides).
Tokenizer = Any


def _tokenizer(
    extra_special: Sequence[str] = (), *, named_tokens: dict[str, str] | None = None
) -> Tokenizer:
    """The shared tokenizer; ``named_tokens`` become attributes (``tokenizer.image_token``)."""
    from tokenizers import Tokenizer as BPETokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = BPETokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    special = SPECIAL_TOKENS[1:] + list(extra_special)
    named = {} if named_tokens is None else {"extra_special_tokens": named_tokens}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special,
        **named,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer: Tokenizer, extra_special: Sequence[str] = ()) -> dict[str, int]:
    convert = tokenizer.convert_tokens_to_ids
    ids = {token: int(convert(token)) for token in [*SPECIAL_TOKENS, *extra_special]}
    if max(ids.values()) >= PADDED_VOCAB:
        raise AssertionError(f"special token ids {ids} exceed the vocabulary {PADDED_VOCAB}")
    return ids


def _text_config_kwargs(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "vocab_size": PADDED_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
    }


# Qwen2-VL's multimodal rotary sections (time, height, width) over 32-value heads.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}


def _save_renamed(model: Any, path: Path, renames: dict[str, str]) -> None:
    """Saves ``model``'s weights as ``model.safetensors`` under the names vLLM loads.

    ``renames`` maps each name prefix to its replacement ("" keeps it); every
    weight must start with one of them. Tied weights are saved once each.
    """
    from safetensors.torch import save_file

    weights: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        (prefix,) = [prefix for prefix in renames if name.startswith(prefix)]
        weights[renames[prefix] + name[len(prefix) :]] = tensor.clone().contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _widened(kwargs: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """A text model's config widened to ``hidden_size`` (heads of 32 values, the MLP twice
    as wide): a tiny-but-wide model whose steps move rows as wide as a real model's."""
    if hidden_size == kwargs["hidden_size"]:
        return kwargs
    return {
        **kwargs,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": hidden_size // 32,
        "num_key_value_heads": 2,
    }


def build_text_model(path: Path, *, hidden_size: int = 128) -> Path:
    """A tiny Qwen2 causal LM and its tokenizer in ``path``; returns ``path``.

    ``hidden_size`` widens it (`_widened`).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _tokenizer()
    kwargs = _widened(_text_config_kwargs(_token_ids(tokenizer)), hidden_size)
    config = Qwen2Config(**kwargs)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_vl_model(path: Path, *, hidden_size: int = 128) -> Path:
    """A tiny Qwen2-VL, its tokenizer and its processor in ``path``; returns ``path``.

    ``hidden_size`` widens its language model (`_widened`), and the vision
    tower's output with it.
    """
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _tokenizer()
    ids = _token_ids(tokenizer)
    text = _widened(_text_config_kwargs(ids), hidden_size)
    config = Qwen2VLConfig(
        text_config={**text, "rope_parameters": _MROPE},
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(path)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**IMAGE_PIXELS),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**IMAGE_PIXELS),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def _whisper_front_end() -> Any:
    """Whisper's front end at 16 kHz: 100 mel frames a second, padded to 30 s."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=128, sampling_rate=AUDIO_SAMPLE_RATE, return_attention_mask=True
    )


def build_audio_model(path: Path) -> Path:
    """A tiny Qwen2-Audio, its tokenizer and its processor in ``path``; returns ``path``."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
    )

    tokenizer = _tokenizer(AUDIO_TOKENS)
    tokenizer.chat_template = AUDIO_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, AUDIO_TOKENS)
    config = Qwen2AudioConfig(
        # transformers' Qwen2-Audio keeps an lm_head of its own: untied, as it loads.
        text_config={
            **_text_config_kwargs(ids),
            "model_type": "qwen2",
            "tie_word_embeddings": False,
        },
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "max_source_positions": 1500,  # 30 s of mel frames, halved by the encoder
        },
        audio_token_index=ids[AUDIO_PAD],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config)
    model.save_pretrained(path)
    # NOTE: transformers 5.19 saves this model's language model as
    # "language_model.model.model.*" (it applies two of its renamings backwards),
    # which vLLM cannot load: write the weights under the names of Qwen's
    # published checkpoints instead.
    _save_renamed(
        model,
        path,
        {
            "lm_head.": "language_model.lm_head.",
            "model.language_model.": "language_model.model.",
            "model.audio_tower.": "audio_tower.",
            "model.multi_modal_projector.": "multi_modal_projector.",
        },
    )
    # The encoder makes one audio token of every 4 mel frames (25 a second).
    processor = Qwen2AudioProcessor(
        feature_extractor=_whisper_front_end(),
        tokenizer=tokenizer,
        chat_template=AUDIO_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings off while building (restored after)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def build_omni_model(path: Path, *, hidden_size: int = 128) -> Path:
    """A tiny Qwen2.5-Omni thinker, its tokenizer and its processor in ``path``; returns ``path``.

    The thinker is the stage of Qwen2.5-Omni that reads text, images and audio
    and writes text: a 2-layer, 64-wide Qwen2.5-VL vision tower (patch 14,
    spatial merge 2, one 112-pixel attention window), a 2-layer, 64-wide
    Whisper-style audio encoder (128 mel bins at 16 kHz, 25 audio tokens a
    second) and the text model of `build_text_model`. vLLM serves a
    Qwen2.5-Omni checkpoint by its thinker alone, so only the thinker's
    weights are written (as ``thinker.*``); the talker and the vocoder are
    configuration only, with audio output off. ``hidden_size`` widens its
    text model (`_widened`), and both towers' outputs with it.
    """
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniProcessor,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _tokenizer(OMNI_TOKENS, named_tokens=OMNI_TOKEN_NAMES)
    tokenizer.chat_template = OMNI_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, OMNI_TOKENS)
    thinker = Qwen2_5OmniThinkerConfig(
        text_config={**_widened(_text_config_kwargs(ids), hidden_size), "rope_parameters": _MROPE},
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [1],
        },
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "output_dim": hidden_size,
            "max_source_positions": 1500,
        },
        audio_token_index=ids[OMNI_AUDIO_PAD],
        image_token_index=ids[OMNI_IMAGE_PAD],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        user_token_id=ids["<|im_start|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(thinker)
    # NOTE: the talker's and the vocoder's defaults name token ids past this
    # vocabulary; they are never built, so their warnings are silenced.
    with _quiet_transformers():
        config = Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniModel"]
    config.save_pretrained(path)
    _save_renamed(model, path, {"": "thinker."})
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**IMAGE_PIXELS),
        video_processor=Qwen2VLVideoProcessor(**IMAGE_PIXELS),
        feature_extractor=_whisper_front_end(),
        tokenizer=tokenizer,
        chat_template=OMNI_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def build_talker_model(
    path: Path, *, thinker_hidden_size: int = 128, hidden_size: int = 64
) -> Path:
    """A tiny talker for `build_omni_model`'s thinker in ``path``; returns ``path``.

    A Qwen2 causal LM of ``hidden_size`` (heads of 32 values, 2 layers; the
    shared tokenizer with `TALKER_TOKENS` added) and its hand-off,
    ``omnicache_talker/projection.safetensors`` (`omnicache.pipeline.TalkerRecipe`): a
    projection from ``thinker_hidden_size`` with weights drawn from a fixed
    seed (scaled by ``thinker_hidden_size ** -0.5``, so projected rows stay
    near the embeddings' scale), and the ids of `TALKER_TOKENS`. vLLM serves
    it as any causal LM; its prompts are embeddings.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from omnicache.pipeline import TalkerRecipe

    tokenizer = _tokenizer(TALKER_TOKENS)
    ids = _token_ids(tokenizer, TALKER_TOKENS)
    # NOTE: its prompts are the thinker's positions and its own tokens after them.
    kwargs = {**_widened(_text_config_kwargs(ids), hidden_size), "max_position_embeddings": 4096}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    scale = thinker_hidden_size**-0.5
    recipe = TalkerRecipe(
        weight=torch.randn(hidden_size, thinker_hidden_size, generator=generator) * scale,
        bias=torch.randn(hidden_size, generator=generator) * 0.02,
        embeddings=model.get_input_embeddings().weight.detach().clone(),
        codec_mask_id=ids[TALKER_TOKENS[0]],
        codec_pad_id=ids[TALKER_TOKENS[1]],
        codec_bos_id=ids[TALKER_TOKENS[2]],
    )
    recipe.save(path)
    return path
