"""Ultravox's processor, shipped with the tiny Ultravox as remote code (``auto_map``).

Ultravox checkpoints carry their processor as code of their own (neither
transformers nor vLLM has one), so vLLM loads it with ``trust_remote_code=True``.
This one has the interface of fixie-ai's ``UltravoxProcessor`` that vLLM 0.32
calls (``vllm/model_executor/models/ultravox.py``): ``audios`` and
``sampling_rate`` in; ``audio_values`` (mel frames of a Whisper feature
extractor, cut in chunks of ``audio_context_size`` frames), ``audio_lens`` (a
chunk's frames), ``audio_token_len`` (its tokens: one for every
``encoder_ds_factor * stack_factor`` frames, rounded up) and, asked with
``include_audio_num_chunks``, ``audio_num_chunks`` (an audio's chunks) out.
Each ``<|audio|>`` in ``text`` becomes ``audio_token_len`` replacement tokens
(vLLM sets ``audio_replacement_token_id``; left unset, the placeholder's id).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers


class UltravoxProcessor(transformers.ProcessorMixin):
    def __init__(
        self,
        audio_processor: Any = None,
        tokenizer: Any = None,
        stack_factor: int = 8,
        encoder_ds_factor: int = 2,
        audio_context_size: int = 3000,
        audio_placeholder: str = "<|audio|>",
        chat_template: str | None = None,
    ) -> None:
        self.stack_factor = stack_factor
        self.encoder_ds_factor = encoder_ds_factor
        self.audio_context_size = audio_context_size
        self.audio_placeholder = audio_placeholder
        self.audio_token_replacement = audio_placeholder
        self.audio_replacement_token_id: int | None = None
        super().__init__(audio_processor, tokenizer, chat_template=chat_template)

    def __call__(  # type: ignore[override]
        self,
        text: str | None = None,
        audio: Any = None,
        audios: Any = None,
        sampling_rate: int | None = None,
        include_audio_num_chunks: bool = False,
        return_tensors: str | None = "pt",
        **kwargs: Any,
    ) -> transformers.BatchFeature:
        if audio is not None:
            audios = [audio] if np.ndim(audio) == 1 else list(audio)
        audios = [np.asarray(a, dtype=np.float32) for a in (audios or [])]
        data: dict[str, Any] = {}
        token_lens: list[int] = []
        continues: list[bool] = []
        if audios:
            extractor = self.audio_processor
            hop = extractor.hop_length
            audios = [np.pad(a, (0, max(0, 2 * hop - len(a)))) for a in audios]
            features = extractor(
                audios,
                sampling_rate=sampling_rate,
                padding="longest",
                pad_to_multiple_of=hop,
                truncation=False,
                return_attention_mask=True,
                return_tensors="pt",
            )
            values, lens = features.input_features, features.attention_mask.sum(-1)
            context = self.audio_context_size
            chunks, chunk_lens, num_chunks = [], [], []
            for value, length in zip(values, lens.tolist(), strict=True):
                num_chunks.append(math.ceil(length / context))
                for offset in range(0, length, context):
                    chunk = value[:, offset : offset + context]
                    if offset > 0 and chunk.shape[-1] < context:
                        chunk = F.pad(chunk, (0, context - chunk.shape[-1]))
                    chunks.append(chunk)
                    chunk_lens.append(min(length - offset, context))
                    continues.append(offset > 0)
            width = max(chunk.shape[-1] for chunk in chunks)
            data["audio_values"] = torch.stack([F.pad(c, (0, width - c.shape[-1])) for c in chunks])
            data["audio_lens"] = torch.tensor(chunk_lens)
            step = self.encoder_ds_factor * self.stack_factor
            token_lens = [math.ceil(n / step) for n in chunk_lens]
            data["audio_token_len"] = torch.tensor(token_lens)
            data["audio_batch_size"] = torch.tensor([len(chunks)])
            if include_audio_num_chunks:
                data["audio_num_chunks"] = torch.tensor(num_chunks)
        if text is not None:
            parts = text.split(self.audio_placeholder)
            if len(parts) - 1 != len(audios):
                raise ValueError(
                    f"{len(parts) - 1} {self.audio_placeholder} for {len(audios)} audios"
                )
            replacement = self.audio_replacement_token_id
            if replacement is None:
                replacement = self.tokenizer.convert_tokens_to_ids(self.audio_placeholder)
            encoded = self.tokenizer(parts, add_special_tokens=False)["input_ids"]
            input_ids: list[int] = list(encoded[0])
            part, starts = 0, []
            for token_len, continuation in zip(token_lens, continues, strict=True):
                if not continuation and part > 0:
                    input_ids += encoded[part]
                part += not continuation
                starts.append(len(input_ids))
                input_ids += [replacement] * token_len
            if audios:
                input_ids += encoded[part]
                data["audio_token_start_idx"] = torch.tensor(starts)
            data["input_ids"] = [input_ids]
            data["attention_mask"] = [[1] * len(input_ids)]
        return transformers.BatchFeature(data=data, tensor_type=return_tensors)
