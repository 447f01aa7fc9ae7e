"""`OmniStoreConnector`: a vLLM KV connector that carries each step's `StepPlan` to the worker.

vLLM gives a scheduler-to-worker channel per step to KV connectors only: the
scheduler side's ``build_connector_meta(scheduler_output)`` returns an object
that travels inside the ``SchedulerOutput`` to every worker, in process or
across processes (vLLM's default on CPU: the model runner runs in a worker
process apart from the scheduler's). This connector moves no KV at all; it
uses that channel for the store's plan:

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

Configuration: ``kv_transfer_config={"kv_connector": "OmniStoreConnector",
"kv_connector_module_path": "omnicache.integrations.vllm.connector",
"kv_role": "kv_both"}``; ``kv_connector_extra_config`` may set
``max_prompt_results`` (see the worker). A request asks for its prompt's
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

from omnicache.integrations.vllm.common import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    PROMPT_HIDDEN_STATES,
    vllm_series,
)
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
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "PROMPT_HIDDEN_STATES",
    "REQUEST_ID_PARAM",
    "OmniStepMetadata",
    "OmniStoreConnector",
    "wants_prompt_hidden_states",
]

"""The ``SamplingParams.extra_args`` key by which a request asks for its prompt's hidden states."""
REQUEST_ID_PARAM = "omnicache_request_id"
"""The ``kv_transfer_params`` key of the engine core's id of a request that asked."""

_LOG = logging.getLogger(__name__)


def wants_prompt_hidden_states(sampling_params: Any) -> bool:
    """Whether a request's sampling parameters ask for its prompt's hidden states.

    Raises:
        ValueError: the ``extra_args`` entry is there but is not a bool.
    """
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or PROMPT_HIDDEN_STATES not in extra:
        return False
    value = extra[PROMPT_HIDDEN_STATES]
    # NOTE: the server's ``vllm_xargs`` carry no bools: 1 and 0 stand for them.
    if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
        raise ValueError(
            f"extra_args[{PROMPT_HIDDEN_STATES!r}]: expected True or False (or 1 or 0), "
            f"found {value!r}"
        )
    return bool(value)


@dataclass
class OmniStepMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The connector's metadata of one step: the store's plan."""

    plan: StepPlan


class OmniStoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """A KV connector that loads and saves nothing and carries the store's plan (see the module)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._mirror: StoreMirror | None = None
        if vllm_config.speculative_config is not None:
            raise ValueError(
                f"{CONNECTOR_NAME}: expected no speculative decoding (its draft tokens are "
                "not the request's), found it configured"
            )

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

    # -- worker side: nothing moves --------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

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
        if _asks(request.request_id, request.sampling_params):
            return False, {REQUEST_ID_PARAM: request.request_id}
        return False, None


def _asks(req_id: str, sampling_params: Any) -> bool:
    """`wants_prompt_hidden_states`, where a bad value is logged and taken as no.

    NOTE: an exception here would stop the engine for one request's typo.
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
