"""`OmniCPUWorker`: vLLM's CPU worker with a store of the model's hidden states.

Named as vLLM's ``worker_cls`` (``LLM(..., worker_cls=WORKER_CLS)``,
``--worker-cls`` on the server), it is built inside the process that runs the
model (vLLM's worker process by default; the engine's own process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It needs the `OmniStoreConnector`
(``kv_transfer_config``), whose per-step `StepPlan` it applies, and, with
prefix caching on, the `OmniScheduler`.

- After the model loads, a forward hook on the model takes each step's
  output: the final hidden states, before the LM head, one row per
  scheduled token (padding after them), with the forward context's slot
  mapping of the KV cache group (the slots the attention layers wrote the
  step's keys and values to: ``block_id * block_size + offset``) and the
  model runner's batch order. The hook is armed only inside
  ``execute_model``, so warm-up and profiling runs are ignored.
- Once the KV cache is allocated, a `TensorStore` with the KV cache's
  blocks and block size holds a `HIDDEN_STATES` entry of the model's dtype
  on the CPU (its size: KV blocks x block size x hidden size values).
- After each step, `LiveStore.apply` writes the rows, verifies the step's
  hits and gathers the prompt rows of requests that asked.
- With a tier (see the connector), the connector's worker side is given the
  store; it fills blocks from the tier before the forward pass, and after
  `LiveStore.apply` the worker saves every block the step stamped (KV of
  every layer and hidden rows) to the tier. ``collective_rpc(FLUSH_METHOD)``
  waits until they are written.

Results are taken with ``LLM.collective_rpc(TAKE_METHOD, args=(ids,))``, or
`take_prompt_hidden_states` (the ids are those of ``kv_transfer_params``,
see the connector). At most ``max_prompt_results`` (``kv_connector_extra_config``,
default 256) untaken results are kept; the oldest goes first.

Supported: vLLM 0.32's CPU worker with its V1 model runner (the default on
CPU; vLLM's V2 model runner orders its batch elsewhere and is refused), one
full-attention KV cache group, no speculative decoding. Tensor-parallel
ranks each keep a full copy of the store (the final hidden states are
replicated on every rank), and results are taken from the first; with a
tier, and under pipeline parallelism, the connector refuses to start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from omnicache.checks import type_name
from omnicache.integrations.vllm.common import CONNECTOR_NAME, WORKER_CLS, vllm_series
from omnicache.integrations.vllm.connector import (
    REQUEST_ID_PARAM,
    OmniStepMetadata,
    OmniStoreConnector,
)
from omnicache.integrations.vllm.kv_tier import WorkerTier
from omnicache.integrations.vllm.live_store import LiveStore
from omnicache.store import TensorStore

vllm_series()  # vLLM imports this module by name: fail here, with the install hint.

from vllm.distributed.kv_transfer import (  # noqa: E402
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.forward_context import get_forward_context  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

__all__ = [
    "DEFAULT_MAX_PROMPT_RESULTS",
    "FLUSH_METHOD",
    "STATS_METHOD",
    "TAKE_METHOD",
    "WORKER_CLS",
    "OmniCPUWorker",
    "decode_rows",
    "encode_rows",
    "take_prompt_hidden_states",
]

TAKE_METHOD = "omni_take_prompt_hidden_states"
STATS_METHOD = "omni_live_store_stats"
FLUSH_METHOD = "omni_tier_flush"
DEFAULT_MAX_PROMPT_RESULTS = 256


class _Capture:
    """A forward hook that keeps the step's output rows, slots and batch order while armed."""

    __slots__ = ("batch_order", "hidden_states", "layer_name", "num_calls", "runner", "slots")

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.layer_name: str | None = None
        self.hidden_states: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.batch_order: list[str] = []
        self.num_calls = 0

    def arm(self, layer_name: str) -> None:
        self.layer_name = layer_name
        self.hidden_states = None
        self.slots = None
        self.batch_order = []
        self.num_calls = 0

    def disarm(self) -> None:
        self.layer_name = None

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        if self.layer_name is None:
            return
        self.num_calls += 1
        rows = output[0] if isinstance(output, tuple) else output
        if not isinstance(rows, torch.Tensor):
            raise RuntimeError(
                f"{WORKER_CLS}: expected the model to return hidden states, found "
                f"{type_name(rows)} (pipeline parallelism is not supported)"
            )
        mapping = get_forward_context().slot_mapping
        if not isinstance(mapping, dict) or self.layer_name not in mapping:
            raise RuntimeError(
                f"{WORKER_CLS}: expected the forward context's slot mapping of layer "
                f"{self.layer_name!r}, found {type_name(mapping)}"
            )
        batch = self.runner.input_batch
        self.hidden_states = rows
        self.slots = mapping[self.layer_name]
        self.batch_order = [req_id for req_id in batch.req_ids[: batch.num_reqs] if req_id]


