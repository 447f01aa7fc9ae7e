"""`OmniStoreConnector`: a vLLM KV connector that carries each step's `StepPlan` to the worker.

vLLM gives a scheduler-to-worker channel per step to KV connectors only: the
scheduler side's ``build_connector_meta(scheduler_output)`` returns an object
that travels inside the ``SchedulerOutput`` to every worker, in process or
across processes (vLLM's default on CPU: the model runner runs in a worker
process apart from the scheduler's). Without a tier this connector moves no
KV at all; it uses that channel for the store's plan:

- scheduler side: `build_connector_meta` returns an `OmniStepMetadata` with
  the step's `StepPlan`, from the `StoreMirror` of the `OmniScheduler`'s
  wrapped manager (with prefix caching), or from the scheduler output alone
  (prefix caching off: no hits, nothing stamped, prompt rows only);
  ``get_num_new_matched_tokens`` returns no external tokens, so vLLM's own
  hits are left as they are, and ``request_finished`` never delays a free;
  it returns ``{"omnicache_request_id": <engine core id>}`` as the
  request's ``kv_transfer_params`` when the request asked for its prompt's
  hidden states, which is how the caller learns the id the worker knows
  (vLLM 0.32 appends a random suffix to the id a caller gives);
- worker side: nothing to load or save; the worker
  (`omnicache.integrations.vllm.worker.OmniCPUWorker`) reads the plan from
  the scheduler output it executes.

With a Redis tier (``tier_url`` and ``tier_namespace`` in
``kv_connector_extra_config``, see `omnicache.integrations.vllm.kv_tier`;
prefix caching on), engines share blocks across processes and restarts,
KV and hidden rows together:

- ``get_num_new_matched_tokens``: after vLLM's local hit, the further full
  blocks of the request's key chain (``request.block_hashes``, omnicache's
  keys) that the tier holds whole, never the prompt's last token; their
  values are fetched and verified here (`kv_tier.TierReader`), so a block
  evicted from Redis after the lookup still loads; loaded synchronously;
- ``update_state_after_alloc``: the block ids that receive those keys are
  stamped in the `StoreMirror` (`StoreMirror.on_loaded` says when the
  mirror counts a loaded block) and become the plan's ``loads``, values
  included;
- worker side, ``start_load_kv`` (before the forward pass): each load order
  is decoded again against the worker's KV caches and filled whole or not at
  all; a request whose load the worker cannot decode has its loaded blocks
  and the blocks the step computes for it reported by
  ``get_block_ids_with_load_errors`` (vLLM then recomputes it under
  ``kv_load_failure_policy="recompute"``, text-only requests only: vLLM 0.32
  sends the worker no multimodal data of items inside a computed prefix),
  its rows that step stamp nothing, and `update_connector_output` clears
  their stamps in the mirror;
- after each step the worker saves every block the step stamped (its KV of
  every layer and its hidden rows) to the tier, written behind;
- ``request_finished`` adds ``{"omnicache_external_tokens": n}`` to every
  request's ``kv_transfer_params``: the tokens its first admission took
  from the tier.

Configuration: ``kv_transfer_config={"kv_connector": "OmniStoreConnector",
"kv_connector_module_path": "omnicache.integrations.vllm.connector",
"kv_role": "kv_both"}``; ``kv_connector_extra_config`` may set
``max_prompt_results`` (see the worker) and the tier (``tier_url``,
``tier_namespace``, ``tier_prefix``). A request asks for its prompt's
hidden states with ``SamplingParams(extra_args={PROMPT_HIDDEN_STATES: True})``.

What a connector changes in vLLM 0.32 (``vllm/config/vllm.py``,
``vllm/v1/core/sched/scheduler.py``): the hybrid KV cache manager is turned
off (one full-attention group is all the store supports anyway), each
attention layer calls the connector's no-op per-layer hooks, a step with no
tokens still binds the metadata, and role ``kv_both`` makes vLLM hand each
finished request's block ids to ``request_finished`` (which never delays
their free) and defer frees only with several batches in flight (async
scheduling, which vLLM turns off on CPU).

Importing this module needs vLLM 0.32 or 0.33.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.common import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    PROMPT_HIDDEN_STATES,
    vllm_series,
    wants_prompt_hidden_states,
)
from omnicache.integrations.vllm.kv_tier import (
    TierConfig,
    TierReader,
    WorkerTier,
    entry_specs,
    tier_config,
)
from omnicache.integrations.vllm.live_store import LiveStore
from omnicache.integrations.vllm.manager import OmniKVCacheManager
from omnicache.integrations.vllm.mirror import StoreMirror
from omnicache.integrations.vllm.step_plan import PlannedRequest, StepPlan

vllm_series()  # vLLM imports this module by name: fail here, with the install hint.

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "EXTERNAL_TOKENS_PARAM",
    "PROMPT_HIDDEN_STATES",
    "REQUEST_ID_PARAM",
    "OmniStepMetadata",
    "OmniStoreConnector",
    "wants_prompt_hidden_states",
]

REQUEST_ID_PARAM = "omnicache_request_id"
"""The ``kv_transfer_params`` key of the engine core's id of a request that asked."""
EXTERNAL_TOKENS_PARAM = "omnicache_external_tokens"
"""The ``kv_transfer_params`` key of the tokens a request's first admission loaded from the tier."""

