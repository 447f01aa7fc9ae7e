"""Tiny random-weight models of the architectures in the live matrix (test_vllm_architectures).

Each builder writes a directory vLLM 0.32's CPU engine serves: a real config
and a real processor of the architecture (nothing downloaded), weights from
``torch.manual_seed(0)``, in the style of `omnicache.demo.tiny_models`, whose
tokenizer, text sizes and Whisper front end they share: Qwen2.5-VL (images and
video), Idefics3, LLaVA-1.5, Gemma 3, Mistral 3 with the Pixtral processor and
Ultravox. Qwen2-VL, Qwen2-Audio and the Qwen2.5-Omni thinker are
`omnicache.demo.tiny_models`' own. docs/architectures.md says what each shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnicache.demo.tiny_models import (
    _MROPE,
    CHAT_TEMPLATE,
    IMAGE_PIXELS,
    _quiet_transformers,
    _save_renamed,
    _text_config_kwargs,
    _token_ids,
    _tokenizer,
    _whisper_front_end,
)

# Qwen2.5-VL: an image is <|vision_start|><|image_pad|><|vision_end|>, a video
# <|vision_start|><|video_pad|><|vision_end|>; vLLM repeats the pad once per token.
QWEN25VL_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN25VL_VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
QWEN25VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif part['type'] == 'text' %}",
    f"{{% elif part['type'] == 'video' %}}{QWEN25VL_VIDEO_PLACEHOLDER}"
    "{% elif part['type'] == 'text' %}",
)

# Idefics3: the prompt holds one <image> per image; vLLM expands it to
# <fake_token_around_image><row_i_col_j><image>*16 per tile, a newline per row,
# then "\n<fake_token_around_image><global-img>" + <image>*16 + <fake_token_around_image>.
IDEFICS3_IMAGE_TOKEN = "<image>"
IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    IDEFICS3_IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
]
IDEFICS3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Tiles of 112 pixels (8x8 patches of 14, pixel shuffle 2: 16 tokens a tile);
# an image's longest edge is first resized to 224: at most 2x2 tiles and the global image.
IDEFICS3_TILE = 112
IDEFICS3_LONGEST_EDGE = 224
IDEFICS3_SCALE_FACTOR = 2
IDEFICS3_IMAGE_SEQ_LEN = (IDEFICS3_TILE // 14) ** 2 // IDEFICS3_SCALE_FACTOR**2


def build_qwen25vl_model(path: Path) -> Path:
    """A tiny Qwen2.5-VL, its tokenizer and its processor (images and video) in ``path``.

    Vision tower as the Omni thinker's: 2 layers, 64 wide, patch 14, spatial
    merge 2, window attention in 112-pixel windows in layer 0, full attention
    in layer 1; 2 tokens a second of video (Qwen2.5-VL's published value).
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _tokenizer()
    tokenizer.chat_template = QWEN25VL_CHAT_TEMPLATE
    ids = _token_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={**_text_config_kwargs(ids), "rope_parameters": _MROPE},
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": 128,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    # Saved under the published checkpoints' names (model.layers.*, visual.*; lm_head tied,
    # not written): vLLM's Qwen2.5-VL mapper loads them as they are.
    model.save_pretrained(path)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**IMAGE_PIXELS),
        # NOTE: False keeps transformers' current sizing (what vLLM 0.32 counts video tokens
        # by) and silences its warning that the default changes in 5.22.
        video_processor=Qwen2VLVideoProcessor(**IMAGE_PIXELS, cap_pixels_per_frame=False),
        tokenizer=tokenizer,
        chat_template=QWEN25VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def build_idefics3_model(path: Path) -> Path:
    """A tiny Idefics3 (SigLIP-style tower, Llama text model), tokenizer and processor in ``path``.

    Vision tower: 2 layers, 64 wide, 2 heads, patch 14 on 112-pixel tiles;
    connector: pixel shuffle 2, so 16 image tokens a tile. The image processor
    resizes an image's longest edge to 224 and splits it into 112-pixel tiles
    (up to 2x2) plus the whole image at 112: a 224x224 image is 5 tiles, 80
    <image> tokens, 94 placeholder tokens in all.
    """
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tokenizer = _tokenizer(IDEFICS3_TOKENS)
    tokenizer.eos_token = "<end_of_utterance>"
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, IDEFICS3_TOKENS)
    text = {
        **_text_config_kwargs(ids),
        "model_type": "llama",
        "eos_token_id": ids["<end_of_utterance>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    config = Idefics3Config(
        text_config=text,
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IDEFICS3_TILE,
            "patch_size": 14,
        },
        scale_factor=IDEFICS3_SCALE_FACTOR,
        image_token_id=ids[IDEFICS3_IMAGE_TOKEN],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    model.save_pretrained(path)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(
            size={"longest_edge": IDEFICS3_LONGEST_EDGE},
            max_image_size={"longest_edge": IDEFICS3_TILE},
        ),
        tokenizer=tokenizer,
        image_seq_len=IDEFICS3_IMAGE_SEQ_LEN,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


# LLaVA-1.5: "<image>" in the prompt; vLLM repeats it once per image token.
LLAVA_IMAGE = "<image>"
LLAVA_IMAGE_SIDE = 112  # CLIP patch 14: 8x8 patches, 64 image tokens (CLS dropped)
# LLaVA-1.5's conversation format (llava_v1): an optional system line, then
# "USER: <image>\n{text} ASSISTANT:" (transformers renders templates with trim_blocks,
# so the literal text sits in expressions).
LLAVA_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + ' ' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def llava_prompt(text: str, system: str = LLAVA_SYSTEM) -> str:
    """LLaVA-1.5's prompt: the system line, one image, then ``text``."""
    return f"{system} USER: {LLAVA_IMAGE}\n{text} ASSISTANT:"


def build_llava_model(path: Path) -> Path:
    """A tiny LLaVA-1.5 (Llama text model, CLIP tower, image 112, patch 14, 64 image
    tokens) with its ``LlavaProcessor`` in ``path``; returns ``path``."""
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer([LLAVA_IMAGE], named_tokens={"image_token": LLAVA_IMAGE})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, [LLAVA_IMAGE])
    config = LlavaConfig(
        text_config={**_text_config_kwargs(ids), "model_type": "llama"},
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": LLAVA_IMAGE_SIDE,
            "patch_size": 14,
            "projection_dim": 64,
        },
        image_token_index=ids[LLAVA_IMAGE],
        vision_feature_layer=-2,  # LLaVA-1.5's: the tower's last layer but one
        vision_feature_select_strategy="default",  # CLS dropped
        image_seq_length=(LLAVA_IMAGE_SIDE // 14) ** 2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(path)
    # NOTE: transformers 5.19 saves the CLIP tower as "model.vision_tower.embeddings.*";
    # vLLM 0.32 maps "model.vision_tower." to "vision_tower." and then expects
    # "vision_tower.vision_model.*" (CLIPVisionModel), as published checkpoints name it.
    _save_renamed(
        model,
        path,
        {
            "lm_head.": "lm_head.",
            "model.language_model.": "model.language_model.",
            "model.vision_tower.": "model.vision_tower.vision_model.",
            "model.multi_modal_projector.": "model.multi_modal_projector.",
        },
    )
    # CLIP's preprocessing at 112 pixels: shortest side resized, centre crop.
    side = {"shortest_edge": LLAVA_IMAGE_SIDE}
    crop = {"height": LLAVA_IMAGE_SIDE, "width": LLAVA_IMAGE_SIDE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size=side, crop_size=crop),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=LLAVA_IMAGE,
    )
    processor.save_pretrained(path)
    return path