class OmniCPUWorker(CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker, keeping each step's hidden states in a store (see the module)."""

    omni_store: LiveStore | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        transfer = self.vllm_config.kv_transfer_config
        if transfer is None or transfer.kv_connector != CONNECTOR_NAME:
            raise ValueError(
                f"{WORKER_CLS}: expected kv_transfer_config naming {CONNECTOR_NAME!r}, found "
                f"{None if transfer is None else transfer.kv_connector!r}"
            )
        if self.use_v2_model_runner:
            raise ValueError(
                f"{WORKER_CLS}: expected vLLM's V1 model runner, found the V2 model runner "
                "(VLLM_USE_V2_MODEL_RUNNER=0 selects V1)"
            )
        self._omni_capture: _Capture | None = None
        self._omni_layer: str | None = None
        self._omni_tier: WorkerTier | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self._omni_capture = _Capture(self.model_runner)
        self.model_runner.get_model().register_forward_hook(self._omni_capture)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{WORKER_CLS}: expected one KV cache group, found {len(groups)}")
        (group,) = groups
        self._omni_layer = group.layer_names[0]
        model_config = self.vllm_config.model_config
        store = TensorStore(
            kv_cache_config.num_blocks,
            group.kv_cache_spec.block_size,
            hidden_size=model_config.get_hidden_size(),
            hidden_dtype=model_config.dtype,
        )
        extra = self.vllm_config.kv_transfer_config.kv_connector_extra_config
        self.omni_store = LiveStore(
            store, max_results=extra.get("max_prompt_results", DEFAULT_MAX_PROMPT_RESULTS)
        )
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, OmniStoreConnector):
            raise RuntimeError(
                f"{WORKER_CLS}: expected {CONNECTOR_NAME} as the worker's KV connector, found "
                f"{type_name(connector)}"
            )
        self._omni_tier = connector.attach(self.omni_store)

    def execute_model(self, scheduler_output: Any) -> Any:
        metadata = scheduler_output.kv_connector_metadata
        capture, live = self._omni_capture, self.omni_store
        if capture is None or live is None or self._omni_layer is None:
            raise RuntimeError(f"{WORKER_CLS}: a step before the model and store were set up")
        if not isinstance(metadata, OmniStepMetadata):
            raise RuntimeError(
                f"{WORKER_CLS}: expected {CONNECTOR_NAME}'s step metadata, found "
                f"{type_name(metadata)}"
            )
        capture.arm(self._omni_layer)
        try:
            output = super().execute_model(scheduler_output)
        finally:
            capture.disarm()
        if capture.num_calls > 1:
            raise RuntimeError(
                f"{WORKER_CLS}: expected one forward pass per step, found {capture.num_calls}"
            )
        stamped = live.apply(
            metadata.plan, capture.batch_order, capture.hidden_states, capture.slots
        )
        capture.hidden_states = capture.slots = None
        if self._omni_tier is not None:
            self._omni_tier.save(live.store, stamped)
        return output

    # -- collective_rpc methods ------------------------------------------------------

    def omni_take_prompt_hidden_states(
        self, request_ids: Sequence[str]
    ) -> dict[str, dict[str, Any] | None]:
        """Removes and returns the prompt results of ``request_ids`` (engine core ids), encoded.

        NOTE: vLLM's msgpack transport from the engine core to the caller
        turns tensors into nested lists; plain bytes travel as they are (see
        `decode_rows`).
        """
        if self.omni_store is None:
            return {}
        return {
            req_id: None if rows is None else encode_rows(rows)
            for req_id, rows in self.omni_store.take(request_ids).items()
        }

    def omni_live_store_stats(self) -> dict[str, int | float]:
        """The live store's counters and its store's, the latter prefixed ``store_``.

        With a tier, also the worker's tier counters (prefixed ``tier_``) and
        those of its Redis client (prefixed ``redis_``).
        """
        if self.omni_store is None:
            return {}
        stats: dict[str, int | float] = asdict(self.omni_store.stats)
        stats.update({f"store_{k}": v for k, v in asdict(self.omni_store.store.stats).items()})
        if self._omni_tier is not None:
            stats.update({f"tier_{k}": v for k, v in asdict(self._omni_tier.stats).items()})
            stats.update({f"redis_{k}": v for k, v in asdict(self._omni_tier.tier.stats).items()})
        return stats

    def omni_tier_flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every block saved to the tier is written; False without a tier or in time."""
        return self._omni_tier is not None and self._omni_tier.flush(timeout_s)


def encode_rows(rows: torch.Tensor) -> dict[str, Any]:
    """A CPU tensor as plain values: dtype name, shape and raw bytes."""
    rows = rows.contiguous()
    return {
        "dtype": str(rows.dtype).removeprefix("torch."),
        "shape": list(rows.shape),
        "data": rows.view(torch.uint8).numpy().tobytes(),
    }


def decode_rows(value: dict[str, Any]) -> torch.Tensor:
    """The tensor `encode_rows` encoded."""
    dtype = getattr(torch, value["dtype"])
    return torch.frombuffer(bytearray(value["data"]), dtype=dtype).reshape(value["shape"])


def take_prompt_hidden_states(llm: Any, outputs: Sequence[Any]) -> list[torch.Tensor | None]:
    """The prompt hidden states of finished ``outputs`` of ``llm``, in order; taken once.

    Args:
        llm: a ``vllm.LLM`` with `OmniCPUWorker` and `OmniStoreConnector`.
        outputs: ``RequestOutput`` s of requests that asked for their prompt's
            hidden states.

    Returns:
        Per output, ``(num_prompt_tokens, hidden)`` rows, or None when the
        worker found a hit it could not read (see `LiveStoreStats`).

    Raises:
        ValueError: an output that did not ask, or whose result is gone
            (taken already, or dropped past ``max_prompt_results``).
    """
    ids: list[str] = []
    for index, output in enumerate(outputs):
        params = getattr(output, "kv_transfer_params", None) or {}
        if REQUEST_ID_PARAM not in params:
            raise ValueError(
                f"outputs[{index}]: expected kv_transfer_params with {REQUEST_ID_PARAM!r} (a "
                f"request that asked for its prompt's hidden states), found {params!r}"
            )
        ids.append(params[REQUEST_ID_PARAM])
    (found, *_) = llm.collective_rpc(TAKE_METHOD, args=(ids,))
    missing = [req_id for req_id in ids if req_id not in found]
    if missing:
        raise ValueError(
            f"outputs: expected a prompt result for each request, found none for {missing} "
            "(taken already, or dropped past max_prompt_results)"
        )
    return [None if found[req_id] is None else decode_rows(found[req_id]) for req_id in ids]