_LOG = logging.getLogger(__name__)


@dataclass
class OmniStepMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The connector's metadata of one step: the store's plan."""

    plan: StepPlan


class OmniStoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """A KV connector carrying the store's plan; with a tier it loads blocks (see the module)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._mirror: StoreMirror | None = None
        if vllm_config.speculative_config is not None:
            raise ValueError(
                f"{CONNECTOR_NAME}: expected no speculative decoding (its draft tokens are "
                "not the request's), found it configured"
            )
        transfer = vllm_config.kv_transfer_config
        self._tier_config: TierConfig | None = tier_config(
            None if transfer is None else transfer.kv_connector_extra_config
        )
        if self._tier_config is not None and not self._caching:
            raise ValueError(
                f"{CONNECTOR_NAME}: expected prefix caching on with a tier (tier_url), found it off"
            )
        if role == KVConnectorRole.SCHEDULER:
            # NOTE: the scheduler's connector is built in the engine core's
            # process (the caller's, in process), where a refusal reaches the
            # caller as it is; a worker's would end its process first.
            _check_parallel(vllm_config.parallel_config, tier=self._tier_config is not None)
        # Scheduler side: the tier's reader; per request, (first block, keys,
        # values) of its last lookup, and the external tokens of its first admission.
        self._index: TierReader | None = None
        self._lookups: dict[str, tuple[int, list[BlockHash], list[tuple[bytes, ...]]]] = {}
        self._external: dict[str, int] = {}
        if self._tier_config is not None and role == KVConnectorRole.SCHEDULER:
            if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
                raise ValueError(
                    f"{CONNECTOR_NAME}: expected one KV cache group with a tier, found "
                    f"{None if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)}"
                )
            (group,) = kv_cache_config.kv_cache_groups
            spec = group.kv_cache_spec
            model_config = vllm_config.model_config
            entries = entry_specs(
                model_config.get_hidden_size(),
                model_config.dtype,
                dict.fromkeys(group.layer_names, (spec.num_kv_heads, 2 * spec.head_size)),
                spec.dtype,
            )
            self._index = TierReader(self._tier_config, entries, self._block_size)
        # Worker side: the KV caches, the worker's store and the tier.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._live: LiveStore | None = None
        self._worker_tier: WorkerTier | None = None
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort store: a preempted request is simply recomputed.
        return False

    def bind_manager(self, manager: OmniKVCacheManager) -> StoreMirror:
        """Mirrors the worker's stamps in ``manager`` (the `OmniScheduler` calls this)."""
        if self._mirror is not None:
            raise RuntimeError(f"{CONNECTOR_NAME}: expected one manager, found a second")
        self._mirror = StoreMirror(manager)
        return self._mirror

    # -- worker side: loads from the tier; the worker saves -----------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def attach(self, live: LiveStore) -> WorkerTier | None:
        """Gives the worker's store (the `OmniCPUWorker` calls this); returns the tier, if any."""
        self._live = live
        if self._tier_config is not None and self._worker_tier is None:
            self._worker_tier = WorkerTier(self._tier_config, self._kv_caches, live.store)
        return self._worker_tier

    @property
    def worker_tier(self) -> WorkerTier | None:
        return self._worker_tier

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, OmniStepMetadata) or not metadata.plan.loads:
            return
        plan, live, tier = metadata.plan, self._live, self._worker_tier
        if live is None or tier is None:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: a step orders tier loads, found no tier attached "
                "(worker_cls must be omnicache's OmniCPUWorker)"
            )
        # NOTE: cleared stamps first: a block handed out again and filled now
        # must keep the stamp its load gives it.
        live.begin(plan)
        by_id = {item.req_id: item for item in plan.requests}
        failed: list[str] = []
        for order in plan.loads:
            if tier.load(live.store, order):
                continue
            failed.append(order.req_id)
            item = by_id.get(order.req_id)
            self._load_errors.update(order.block_ids)
            if item is not None:
                self._load_errors.update(item.block_ids)
        if failed:
            live.fail_loads(failed)
            _LOG.warning(
                "tier: %d load(s) not served whole (requests %s); vLLM recomputes them",
                len(failed),
                failed,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        # NOTE: the worker saves after the step, once the hidden rows are stored.
        return None

    def shutdown(self) -> None:
        if self._worker_tier is not None:
            self._worker_tier.close()
        if self._index is not None:
            self._index.close()

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._index is None or self._mirror is None:
            return 0, False
        size = self._block_size
        first = num_computed_tokens // size
        # NOTE: never the prompt's last token: vLLM must compute one.
        last = (request.num_tokens - 1) // size
        keys = list(request.block_hashes[first:last])
        values = self._index.fetch(keys)
        self._lookups[request.request_id] = (first, keys[: len(values)], values)
        return len(values) * size, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        self._external.setdefault(request.request_id, num_external_tokens)
        if num_external_tokens == 0 or self._mirror is None:
            return
        size = self._block_size
        if (
            lookup is None
            or num_external_tokens % size
            or num_external_tokens // size > len(lookup[1])
        ):
            raise RuntimeError(
                f"{CONNECTOR_NAME}: request {request.request_id}: expected at most "
                f"{0 if lookup is None else len(lookup[1]) * size} external tokens in whole "
                f"blocks (its lookup), found {num_external_tokens}"
            )
        first, keys, values = lookup
        num = num_external_tokens // size
        (block_ids, *_) = blocks.get_block_ids()
        self._mirror.on_loaded(
            request.request_id, block_ids[first : first + num], keys[:num], values[:num]
        )

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid and self._mirror is not None:
            self._mirror.on_load_failed(sorted(invalid))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OmniStepMetadata:
        prompt_requests = {
            new.req_id: new.prompt_len
            for new in scheduler_output.scheduled_new_reqs
            if _asks(new.req_id, new.sampling_params)
        }
        finished = sorted(scheduler_output.finished_req_ids)
        scheduled = _scheduled(scheduler_output)
        if self._mirror is not None:
            return OmniStepMetadata(self._mirror.plan(scheduled, prompt_requests, finished))
        if self._caching:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: with prefix caching on, expected "
                "scheduler_cls='omnicache.integrations.vllm.plugin.OmniScheduler' (a hit "
                "must come with its rows), found another scheduler"
            )
        requests = tuple(PlannedRequest(req_id, start, n) for req_id, start, n in scheduled)
        return OmniStepMetadata(
            StepPlan(
                caching=False,
                requests=requests,
                prompt_requests=prompt_requests,
                finished_req_ids=tuple(finished),
            )
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params: dict[str, Any] = {}
        if _asks(request.request_id, request.sampling_params):
            params[REQUEST_ID_PARAM] = request.request_id
        self._lookups.pop(request.request_id, None)
        external = self._external.pop(request.request_id, 0)
        if self._index is not None:
            params[EXTERNAL_TOKENS_PARAM] = external
        return False, params or None


def _check_parallel(parallel_config: Any, *, tier: bool) -> None:
    """Refuses, at start, the parallel layouts whose rows or KV the store cannot serve exactly.

    Final hidden states are replicated on every tensor-parallel rank, so each
    rank's store holds the same rows and any rank's result is exact; but a
    rank's KV cache is its own shard of the heads, and the tier keeps one
    block's KV under one key whatever rank saved it. Under pipeline
    parallelism only the last stage sees the final hidden states.
    """
    tensor = int(parallel_config.tensor_parallel_size)
    if tier and tensor != 1:
        raise ValueError(
            f"{CONNECTOR_NAME}: expected tensor_parallel_size 1 with a tier (tier_url): each "
            "rank's KV cache is its own shard of the heads, and the tier keeps a block's KV under "
            f"a key that does not say which rank saved it; found tensor_parallel_size {tensor}"
        )
    pipeline = int(parallel_config.pipeline_parallel_size)
    if pipeline != 1:
        raise ValueError(
            f"{CONNECTOR_NAME}: expected pipeline_parallel_size 1 (only the last stage has the "
            f"model's final hidden states), found {pipeline}"
        )


def _asks(req_id: str, sampling_params: Any) -> bool:
    """`wants_prompt_hidden_states`, where a bad value is logged and taken as no.

    NOTE: the front end refuses a bad value before the request gets here
    (`omnicache.integrations.vllm.frontend`); one that comes another way
    (vLLM's plugins limited by ``VLLM_PLUGINS``) must not stop the engine.
    """
    try:
        return wants_prompt_hidden_states(sampling_params)
    except ValueError as error:
        _LOG.warning("request %s: %s; its prompt's hidden states are not kept", req_id, error)
        return False


def _scheduled(scheduler_output: SchedulerOutput) -> Iterator[tuple[str, int, int]]:
    """``(request id, first position, tokens)`` of each request the step computes."""
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.num_computed_tokens, counts[new.req_id]
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        yield req_id, start, counts[req_id]
