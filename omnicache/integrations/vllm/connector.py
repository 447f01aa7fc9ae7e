"""`OmniStoreConnector`: the vLLM KV connector that carries each step's `StepPlan` across.

vLLM gives a scheduler-to-worker channel per step to KV connectors only: the
scheduler side's ``build_connector_meta(scheduler_output)`` returns an object
that travels inside the ``SchedulerOutput`` to every worker, in process or
across processes (vLLM's default on CPU: the model runner runs in a worker
process apart from the scheduler's). The connector is that channel and
nothing more: each hook hands its call to the side omnicache bound to it
(`plan.SchedulerSide`, bound by the `OmniScheduler`; `plan.WorkerSide`, bound
by the worker), and what it knows itself is the configuration:

- scheduler side: ``build_connector_meta`` returns an `OmniStepMetadata` with
  the step's plan (with prefix caching off and vLLM's own scheduler, the
  rows of every scheduled request, nothing stamped: `plan.uncached_plan`);
  ``get_num_new_matched_tokens`` (external tokens, loaded asynchronously),
  ``update_state_after_alloc`` and ``update_connector_output`` are the
  tier's (no external tokens without one); ``request_finished`` delays a
  free only while a tier load still holds the request's blocks, and returns
  ``{"omnicache_request_id": <engine core id>, "omnicache_result_key":
  <secret>}`` as the request's ``kv_transfer_params`` when it asked for its
  prompt's hidden states, which is how the caller learns the id the worker
  knows (vLLM 0.32 appends a random suffix to the id a caller gives) and
  the key that takes the result (`_result_key`), with the scheduler side's
  own parameters (``omnicache_external_tokens`` with a tier);
- worker side: ``register_kv_caches`` keeps vLLM's KV caches for the worker;
  ``start_load_kv`` hands a step's plan with loads to the worker side, which
  clears stamps and loads the tier's blocks (applying the step's rows
  begins every step, one without loads too); ``get_finished`` reports every
  load of the step done and ``get_block_ids_with_load_errors`` the blocks
  that did not load (vLLM recomputes them).

Configuration: ``kv_transfer_config={"kv_connector": "OmniStoreConnector",
"kv_connector_module_path": "omnicache.integrations.vllm.connector",
"kv_role": "kv_both"}``; ``kv_connector_extra_config`` may set
``max_prompt_results`` and ``max_staged_bytes`` (see the worker) and the tier (``tier_url``,
``tier_namespace``, ``tier_prefix``: `tier.tier_config`; a tier needs
``kv_load_failure_policy="recompute"``). What cannot be served exactly is
refused here, at start: speculative decoding, a tier without prefix caching
or without the recompute policy, pipeline and context parallelism (tensor
parallelism is served: see the worker and the tier).

What a connector changes in vLLM 0.32 (``vllm/config/vllm.py``,
``vllm/v1/core/sched/scheduler.py``): the hybrid KV cache manager is turned
off (the live path follows one full-attention group), each attention layer
calls the connector's no-op per-layer hooks, a step with no tokens still
binds the metadata, and role ``kv_both`` makes vLLM hand each finished
request's block ids to ``request_finished`` (which delays their free only
while a tier load holds them) and defer frees only with several batches in
flight (async scheduling, which vLLM turns off on CPU).

Importing this module needs vLLM 0.32 or 0.33.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from omnicache.integrations.vllm.common import (
    CONNECTOR_NAME,
    SCHEDULER_CLS,
    vllm_series,
)
from omnicache.integrations.vllm.kv_tier import TierConfig, tier_config
from omnicache.integrations.vllm.plan import (
    NUM_POSITIONS_PARAM,
    REQUEST_ID_PARAM,
    RESULT_KEY_PARAM,
    SchedulerSide,
    StepPlan,
    WorkerSide,
    asks,
    uncached_plan,
)

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
    "OmniStoreConnector",
]


@dataclass
class OmniStepMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The connector's metadata of one step: the store's plan."""

    plan: StepPlan


class OmniStoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """The channel of omnicache's plans; each hook goes to the side bound to it (see the module).

    Attributes:
        tier: the tier ``kv_connector_extra_config`` names (None: none).
        kv_caches: the worker's KV caches by layer, as vLLM registered them.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._caching = bool(vllm_config.cache_config.enable_prefix_caching)
        if vllm_config.speculative_config is not None:
            raise ValueError(
                f"{CONNECTOR_NAME}: expected no speculative decoding (its draft tokens are "
                "not the request's), found it configured"
            )
        transfer = vllm_config.kv_transfer_config
        self.tier: TierConfig | None = tier_config(
            None if transfer is None else transfer.kv_connector_extra_config
        )
        if self.tier is not None and not self._caching:
            raise ValueError(
                f"{CONNECTOR_NAME}: expected prefix caching on with a tier (tier_url), found it off"
            )
        policy = getattr(transfer, "kv_load_failure_policy", None)
        if self.tier is not None and policy != "recompute":
            raise ValueError(
                f"{CONNECTOR_NAME}: expected kv_load_failure_policy='recompute' with a tier "
                "(tier_url): a value evicted from Redis between the lookup and the load is "
                f"then recomputed, not an error for the request; found {policy!r}"
            )
        if role == KVConnectorRole.SCHEDULER:
            # NOTE: the scheduler's connector is built in the engine core's
            # process (the caller's, in process), where a refusal reaches the
            # caller as it is; a worker's would end its process first.
            _check_parallel(vllm_config.parallel_config)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._secret = secrets.token_bytes(32)
        self._scheduler_side: SchedulerSide | None = None
        self._worker_side: WorkerSide | None = None
        self._load_errors: set[int] = set()
        self._loads_done: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort store: a preempted request is simply recomputed.
        return False

    def bind_scheduler_side(self, side: SchedulerSide) -> None:
        """Hands the scheduler's hooks to ``side`` (the `OmniScheduler` calls this once)."""
        if self._scheduler_side is not None:
            raise RuntimeError(f"{CONNECTOR_NAME}: expected one scheduler side, found a second")
        self._scheduler_side = side

    def bind_worker_side(self, side: WorkerSide) -> None:
        """Hands the worker's hooks to ``side`` (omnicache's worker calls this once)."""
        if self._worker_side is not None:
            # NOTE: vLLM keeps one KV connector per process (its KV transfer
            # group is a global): a second in-process engine finds the first's.
            raise RuntimeError(
                f"{CONNECTOR_NAME}: expected one worker side, found a second: vLLM keeps one "
                "KV connector per process, so at most one engine with it runs in process; run "
                "the others in vLLM's multiprocess mode (VLLM_ENABLE_V1_MULTIPROCESSING=1)"
            )
        self._worker_side = side

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, OmniStepMetadata):
            return
        if self._worker_side is None:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: a step's plan reached a worker without omnicache's worker "
                "side (worker_cls must be omnicache's worker)"
            )
        plan = metadata.plan
        if not plan.loads:
            # NOTE: a step without loads is begun where its rows are applied,
            # as every step is (`WorkerSide.start_step`): nothing to do here,
            # in most steps.
            return
        errors = self._worker_side.start_step(plan)
        if errors:
            self._load_errors.update(errors)
        # NOTE: every load runs to its end in the step that orders it.
        self._loads_done.update(order.req_id for order in plan.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._loads_done:
            return None, None
        done, self._loads_done = self._loads_done, set()
        return None, done

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
        for side in (self._worker_side, self._scheduler_side):
            if side is not None:
                side.close()

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._scheduler_side is None:
            return 0, False
        num = self._scheduler_side.num_external_tokens(request, num_computed_tokens)
        # NOTE: loaded asynchronously: the request waits until its load is done, so it
        # reaches the worker with the data of every multimodal item it must recompute.
        return num, num > 0

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        if self._scheduler_side is not None:
            (block_ids, *_) = blocks.get_block_ids()
            self._scheduler_side.on_external_allocated(request, block_ids, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler_side is None:
            return
        done = getattr(connector_output, "finished_recving", None) or ()
        invalid = getattr(connector_output, "invalid_block_ids", None) or ()
        if done or invalid:
            self._scheduler_side.on_loads_done(sorted(done), sorted(invalid))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OmniStepMetadata:
        if self._scheduler_side is not None:
            plan = self._scheduler_side.step_plan(scheduler_output)
        elif self._caching:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: with prefix caching on, expected "
                f"scheduler_cls={SCHEDULER_CLS!r} (a hit must come with its rows), found "
                "another scheduler"
            )
        else:
            plan = uncached_plan(scheduler_output)
        if plan.prompt_requests:
            keys = {req_id: self._result_key(req_id) for req_id in plan.prompt_requests}
            plan = replace(plan, result_keys=keys)
        return OmniStepMetadata(plan)

    def _result_key(self, req_id: str) -> str:
        """The secret that takes request ``req_id``'s prompt result from the worker.

        NOTE: a request id alone is no secret (a client may choose it, and it
        shows in logs); the key is an HMAC of it under a secret drawn when
        the engine starts, so the scheduler can give it to the worker (in the
        plan) and to the caller (in ``kv_transfer_params``) without keeping
        any state between the two, and no one else can compute it.
        """
        return hmac.new(self._secret, req_id.encode(), hashlib.sha256).hexdigest()[:32]

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params: dict[str, Any] = {}
        delay = False
        kind = asks(request.request_id, request.sampling_params)
        if kind is not None:
            params[REQUEST_ID_PARAM] = request.request_id
            params[RESULT_KEY_PARAM] = self._result_key(request.request_id)
        if kind == "all":
            # NOTE: every token but the last went through the model; the
            # engine ended the request here, so the caller's output has them all.
            params[NUM_POSITIONS_PARAM] = request.num_tokens - 1
        if self._scheduler_side is not None:
            delay, more = self._scheduler_side.finished(request)
            params.update(more)
        return delay, params or None


def _check_parallel(parallel_config: Any) -> None:
    """Refuses, at start, the parallel layouts whose rows the store cannot serve exactly.

    Under tensor parallelism the final hidden states are replicated on every
    rank, and each rank's KV shard has its own name in the tier
    (`tier.kv_entry_name`): served. Under pipeline parallelism only the last
    stage sees the final hidden states; under context parallelism (vLLM's
    prefill and decode context parallel sizes) each rank holds some of a
    request's tokens, in slots the scheduler's plan does not name.
    """
    for field, what in (
        ("pipeline_parallel_size", "only the last stage has the model's final hidden states"),
        (
            "prefill_context_parallel_size",
            "each rank holds some of a request's tokens, in slots the store's plan does not name",
        ),
        (
            "decode_context_parallel_size",
            "each rank holds some of a request's tokens, in slots the store's plan does not name",
        ),
    ):
        size = int(getattr(parallel_config, field, 1))
        if size != 1:
            raise ValueError(f"{CONNECTOR_NAME}: expected {field} 1 ({what}), found {size}")
