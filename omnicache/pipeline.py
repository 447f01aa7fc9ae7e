"""Two stages on vLLM, thinker then talker, with prefix caching on in both: `Pipeline`.

A multi-stage "omni" model (Qwen2.5-Omni, Qwen3-Omni) has a thinker that
reads text, images and audio and writes text, and a talker that reads the
thinker's hidden states at every position, prompt and generated, and writes
the codec tokens of speech. Here each stage is a ``vllm.LLM`` with
omnicache's scheduler, worker and connector:

1. the thinker serves the request, asking for every position's hidden states
   (``extra_args={"omnicache_all_hidden_states": True}``): on a prefix hit,
   the cached positions' rows come from its store, stamped and verified;
2. the rows are taken from the thinker's worker
   (`omnicache.integrations.vllm.results.take_prompt_hidden_states`) and
   turned into the talker's prompt embeddings by `TalkerRecipe`;
3. the talker (an engine with ``enable_prompt_embeds=True``) serves them:
   omnicache keys prompt embeddings per block of rows
   (`omnicache.integrations.vllm.block_hasher`), so talker prompts that share a
   prefix of thinker rows share blocks, and hit, in the talker as well.

The hand-off (`TalkerRecipe.prompt_embeds`), after Qwen2.5-Omni's talker (a
fixed projection of the thinker's rows added to the talker's own token
embeddings). For a thinker request of ``L`` prompt tokens and ``G``
generated tokens, its rows ``H`` are the ``n = L + G - 1`` positions the
thinker computed (its last token never went through it), and the talker's
prompt has ``n + 1`` rows::

    X[i] = H[i] @ W.T + b + E[codec_mask]   for i < L       (the thinker's prompt)
    X[i] = H[i] @ W.T + b + E[codec_pad]    for L <= i < n  (its generated tokens)
    X[n] = E[codec_bos]                                      (the talker starts speaking)

where ``W`` (talker hidden x thinker hidden) and ``b`` are the recipe's
projection and ``E`` the talker's input embeddings. The projection runs in
fixed chunks of `CHUNK_ROWS` rows (the last zero-padded), in float32, then
casts to the talker's dtype: every row's value is a function of its chunk's
rows alone, so equal thinker blocks give bit-equal talker rows, and so equal
talker keys (a matrix product's rounding may depend on its shape).

Nothing is copied that the hand-off does not need: the thinker's rows cross
vLLM's transport once (as bytes; in process, that is the only copy), the
projection writes the talker's embeddings, and vLLM takes them as they are.

Each stage may run in process or in vLLM's multiprocess mode (its engine
core in a process of its own): the pipeline only calls ``LLM.generate`` and
``collective_rpc``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnicache.checks import check_int, type_name
from omnicache.integrations.vllm.common import ALL_HIDDEN_STATES, PROMPT_HIDDEN_STATES
from omnicache.integrations.vllm.results import take_prompt_hidden_states

__all__ = ["Pipeline", "PipelineOutput", "TalkerRecipe"]

RECIPE_FILE = "omnicache_talker/projection.safetensors"
"""The recipe's file under the talker's model folder: ``weight``, ``bias``, and its token ids
(in a folder of its own: vLLM loads every ``*.safetensors`` beside the model's weights)."""
RECIPE_SCHEME = "omnicache.talker/v1"
EMBEDDINGS_NAME = "model.embed_tokens.weight"
"""The talker's input embeddings in its ``model.safetensors`` (a Qwen2 causal LM's name)."""
CHUNK_ROWS = 32
"""Rows the projection multiplies at once (see the module)."""
_TOKENS = ("codec_mask_id", "codec_pad_id", "codec_bos_id")


@dataclass(frozen=True, slots=True)
class TalkerRecipe:
    """How a thinker's rows become the talker's prompt embeddings (see the module).

    Args:
        weight: ``(talker hidden, thinker hidden)``.
        bias: ``(talker hidden,)``.
        embeddings: the talker's input embeddings, ``(vocabulary, talker hidden)``.
        codec_mask_id, codec_pad_id, codec_bos_id: the talker's token ids
            added to the thinker's prompt rows, to its generated rows, and
            alone at the end.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    embeddings: torch.Tensor
    codec_mask_id: int
    codec_pad_id: int
    codec_bos_id: int

    def __post_init__(self) -> None:
        for name in ("weight", "bias", "embeddings"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, found {type_name(value)}")
        if self.weight.dim() != 2 or 0 in self.weight.shape:
            raise ValueError(
                "weight: expected (talker hidden, thinker hidden), found "
                f"{tuple(self.weight.shape)}"
            )
        talker = self.weight.shape[0]
        if tuple(self.bias.shape) != (talker,):
            raise ValueError(f"bias: expected ({talker},), found {tuple(self.bias.shape)}")
        if self.embeddings.dim() != 2 or self.embeddings.shape[1] != talker:
            raise ValueError(
                f"embeddings: expected (vocabulary, {talker}), found {tuple(self.embeddings.shape)}"
            )
        vocabulary = self.embeddings.shape[0]
        for name in _TOKENS:
            check_int(name, getattr(self, name), minimum=0, maximum=vocabulary - 1)

    @property
    def thinker_hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def talker_hidden_size(self) -> int:
        return int(self.weight.shape[0])

    def save(self, model_dir: str | Path) -> Path:
        """Writes `RECIPE_FILE` in the talker's folder (its embeddings stay in its weights)."""
        from safetensors.torch import save_file

        path = Path(model_dir) / RECIPE_FILE
        path.parent.mkdir(exist_ok=True)
        metadata = {"scheme": RECIPE_SCHEME, **{name: str(getattr(self, name)) for name in _TOKENS}}
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        save_file(tensors, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, model_dir: str | Path) -> TalkerRecipe:
        """The recipe of a talker's folder: `RECIPE_FILE`, and its ``model.safetensors``.

        Raises:
            ValueError: a folder without the files, or a recipe of another scheme.
        """
        from safetensors import safe_open

        folder = Path(model_dir)
        recipe, weights = folder / RECIPE_FILE, folder / "model.safetensors"
        for path in (recipe, weights):
            if not path.is_file():
                name = path.relative_to(folder)
                raise ValueError(f"model_dir: expected {name} in {folder}, found none")
        with safe_open(str(recipe), framework="pt") as file:
            metadata = file.metadata() or {}
            if metadata.get("scheme") != RECIPE_SCHEME:
                raise ValueError(
                    f"{recipe}: expected scheme {RECIPE_SCHEME!r}, found {metadata.get('scheme')!r}"
                )
            weight, bias = file.get_tensor("weight"), file.get_tensor("bias")
        with safe_open(str(weights), framework="pt") as file:
            embeddings = file.get_tensor(EMBEDDINGS_NAME)
        ids = {name: int(metadata[name]) for name in _TOKENS}
        return cls(weight, bias, embeddings, **ids)

    def prompt_embeds(self, rows: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        """The talker's prompt embeddings for a thinker request's rows (see the module).

        Args:
            rows: ``(n, thinker hidden)``: every position the thinker computed.
            num_prompt_tokens: the thinker request's prompt tokens ``L``.

        Returns:
            ``(n + 1, talker hidden)``, of the embeddings' dtype.
        """
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows: expected a torch.Tensor, found {type_name(rows)}")
        if rows.dim() != 2 or rows.shape[1] != self.thinker_hidden_size:
            raise ValueError(
                f"rows: expected (positions, {self.thinker_hidden_size}), found {tuple(rows.shape)}"
            )
        n = rows.shape[0]
        check_int("num_prompt_tokens", num_prompt_tokens, minimum=1, maximum=max(n, 1))
        dtype = self.embeddings.dtype
        weight_t = self.weight.to(torch.float32).t()
        bias = self.bias.to(torch.float32)
        out = torch.empty(n + 1, self.talker_hidden_size, dtype=dtype)
        chunk = torch.zeros(CHUNK_ROWS, self.thinker_hidden_size, dtype=torch.float32)
        for start in range(0, n, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, n)
            chunk.zero_()
            chunk[: stop - start] = rows[start:stop]
            projected = torch.addmm(bias, chunk, weight_t)
            out[start:stop] = projected[: stop - start].to(dtype)
        codec = self.embeddings
        out[:num_prompt_tokens] += codec[self.codec_mask_id]
        out[num_prompt_tokens:n] += codec[self.codec_pad_id]
        out[n] = codec[self.codec_bos_id]
        return out


@dataclass(frozen=True, slots=True)
class PipelineOutput:
    """One request through both stages."""

    # The stages' ``vllm.RequestOutput`` s.
    thinker: Any
    talker: Any
    # ``(L + G - 1, thinker hidden)``: every position the thinker computed.
    thinker_hidden_states: torch.Tensor
    # The talker's prompt hidden states (None: not asked).
    talker_hidden_states: torch.Tensor | None
    # Seconds from the call to the talker's request: the thinker, then the hand-off.
    seconds_before_talker: float


def _asking(params: Any, field: str) -> Any:
    """A copy of sampling ``params`` whose ``extra_args`` ask for ``field``."""
    from vllm import SamplingParams

    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected a vllm.SamplingParams, found {type_name(params)}")
    asked = params.clone()
    asked.extra_args = {**(params.extra_args or {}), field: True}
    return asked


class Pipeline:
    """A request through the thinker, then its rows through the talker (see the module).

    Args:
        thinker: a ``vllm.LLM`` with omnicache's worker and connector.
        talker: a ``vllm.LLM`` with omnicache's worker and connector, and
            ``enable_prompt_embeds=True``.
        recipe: the hand-off (default: `TalkerRecipe.load` of the talker's model folder).
        talker_hidden_states: also take the talker's prompt hidden states.
    """

    def __init__(
        self,
        thinker: Any,
        talker: Any,
        recipe: TalkerRecipe | None = None,
        *,
        talker_hidden_states: bool = False,
    ) -> None:
        config = talker.llm_engine.vllm_config
        if not config.model_config.enable_prompt_embeds:
            raise ValueError(
                "talker: expected an engine with enable_prompt_embeds=True (its prompts are "
                "embeddings), found it off"
            )
        self.thinker = thinker
        self.talker = talker
        self.recipe = TalkerRecipe.load(config.model_config.model) if recipe is None else recipe
        talker_hidden = int(config.model_config.get_hidden_size())
        if talker_hidden != self.recipe.talker_hidden_size:
            raise ValueError(
                f"recipe: expected a projection to the talker's hidden size {talker_hidden}, "
                f"found {self.recipe.talker_hidden_size}"
            )
        thinker_hidden = int(thinker.llm_engine.vllm_config.model_config.get_hidden_size())
        if thinker_hidden != self.recipe.thinker_hidden_size:
            raise ValueError(
                f"recipe: expected a projection from the thinker's hidden size {thinker_hidden}, "
                f"found {self.recipe.thinker_hidden_size}"
            )
        self.talker_hidden_states = talker_hidden_states

    def generate(
        self,
        prompts: Sequence[Mapping[str, Any]],
        thinker_params: Any,
        talker_params: Any,
    ) -> list[PipelineOutput]:
        """Serves ``prompts`` (vLLM prompt dicts) through both stages, as one batch a stage.

        A prompt's ``cache_salt`` goes with it to the talker: a tenant's
        talker prompts share blocks with its own only.

        Raises:
            RuntimeError: the thinker's worker could not read a request's hit
                exactly (nothing approximate is handed on; send it again).
        """
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, Mapping):
                raise TypeError(
                    f"prompts[{index}]: expected a vLLM prompt dict, found {type_name(prompt)}"
                )
        thinker_out = self.thinker.generate(
            list(prompts), _asking(thinker_params, ALL_HIDDEN_STATES), use_tqdm=False
        )
        thinker_rows: list[torch.Tensor] = []
        talker_prompts: list[dict[str, Any]] = []
        taken = take_prompt_hidden_states(self.thinker, thinker_out)
        for prompt, output, rows in zip(prompts, thinker_out, taken, strict=True):
            if rows is None:
                raise RuntimeError(
                    f"thinker request {output.request_id}: its prefix hit's rows could not be "
                    "read exactly; nothing was handed to the talker (send it again)"
                )
            thinker_rows.append(rows)
            talker_prompt: dict[str, Any] = {
                "prompt_embeds": self.recipe.prompt_embeds(rows, len(output.prompt_token_ids))
            }
            if prompt.get("cache_salt") is not None:
                talker_prompt["cache_salt"] = prompt["cache_salt"]
            talker_prompts.append(talker_prompt)
        params = talker_params
        if self.talker_hidden_states:
            params = _asking(talker_params, PROMPT_HIDDEN_STATES)
        before_talker = time.perf_counter() - started
        talker_out = self.talker.generate(talker_prompts, params, use_tqdm=False)
        talker_rows: list[torch.Tensor | None] = [None] * len(talker_out)
        if self.talker_hidden_states:
            talker_rows = take_prompt_hidden_states(self.talker, talker_out)
        return [
            PipelineOutput(*outputs, before_talker)
            for outputs in zip(thinker_out, talker_out, thinker_rows, talker_rows, strict=True)
        ]