# Gemma 3: "<start_of_image>" in the prompt; vLLM (and Gemma3Processor) replace it with
# "\n\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\n\n".
GEMMA3_BOI = "<start_of_image>"
GEMMA3_EOI = "<end_of_image>"
GEMMA3_IMAGE = "<image_soft_token>"
GEMMA3_TURNS = ["<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA3_TOKENS = [GEMMA3_BOI, GEMMA3_EOI, GEMMA3_IMAGE, *GEMMA3_TURNS]
GEMMA3_TOKEN_NAMES = {"boi_token": GEMMA3_BOI, "eoi_token": GEMMA3_EOI, "image_token": GEMMA3_IMAGE}
# vLLM's Gemma 3 processor merges newline runs and looks these up in the vocabulary
# as whole tokens (Gemma's own tokenizer has them): added as plain tokens here.
GEMMA3_NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
GEMMA3_IMAGE_SIDE = 224  # SigLIP patch 14: 16x16 patches, pooled 2x2 into 64 image tokens
GEMMA3_TOKENS_PER_IMAGE = 64
GEMMA3_SLIDING_WINDOW = 64  # layer 0 slides over 64 tokens, layer 1 attends to all
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3_prompt(before: str, after: str) -> str:
    """Gemma 3's prompt: ``before``, one image, ``after``."""
    return (
        f"<bos><start_of_turn>user\n{before}{GEMMA3_BOI}{after}<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def build_gemma3_model(path: Path) -> Path:
    """A tiny Gemma 3 (2 layers: sliding window 64, then global; SigLIP tower, image 224,
    patch 14, pooled 2x2 into 64 image tokens) and its ``Gemma3Processor`` in ``path``;
    returns ``path``."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    tokenizer = _tokenizer(GEMMA3_TOKENS, named_tokens=GEMMA3_TOKEN_NAMES)
    tokenizer.add_tokens(GEMMA3_NEWLINES)
    tokenizer.add_special_tokens({"bos_token": "<bos>", "eos_token": "<end_of_turn>"})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, [*GEMMA3_TOKENS, *GEMMA3_NEWLINES])
    text = _text_config_kwargs(ids)
    config = Gemma3Config(
        text_config={
            **text,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": GEMMA3_SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "bos_token_id": ids["<bos>"],
            "eos_token_id": ids["<end_of_turn>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": GEMMA3_IMAGE_SIDE,
            "patch_size": 14,
        },
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=ids[GEMMA3_BOI],
        eoi_token_index=ids[GEMMA3_EOI],
        image_token_index=ids[GEMMA3_IMAGE],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with _quiet_transformers():
        model = Gemma3ForConditionalGeneration(config)
    # NOTE: transformers initialises the image projection to zeros (every image would
    # embed as zeros, whatever its pixels): drawn from the same seed instead.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    model.save_pretrained(path)
    # NOTE: transformers 5.19 saves the SigLIP tower as "vision_tower.embeddings.*";
    # vLLM 0.32's SiglipVisionModel expects "vision_tower.vision_model.*", as Google's
    # checkpoints name it.
    _save_renamed(
        model,
        path,
        {
            "lm_head.": "language_model.lm_head.",
            "model.language_model.": "language_model.model.",
            "model.vision_tower.": "vision_tower.vision_model.",
            "model.multi_modal_projector.": "multi_modal_projector.",
        },
    )
    side = {"height": GEMMA3_IMAGE_SIDE, "width": GEMMA3_IMAGE_SIDE}
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size=side),
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(path)
    return path


# Mistral 3 (HF format): "<s>[INST][IMG]text[/INST]"; vLLM turns the one [IMG]
# into rows of [IMG]...[IMG][IMG_BREAK], the last row ending in [IMG_END].
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Images: patches of 16, 2x2 patches merged into a token; at most 224 pixels a
# side, so a 224x224 image is 7 rows of 7 image tokens (49 + 7 break/end tokens).
PIXTRAL_PATCH = 16
PIXTRAL_MERGE = 2
PIXTRAL_LONGEST_EDGE = 224

# Ultravox (Llama 3 format): "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n
# <|audio|>text<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"; vLLM repeats
# the audio token (here <|audio|> itself) once per 16 mel frames (6.25 a second).
ULTRAVOX_TOKENS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|audio|>",
]
ULTRAVOX_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ULTRAVOX_STACK_FACTOR = 8  # encoder frames stacked into one text-model token


def build_mistral3_model(path: Path) -> Path:
    """A tiny Mistral 3 (Pixtral vision tower, Mistral text model) and its PixtralProcessor."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralImageProcessor,
        PixtralProcessor,
    )

    tokenizer = _tokenizer(MISTRAL_TOKENS)
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, MISTRAL_TOKENS)
    text = {
        **_text_config_kwargs(ids),
        "model_type": "mistral",
        "head_dim": 32,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "tie_word_embeddings": False,  # as Mistral 3's checkpoints
        "sliding_window": None,  # full attention, as Mistral 3.1's
    }
    config = Mistral3Config(
        text_config=text,
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 32,
            "image_size": PIXTRAL_LONGEST_EDGE,
            "patch_size": PIXTRAL_PATCH,
        },
        image_token_index=ids["[IMG]"],
        spatial_merge_size=PIXTRAL_MERGE,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config)
    model.save_pretrained(path)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(
            size={"longest_edge": PIXTRAL_LONGEST_EDGE}, patch_size=PIXTRAL_PATCH
        ),
        tokenizer=tokenizer,
        patch_size=PIXTRAL_PATCH,
        spatial_merge_size=PIXTRAL_MERGE,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def build_ultravox_model(path: Path) -> Path:
    """A tiny Ultravox (Whisper encoder, stacking projector, Llama) and its processor.

    Served with ``trust_remote_code=True``: the processor is code shipped in the
    directory (``ultravox_processing.py``), as Ultravox checkpoints do.
    """
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM, WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    # NOTE: Ultravox checkpoints ship their processor as code beside the weights
    # (``auto_map``); this one is written to vLLM's interface.
    from ultravox_processing import UltravoxProcessor

    tokenizer = _tokenizer(ULTRAVOX_TOKENS)
    tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tokenizer.chat_template = ULTRAVOX_CHAT_TEMPLATE
    ids = _token_ids(tokenizer, ULTRAVOX_TOKENS)
    text = LlamaConfig(
        **{
            **_text_config_kwargs(ids),
            "head_dim": 32,
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": ids["<|eot_id|>"],
            # Untied: with tied embeddings this random model only repeats its last token.
            "tie_word_embeddings": False,
        }
    )
    audio = WhisperConfig(
        num_mel_bins=128,
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=128,
        max_source_positions=1500,  # 30 s of mel frames, halved by the encoder
    )
    torch.manual_seed(0)
    with _quiet_transformers():
        language_model = LlamaForCausalLM(text)
        audio_tower = WhisperEncoder(audio)
    # v0.5's projector: stacked frames -> RMSNorm -> linear -> SwiGLU -> RMSNorm -> linear.
    stacked = audio.d_model * ULTRAVOX_STACK_FACTOR
    projector = nn.ModuleDict(
        {
            "ln_pre": nn.RMSNorm(stacked),
            "linear_1": nn.Linear(stacked, text.hidden_size, bias=False),
            "ln_mid": nn.RMSNorm(text.hidden_size // 2),
            "linear_2": nn.Linear(text.hidden_size // 2, text.hidden_size, bias=False),
        }
    )
    model = nn.ModuleDict(
        {
            "language_model": language_model,
            "audio_tower": audio_tower,
            "multi_modal_projector": projector,
        }
    )
    path.mkdir(parents=True, exist_ok=True)
    _save_renamed(model, path, {"": ""})  # already vLLM's names
    config = {
        "architectures": ["UltravoxModel"],
        "model_type": "ultravox",
        "audio_config": audio.to_diff_dict(),
        "text_config": text.to_diff_dict(),
        "audio_token_index": ids["<|audio|>"],
        "hidden_size": text.hidden_size,  # the projector's
        "stack_factor": ULTRAVOX_STACK_FACTOR,
        "projector_act": "swiglu",
        "projector_ln_mid": True,
        "norm_init": 0.4,
        "vocab_size": text.vocab_size,
        "dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    UltravoxProcessor.register_for_auto_class()
    processor = UltravoxProcessor(
        audio_processor=_whisper_front_end(),
        tokenizer=tokenizer,
        stack_factor=ULTRAVOX_STACK_FACTOR,
        chat_template=ULTRAVOX_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)  # copies ultravox_processing.py beside it (auto_map)
    return path
