"""Tiny models for a live vLLM engine, built here with random weights: nothing is downloaded.

`build_text_model` makes a Qwen2 causal LM (hidden 128, 2 layers, 4 heads, 2
KV heads), `build_vl_model` a Qwen2-VL with a 2-layer, 64-wide vision tower
(patch 14, spatial merge 2) and `build_audio_model` a Qwen2-Audio with a
2-layer, 64-wide Whisper-style audio encoder (128 mel bins at 16 kHz, 25 audio
tokens a second); all share a byte-level BPE tokenizer trained here on a few
sentences (at most 512 learned ids, then the special tokens Qwen's chat
template and image placeholders use; the audio model adds Qwen2-Audio's three
audio tokens), wrapped as a ``PreTrainedTokenizerFast`` with a chat template.
Each is a directory of a few MB that vLLM serves as a model. Weights come from
a fixed seed, so a directory built twice is the same model.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "AUDIO_PAD",
    "AUDIO_SAMPLE_RATE",
    "IMAGE_PAD",
    "build_audio_model",
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
VOCAB_SIZE = 512  # learned ids; the special tokens follow them
PADDED_VOCAB = 576  # the embedding's rows: every id, rounded up

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

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefix cache keeps the keys and values of tokens it has seen before.",
    "Describe the picture in one sentence, please, and name every colour in it.",
    "Images, audio and video enter the model as embeddings between text tokens.",
    "0123456789 !?.,;:-+*/=()[]{}<>'\"",
]


def _tokenizer(extra_special: list[str] = ()) -> object:  # type: ignore[assignment]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    special = SPECIAL_TOKENS[1:] + list(extra_special)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer: object, extra_special: list[str] = ()) -> dict[str, int]:  # type: ignore[assignment]
    convert = tokenizer.convert_tokens_to_ids  # type: ignore[attr-defined]
    ids = {token: int(convert(token)) for token in [*SPECIAL_TOKENS, *extra_special]}
    if max(ids.values()) >= PADDED_VOCAB:
        raise AssertionError(f"special token ids {ids} exceed the vocabulary {PADDED_VOCAB}")
    return ids


def _text_config_kwargs(ids: dict[str, int]) -> dict[str, object]:
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


def build_text_model(path: Path, *, hidden_size: int = 128) -> Path:
    """A tiny Qwen2 causal LM and its tokenizer in ``path``; returns ``path``.

    ``hidden_size`` widens it (heads of 32 values, the MLP twice as wide):
    a tiny-but-wide model whose steps move rows as wide as a real model's.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _tokenizer()
    kwargs = _text_config_kwargs(_token_ids(tokenizer))
    if hidden_size != 128:
        kwargs.update(
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_attention_heads=hidden_size // 32,
            num_key_value_heads=2,
        )
    config = Qwen2Config(**kwargs)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
    return path


def build_vl_model(path: Path) -> Path:
    """A tiny Qwen2-VL, its tokenizer and its processor in ``path``; returns ``path``."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _tokenizer()
    ids = _token_ids(tokenizer)
    text = _text_config_kwargs(ids)
    config = Qwen2VLConfig(
        text_config={
            **text,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
        },
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 128,
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
    # Small images stay small: 224x224 pixels make 16x16 patches, 64 image tokens.
    pixels = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}
    image_processor = Qwen2VLImageProcessor(**pixels)
    video_processor = Qwen2VLVideoProcessor(**pixels)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def build_audio_model(path: Path) -> Path:
    """A tiny Qwen2-Audio, its tokenizer and its processor in ``path``; returns ``path``."""
    from safetensors.torch import save_file
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = _tokenizer(AUDIO_TOKENS)
    tokenizer.chat_template = AUDIO_CHAT_TEMPLATE  # type: ignore[attr-defined]
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
    renames = {
        "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.",
        "model.audio_tower.": "audio_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
    }
    weights = {}
    for name, tensor in model.state_dict().items():
        (prefix,) = [prefix for prefix in renames if name.startswith(prefix)]
        weights[renames[prefix] + name[len(prefix) :]] = tensor.contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    # Whisper's front end at 16 kHz: 100 mel frames a second, padded to 30 s;
    # the encoder makes one audio token of every 4 frames (25 a second).
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=AUDIO_SAMPLE_RATE, return_attention_mask=True
    )
    processor = Qwen2AudioProcessor(
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=AUDIO_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path
