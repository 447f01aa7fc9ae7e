"""A step's prefix hits, verified, and what is served from them.

Every hit that starts in a step is *verified*: a hit block not stamped with
its key counts as stale (``num_stale_hit_blocks``) and is never served. Then
the hit's rows serve, in the same step, right after the forward pass:

- prompt hidden states: a request that asked for them gets the hit blocks'
  rows from the store, then the step's rows (`PromptResults` keeps them);
- prompt logprobs and per-token embeddings (`HitLogprobs`): the hit's
  positions get them from the hit's rows, before vLLM's model runner
  computes the rest when it samples or pools the step.

The hit blocks of every request that needs their rows are read once per
step, however many requests share them (a harness sends many prompts
behind one long prefix). Under tensor parallelism a step whose hits are
scored hands every rank the first rank's hit rows (`share_from_first_rank`),
since vLLM's vocabulary-parallel LM head scores them on every rank.
`HitLogprobs` and `share_from_first_rank` import vLLM when used; the rest
needs torch alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import type_name
from omnicache.integrations.vllm.common import WORKER_CLS
from omnicache.integrations.vllm.plan import PlannedRequest
from omnicache.integrations.vllm.prompt_results import GatheredPrompt
from omnicache.store import HIDDEN_STATES, TensorStore

__all__ = [
    "HitLogprobs",
    "HitReader",
]

_LOG = logging.getLogger(__name__)


class ScoredHit(NamedTuple):
    """A request whose hit positions are scored in a step (see `HitLogprobs.score`)."""

    req_id: str
    # The hit's tokens: its first positions.
    num_tokens: int
    # The hit's blocks, as indices into the step's rows of hit blocks; None
    # when the hit's rows could not be read (a block lost its key).
    blocks: tuple[int, ...] | None


def _alone(
    item: PlannedRequest, prompt: GatheredPrompt | None, scores: bool, uses: Mapping[int, int]
) -> bool:
    """Whether a verified hit is read straight into its prompt's result (`HitReader.read`):
    a prompt's, not scored, in blocks no other request of the step needs."""
    return prompt is not None and not scores and all(uses[b] == 1 for b in item.hit_block_ids)


class HitReader:
    """Verifies a step's hits and serves what is read from them (see the module).

    Args:
        store: the worker's store (a follower's keeps no rows: ``keeps_rows`` False).
        keeps_rows: whether ``store`` keeps the model's rows.
        logprobs: gives the hit positions of requests that ask for prompt
            logprobs or per-token embeddings their outputs (None: none asks).
        share: under tensor parallelism, the rank group's broadcast from the
            first rank (None: one rank).
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        keeps_rows: bool,
        logprobs: HitLogprobs | None = None,
        share: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.store = store
        self.keeps_rows = keeps_rows
        self.logprobs = logprobs
        self.share = share
        # Prefix hits verified, and their blocks.
        self.num_hit_requests = 0
        self.num_hit_blocks = 0
        # Hit blocks whose rows did not hold their key: never served.
        self.num_stale_hit_blocks = 0
        # Requests whose hit positions got their outputs from the store (prompt
        # logprobs, per-token embeddings), those positions, and hits that could
        # not be read (their outputs NaN).
        self.num_scored_requests = 0
        self.num_scored_tokens = 0
        self.num_score_failures = 0

    def read(
        self,
        batch: Sequence[PlannedRequest],
        hidden_states: torch.Tensor,
        gathering: Mapping[str, GatheredPrompt],
    ) -> list[tuple[str, int, torch.Tensor | None]]:
        """Verifies the step's hits and serves them: prompt rows, prompt logprobs, embeddings.

        ``batch``: the step's requests in the order of its rows; ``gathering``:
        the requests whose rows are gathered (`PromptResults.gathering`).

        A prompt's hit whose blocks no other request of the step needs, and
        which is not scored, is read straight into its result: gathered with
        the others, its rows would be copied twice.

        Returns:
            The rows each gathered request gets, in order: (request id, first
            position, rows), rows None for a hit that could not be read.
        """
        offset = 0
        logprobs = self.logprobs
        found: list[tuple[str, int, torch.Tensor | None]] = []
        # (request, its step rows, its hit verified, asks, scores) of those needing hit rows.
        needs: list[tuple[PlannedRequest, torch.Tensor, bool, GatheredPrompt | None, bool]] = []
        for item in batch:
            rows = hidden_states[offset : offset + item.num_new]
            offset += item.num_new
            verified = True
            if item.hit_block_ids:
                self.num_hit_requests += 1
                self.num_hit_blocks += len(item.hit_block_ids)
                valid = self.store.probe(item.hit_block_ids, item.hit_block_keys)
                self.num_stale_hit_blocks += len(item.hit_block_ids) - valid
                verified = valid == len(item.hit_block_ids)
            prompt = gathering.get(item.req_id)
            limit = None if prompt is None else prompt.num_tokens
            if limit is not None and item.start >= limit:
                prompt = None
            scores = (
                bool(item.hit_block_ids) and logprobs is not None and logprobs.wants(item.req_id)
            )
            if prompt is not None and not item.hit_block_ids:
                # NOTE: results wait in the store's memory (host memory beside a GPU)
                # until taken, as the hits' rows do: a copy of vLLM's buffer.
                found.append((item.req_id, item.start, rows.to(self.store.device, copy=True)))
            elif prompt is not None or scores:
                needs.append((item, rows, verified, prompt, scores))
        if not needs:
            return found
        # Requests per block among the verified hits: a prompt's own blocks
        # (`_alone`) are read into its result.
        uses: dict[int, int] = {}
        for item, _, verified, _, _ in needs:
            if verified:
                for block_id in item.hit_block_ids:
                    uses[block_id] = uses.get(block_id, 0) + 1
        # NOTE: the scored requests' blocks first: under tensor parallelism
        # every rank scores them, from the rows the first rank shares.
        index: dict[int, int] = {}
        keys: list[BlockHash] = []
        num_scored = 0
        for scored_first in (True, False):
            for item, _, verified, prompt, scores in needs:
                if scores != scored_first or not verified or _alone(item, prompt, scores, uses):
                    continue
                for block_id, key in zip(item.hit_block_ids, item.hit_block_keys, strict=True):
                    if block_id not in index:
                        index[block_id] = len(index)
                        keys.append(key)
            if scored_first:
                num_scored = len(index)
        # NOTE: every block read belongs to a hit verified above: none is stale.
        bs, hidden = self.store.block_size, hidden_states.shape[-1]
        if not index:
            hit_rows = hidden_states.new_empty(0, hidden)
        elif self.keeps_rows:
            hit_rows = self.store.read_blocks(HIDDEN_STATES, list(index), keys)
        else:
            # NOTE: a follower has no prompts: every block it needs is scored.
            hit_rows = hidden_states.new_empty(len(index) * bs, hidden)
        scored_rows = hit_rows
        if self.share is not None and num_scored:
            scored_rows = self.share(
                hit_rows[: num_scored * bs].to(hidden_states.device).contiguous()
            )
        blocks = hit_rows.view(-1, bs, hidden)
        scored: list[ScoredHit] = []
        dtype, device = self.store.entries[HIDDEN_STATES].dtype, self.store.device
        for item, rows, verified, prompt, scores in needs:
            alone = verified and _alone(item, prompt, scores, uses)
            ids = (
                tuple(index[block_id] for block_id in item.hit_block_ids)
                if verified and not alone
                else None
            )
            if prompt is not None:
                if not verified:
                    found.append((item.req_id, 0, None))
                else:
                    # The hit's blocks, then the step's rows, in one tensor beside the
                    # store's rows (the step's may be on the model's device).
                    num_hit = len(item.hit_block_ids) * bs
                    whole = torch.empty((num_hit + len(rows), hidden), dtype=dtype, device=device)
                    if ids is None:
                        # Blocks no other request needs: read straight into the result.
                        self.store.read_blocks(
                            HIDDEN_STATES,
                            item.hit_block_ids,
                            item.hit_block_keys,
                            out=whole[:num_hit],
                        )
                    elif ids == tuple(range(ids[0], ids[0] + len(ids))):
                        # The request's blocks were read next to each other: one slice.
                        first = ids[0] * bs
                        whole[:num_hit].copy_(hit_rows[first : first + num_hit])
                    else:
                        torch.index_select(
                            blocks,
                            0,
                            torch.tensor(ids, device=blocks.device),
                            out=whole[:num_hit].view(-1, bs, hidden),
                        )
                    whole[num_hit:].copy_(rows)
                    found.append((item.req_id, 0, whole))
            if scores:
                scored.append(ScoredHit(item.req_id, item.start, ids))
                self._count_scored(item, ids is not None)
        if scored:
            assert logprobs is not None
            logprobs.score(scored_rows, bs, scored)
        return found

    def _count_scored(self, item: PlannedRequest, read: bool) -> None:
        if read:
            self.num_scored_requests += 1
            self.num_scored_tokens += item.start
            return
        self.num_score_failures += 1
        _LOG.warning(
            "request %s: its prefix hit's rows could not be read; the outputs (prompt "
            "logprobs, embeddings) of its first %d positions are NaN",
            item.req_id,
            item.start,
        )


class HitLogprobs:
    """A hit's prompt logprobs and per-token embeddings, from the hit's stored rows.

    vLLM's model runner computes a request's per-position outputs from the
    rows it computes, from ``num_computed_tokens`` on; a hit's positions are
    filled in here first, in the same step, right after the forward pass:

    - prompt logprobs (a generating model): vLLM computes them into the
      request's ``in_progress_prompt_logprobs_cpu`` when it samples the step
      (``_get_prompt_logprobs_dict``). A hit's positions get them by the same
      recipe: the model's ``compute_logits`` over the rows, the scores of the
      engine's ``logprobs_mode`` and the sampler's ``gather_logprobs`` of the
      request's ``k`` and the next prompt token, in batches of at most the
      runner's ``max_num_tokens`` rows (the most vLLM scores at once);
    - per-token embeddings (pooling's ``token_embed``): vLLM's pooler gathers
      a request's rows chunk by chunk in its ``pooling_states`` (chunked
      prefill on) and runs its head over them once the prompt is complete.
      The hit's rows go first in that list.

    Raises:
        RuntimeError: a model runner without what these use (the message
            names it).
    """

    __slots__ = ("_empty", "_runner")

    def __init__(self, runner: Any) -> None:
        from vllm.v1.outputs import LogprobsTensors

        needed: list[tuple[Any, tuple[str, ...]]] = [
            (runner, ("requests", "num_prompt_logprobs", "device", "is_pooling_model"))
        ]
        if not getattr(runner, "is_pooling_model", True):
            needed += [
                (runner, ("max_num_tokens", "model_config", "_get_prompt_logprobs_dict")),
                (getattr(runner, "sampler", None), ("compute_logprobs", "gather_logprobs")),
                (getattr(runner, "model", None), ("compute_logits",)),
                (LogprobsTensors, ("empty_cpu",)),
            ]
        for owner, names in needed:
            missing = [name for name in names if not hasattr(owner, name)]
            if missing:
                raise RuntimeError(
                    f"{WORKER_CLS}: expected vLLM's V1 model runner to compute prompt outputs "
                    f"with {', '.join(names)} of {type_name(owner)}, found no {missing}"
                )
        self._runner = runner
        self._empty = LogprobsTensors.empty_cpu

    def wants(self, req_id: str) -> bool:
        if req_id in self._runner.num_prompt_logprobs:
            return True
        return _embeds_tokens(self._runner.requests[req_id])

    def score(self, rows: torch.Tensor, block_size: int, prompts: Sequence[ScoredHit]) -> None:
        runner = self._runner
        scored: list[ScoredHit] = []
        for prompt in prompts:
            state = runner.requests[prompt.req_id]
            if not _embeds_tokens(state):
                scored.append(prompt)
                continue
            # NOTE: the hit's rows replace whatever the list holds: a request
            # resumed after preemption starts its rows over from its hit.
            state.pooling_states.hidden_states_cache[:] = [
                torch.full(
                    (prompt.num_tokens, rows.shape[-1]),
                    float("nan"),
                    dtype=rows.dtype,
                    device=runner.device,
                )
                if prompt.blocks is None
                else rows[_rows_of(prompt.blocks, block_size)].to(runner.device)
            ]
        if scored:
            self._logprobs(rows, block_size, scored)

    def _logprobs(self, rows: torch.Tensor, block_size: int, prompts: Sequence[ScoredHit]) -> None:
        runner = self._runner
        device = runner.device
        # Per prompt: its k, its logprob tensors, its positions' targets and rows.
        todo: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []
        for prompt in prompts:
            k = runner.num_prompt_logprobs[prompt.req_id]
            state = runner.requests[prompt.req_id]
            tensors = state.in_progress_prompt_logprobs_cpu
            if tensors is None:
                # NOTE: vLLM makes it in the step that computes the request's
                # first rows (this one) only if it has none yet.
                tensors = self._empty(len(state.prompt_token_ids) - 1, k + 1)
                state.in_progress_prompt_logprobs_cpu = tensors
            targets = torch.tensor(
                state.prompt_token_ids[1 : prompt.num_tokens + 1], dtype=torch.int64
            )
            if prompt.blocks is None:
                # NOTE: each position then names its prompt token alone (vLLM
                # decodes every id it returns), with no value and no rank.
                tensors.logprob_token_ids[: prompt.num_tokens] = targets[:, None]
                tensors.logprobs[: prompt.num_tokens] = float("nan")
                tensors.selected_token_ranks[: prompt.num_tokens] = -1
                continue
            todo.append((k, tensors, targets, _rows_of(prompt.blocks, block_size)))
        raw = runner.model_config.logprobs_mode in ("raw_logits", "processed_logits")
        size = max(1, int(runner.max_num_tokens))
        for start in range(0, len(rows) if todo else 0, size):
            stop = min(start + size, len(rows))
            logits = runner.model.compute_logits(rows[start:stop].to(device))
            # NOTE: prompt tokens skip the sampling processors, so vLLM's
            # processed_* and raw_* modes give the same scores for them.
            scores = logits.to(torch.float32) if raw else runner.sampler.compute_logprobs(logits)
            for k, tensors, targets, row_of in todo:
                inside = (row_of >= start) & (row_of < stop)
                positions = inside.nonzero().flatten()
                if not len(positions):
                    continue
                token_ids, logprobs, ranks, *_ = runner.sampler.gather_logprobs(
                    scores[(row_of[positions] - start).to(device)],
                    k,
                    targets[positions].to(device),
                )
                tensors.logprob_token_ids[positions] = token_ids.to("cpu", torch.int32)
                tensors.logprobs[positions] = logprobs.to("cpu")
                tensors.selected_token_ranks[positions] = ranks.to("cpu", torch.int32)


def _embeds_tokens(state: Any) -> bool:
    """Whether a request of the runner asked for per-token embeddings."""
    params = getattr(state, "pooling_params", None)
    return params is not None and params.task == "token_embed"


def _rows_of(blocks: tuple[int, ...], block_size: int) -> torch.Tensor:
    """The rows of ``blocks`` (indices of blocks in a step's rows), position by position."""
    first = torch.tensor(blocks, dtype=torch.int64)[:, None] * block_size
    return (first + torch.arange(block_size)).flatten()


def share_from_first_rank(rows: torch.Tensor) -> torch.Tensor:
    """The first tensor-parallel rank's ``rows``, on every rank (in place of theirs)."""
    from vllm.distributed import get_tp_group

    shared: torch.Tensor = get_tp_group().broadcast(rows, src=0)
    return shared
