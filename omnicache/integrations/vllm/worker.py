"""omnicache's worker: vLLM's worker with a store of the model's hidden states.

`OmniWorkerMixin` goes over vLLM's ``Worker`` and everything it adds lives on
``Worker``'s interface: `OmniCPUWorker` (vLLM's ``CPUWorker``) and
`OmniGPUWorker` (vLLM's GPU ``Worker``) are the mixin over each. Named as
vLLM's ``worker_cls`` (``LLM(..., worker_cls=WORKER_CLS)``, ``--worker-cls``
on the server), the worker is built inside the process that runs the model
(vLLM's worker process by default; the engine's own process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It needs the `OmniStoreConnector`
(``kv_transfer_config``), which carries each step's `StepPlan` to it, and,
with prefix caching on, the `OmniScheduler`.

- After the model loads, the model runner's ``_model_forward`` (vLLM's
  override point for the forward pass, which calls the model however it is
  wrapped, CUDA graphs included) is wrapped (`StepCapture`, which runs each
  of the worker's steps) to take each step's output: the
  final hidden states, before the LM head, one row per scheduled token
  (padding after them), with the forward context's slot mapping of the KV
  cache group (the slots the attention layers wrote the step's keys and
  values to: ``block_id * block_size + offset``) and the model runner's
  batch order. It takes them only inside ``execute_model``, so warm-up and
  profiling runs are ignored.
- Once the KV cache is allocated, a `TensorStore` with the KV cache's
  blocks and block size holds a `HIDDEN_STATES` entry of the model's dtype
  on the CPU (its size: KV blocks x block size x hidden size values), kept
  by a `LiveStore`, the worker side the connector hands each step's plan to.
- On a GPU, before the forward pass, `LiveStore.start_forward` writes the
  staged rows that the step's plan shows it would write after it (reading
  their slots then waits for nothing of this step's).
- Right after the forward pass, inside ``_model_forward`` (before vLLM
  samples or pools the step), `LiveStore.apply` clears the stamps of blocks
  vLLM handed out again, writes the rows, verifies the step's hits, gives
  the hits' positions their outputs (`hits`: prompt hidden states, prompt
  logprobs, per-token embeddings) and saves every block the step stamped to the tier
  (``collective_rpc(FLUSH_METHOD)`` waits until they are written). A step
  without a forward pass is applied after ``execute_model``.
- In the connector's ``start_load_kv`` (which vLLM calls after the forward
  pass when the step has no synchronous load, as is always the case here),
  `LiveStore.start_step` fills the blocks of waiting requests from the tier.

How `LiveStore` applies a step's plan: `omnicache.integrations.vllm.live_store`.

Results are taken by request id and key, the two of ``kv_transfer_params``
(see the connector), with the worker's ``omni_take_prompt_hidden_states``:
`results.take_prompt_hidden_states` for ``LLM``, the server's route of
`results.OmniEndpoints`. The worker keeps at most ``max_prompt_results``
(``kv_connector_extra_config``, default 256) untaken results, by the rules
of `prompt_results`.

Supported: vLLM's V1 model runner (the default; the V2 model runner orders
its batch elsewhere and is refused), one full-attention KV cache group, no
speculative decoding. Under tensor parallelism the final hidden states are
replicated on every rank: the first rank's store keeps them, and every
other rank keeps a follower's store (`follower_store`: the same stamps, one
byte a row), since every rank applies the same plan to the same slots. A
step that scores a hit's positions (vLLM's vocabulary-parallel LM head runs
on every rank) hands the first rank's hit rows to the others (a broadcast
over the tensor-parallel group, in that step only). Only the first rank
gathers prompt results, and they are taken from it. With a tier, each rank
saves and loads its own KV shard (`WorkerTier`). Under pipeline or context
parallelism the connector refuses to start. `OmniCPUWorker` runs in the
live tests;
`OmniGPUWorker` shares every line but its base and has not run on a GPU.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from omnicache.checks import check_int, type_name
from omnicache.integrations.vllm.common import (
    CONNECTOR_NAME,
    GPU_WORKER_CLS,
    WORKER_CLS,
    vllm_series,
)
from omnicache.integrations.vllm.connector import OmniStepMetadata, OmniStoreConnector
from omnicache.integrations.vllm.hits import HitLogprobs, share_from_first_rank
from omnicache.integrations.vllm.kv_tier import WorkerTier
from omnicache.integrations.vllm.live_store import FOLLOWER_DTYPE, LiveStore, follower_store
from omnicache.integrations.vllm.plan import StepPlan
from omnicache.integrations.vllm.prompt_results import encode_result
from omnicache.integrations.vllm.staged_steps import default_max_staged_bytes
from omnicache.store import TensorStore

vllm_series()  # vLLM imports this module by name: fail here, with the install hint.

from vllm.distributed import (  # noqa: E402
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.distributed.kv_transfer import (  # noqa: E402
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.forward_context import get_forward_context  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

__all__ = [
    "FLUSH_METHOD",
    "GPU_WORKER_CLS",
    "STATS_METHOD",
    "WORKER_CLS",
    "OmniCPUWorker",
    "OmniGPUWorker",
    "OmniWorkerMixin",
]

STATS_METHOD = "omni_live_store_stats"
FLUSH_METHOD = "omni_tier_flush"
DEFAULT_MAX_PROMPT_RESULTS = 256

# NOTE: vLLM's logging configuration handles its own loggers' records; the
# sizes a user sizes the engine by belong in the engine's log.
_ENGINE_LOG = logging.getLogger("vllm.omnicache")


class StepCapture:
    """Wraps the model runner's ``_model_forward``: applies each step's plan to its rows.

    vLLM calls ``_model_forward`` once per forward pass, inside the forward
    context, with the model however vLLM wrapped it (a CUDA graph wrapper
    replays a graph without calling the module, so a forward hook on the
    module would not see such a step). Right after it returns, in the same
    step, the live store applies the step's plan to the rows (vLLM's output
    buffer, read before the next replay) at the forward context's slots, in
    the model runner's batch order (both read before the forward pass): before
    vLLM samples the step (and scores prompt positions) or pools it, which
    read what the store gives the hits' positions.
    """

    __slots__ = (
        "batch",
        "direct",
        "forward",
        "forward_first",
        "layer_name",
        "live",
        "num_calls",
        "plan",
        "runner",
    )

    def __init__(self, runner: Any) -> None:
        forward = getattr(runner, "_model_forward", None)
        if not callable(forward):
            raise RuntimeError(
                f"{WORKER_CLS}: expected vLLM's model runner to call the model through "
                f"_model_forward, found {type_name(runner)} without it"
            )
        self.runner = runner
        self.forward: Callable[..., Any] = forward
        self.forward_first = False
        self.layer_name = ""
        self.live: LiveStore | None = None
        self.plan: StepPlan | None = None
        self.num_calls = 0
        # The model runner's input batch, and whether its ``req_ids`` is its own
        # list ``_req_ids`` (`__call__`).
        self.batch: Any = None
        self.direct = False
        runner._model_forward = self

    def bind(self, layer_name: str, live: LiveStore, *, forward_first: bool) -> None:
        """The layer whose slot mapping the rows follow, and the store that applies them.

        Once, when the store is made. ``forward_first``: whether the staged
        rows a step's plan shows it will write are written before its forward
        pass (`LiveStore.start_forward`: on a device, where reading their
        slots then waits for earlier steps only).
        """
        self.layer_name, self.live, self.forward_first = layer_name, live, forward_first

    def step(self, plan: StepPlan, execute: Callable[[], Any]) -> Any:
        """Runs one of vLLM's steps (``execute``: its ``execute_model``) under ``plan``.

        Only steps with a plan apply their rows; a step without a forward
        pass still clears, loads and finishes, after it.
        """
        live = self.live
        if live is None:
            raise RuntimeError(f"{WORKER_CLS}: a step before the store was set up")
        if self.forward_first:
            live.start_forward(plan)
        self.plan, self.num_calls = plan, 0
        try:
            output = execute()
        finally:
            self.plan = None
        if self.num_calls == 0:
            live.apply(plan)
        return output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        live, plan = self.live, self.plan
        if live is None or plan is None:
            return self.forward(*args, **kwargs)
        self.num_calls += 1
        if self.num_calls > 1:
            raise RuntimeError(
                f"{WORKER_CLS}: expected one forward pass per step, found {self.num_calls}"
            )
        # NOTE: the step's slots and batch order are read before the forward
        # pass, where vLLM has just written them: after it the host's caches
        # are cold and every read costs more. So are a steady decode step's
        # slot values, with every check of it that needs no rows
        # (`LiveStore.decode_slot_values`): after it, `apply` only stages such
        # a step (benchmarks/bench_live_store.py pins the capture's cost).
        mapping = get_forward_context().slot_mapping
        if not isinstance(mapping, dict) or self.layer_name not in mapping:
            raise RuntimeError(
                f"{WORKER_CLS}: expected the forward context's slot mapping of layer "
                f"{self.layer_name!r}, found {type_name(mapping)}"
            )
        slot_mapping = mapping[self.layer_name]
        # NOTE: vLLM's ``InputBatch.req_ids`` is a property that casts the
        # batch's own list (``_req_ids``, changed in place), at a cost the
        # capture pays every step: the list is read directly once ``req_ids``
        # is seen to be it (checked for each new input batch; otherwise the
        # property, each step). It holds None
        # only while vLLM updates the batch, never at a forward pass.
        batch = self.runner.input_batch
        if batch is not self.batch:
            self.batch = batch
            self.direct = getattr(batch, "_req_ids", None) is batch.req_ids
        order = (batch._req_ids if self.direct else batch.req_ids)[: batch.num_reqs]
        if None in order:
            order = [req_id for req_id in order if req_id is not None]
        values = live.decode_slot_values(plan, slot_mapping)
        output = self.forward(*args, **kwargs)
        rows = output[0] if isinstance(output, tuple) else output
        if not isinstance(rows, torch.Tensor):
            raise RuntimeError(
                f"{WORKER_CLS}: expected the model to return hidden states, found "
                f"{type_name(rows)} (pipeline parallelism is not supported)"
            )
        live.apply(plan, order, rows, slot_mapping, slot_values=values)
        return output


class OmniWorkerMixin:
    """What omnicache adds to vLLM's ``Worker``: capture, the store, results (see the module).

    Put before a subclass of vLLM's ``Worker`` in the bases; it overrides
    only methods of ``Worker``'s interface.
    """

    omni_store: LiveStore | None = None
    # Set by vLLM's Worker.
    vllm_config: Any
    model_runner: Any
    use_v2_model_runner: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        transfer = self.vllm_config.kv_transfer_config
        if transfer is None or transfer.kv_connector != CONNECTOR_NAME:
            raise ValueError(
                f"{type(self).__name__}: expected kv_transfer_config naming {CONNECTOR_NAME!r}, "
                f"found {None if transfer is None else transfer.kv_connector!r}"
            )
        if self.use_v2_model_runner:
            raise ValueError(
                f"{type(self).__name__}: expected vLLM's V1 model runner, found the V2 model "
                "runner (vLLM 0.33's default wherever Triton is installed, as with CUDA): "
                "set VLLM_USE_V2_MODEL_RUNNER=0 to select V1"
            )
        self._omni_capture: StepCapture | None = None
        self._omni_logprobs: HitLogprobs | None = None
        self._omni_kv_bytes = 0
        self._omni_max_staged_bytes: int | None = None

    def determine_available_memory(self) -> int:
        """vLLM's KV cache budget, less what the store takes of the same memory.

        The budget is the one the user gave (``kv_cache_memory_bytes``,
        ``VLLM_CPU_KVCACHE_SPACE`` or ``gpu_memory_utilization``). The staged
        steps' rows (`staged_steps`, on the model's device: up to
        ``max_staged_bytes``, `_omni_staged_bytes`) come out of it first. On
        the CPU the store's rows and vLLM's KV cache are both host memory:
        vLLM gets ``rest * kv / (kv + store)`` of the rest (per block: every
        layer's KV page; the store's rows on this rank), so that its blocks
        and the store's rows of as many blocks fit. On a GPU the store lives
        in host memory, outside the device's budget, and vLLM gets the rest.

        Raises:
            ValueError: the budget does not exceed the staged rows' bound.
        """
        available = int(super().determine_available_memory())  # type: ignore[misc]
        staged = self._omni_max_staged_bytes = self._omni_staged_bytes(available)
        if staged >= available:
            raise ValueError(
                f"{type(self).__name__}: expected a KV cache budget over the staged steps' "
                f"{staged} bytes (kv_connector_extra_config['max_staged_bytes']), found "
                f"{available} bytes"
            )
        rest = available - staged
        if not self._omni_store_in_kv_budget():
            _ENGINE_LOG.info(
                "omnicache (rank %d): of the KV cache budget, %.1f MiB, the staged steps' "
                "copies take up to %.1f MiB: vLLM's KV cache gets %.1f MiB",
                get_tensor_model_parallel_rank(),
                available / 2**20,
                staged / 2**20,
                rest / 2**20,
            )
            return rest
        kv, store = self._omni_bytes_per_block()
        granted = rest * kv // (kv + store)
        # NOTE: before vLLM sizes its cache: if the rest cannot hold one request of
        # max_model_len, vLLM's refusal follows this line.
        _ENGINE_LOG.info(
            "omnicache (rank %d): of the KV cache budget, %.1f MiB, the staged steps' rows "
            "take up to %.1f MiB and the store's rows %d bytes a block beside vLLM's %d: "
            "vLLM's KV cache gets %.1f MiB",
            get_tensor_model_parallel_rank(),
            available / 2**20,
            staged / 2**20,
            store,
            kv,
            granted / 2**20,
        )
        return granted

    def _omni_staged_bytes(self, available: int) -> int:
        """The bound on the staged steps' rows (`LiveStore`'s ``max_staged_bytes``).

        ``kv_connector_extra_config["max_staged_bytes"]`` (0: no step waits),
        by default `default_max_staged_bytes` of the budget (32 MiB, or a
        sixteenth of the budget if less). The same on every rank given the
        same budget: each then writes its staged steps at the same step.
        """
        extra = self.vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        if "max_staged_bytes" not in extra:
            return default_max_staged_bytes(available)
        return check_int(
            "kv_connector_extra_config['max_staged_bytes']", extra["max_staged_bytes"], minimum=0
        )

    def _omni_store_in_kv_budget(self) -> bool:
        """Whether the store (host memory) takes the memory vLLM's KV cache does: on the CPU."""
        return bool(self.vllm_config.device_config.device_type == "cpu")

    def _omni_bytes_per_block(self) -> tuple[int, int]:
        """One block's bytes: vLLM's KV (every layer), and this rank's store rows."""
        specs = self.get_kv_cache_spec()  # type: ignore[attr-defined]
        kv = sum(int(spec.page_size_bytes) for spec in specs.values())
        (block_size, *others) = {int(spec.block_size) for spec in specs.values()}
        if others or kv <= 0:
            raise ValueError(
                f"{type(self).__name__}: expected one block size and KV pages of some bytes, "
                f"found block sizes {sorted([block_size, *others])} and {kv} bytes a block"
            )
        if get_tensor_model_parallel_rank() != 0:
            return kv, block_size * FOLLOWER_DTYPE.itemsize
        model_config = self.vllm_config.model_config
        return kv, block_size * model_config.get_hidden_size() * model_config.dtype.itemsize

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self._omni_capture = StepCapture(self.model_runner)
        self._omni_logprobs = HitLogprobs(self.model_runner)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"{type(self).__name__}: expected one KV cache group, found {len(groups)}"
            )
        (group,) = groups
        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, OmniStoreConnector):
            raise RuntimeError(
                f"{type(self).__name__}: expected {CONNECTOR_NAME} as the worker's KV connector, "
                f"found {type_name(connector)}"
            )
        model_config = self.vllm_config.model_config
        rank, num_ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        block_size = group.kv_cache_spec.block_size
        store = (
            TensorStore(
                kv_cache_config.num_blocks,
                block_size,
                hidden_size=model_config.get_hidden_size(),
                hidden_dtype=model_config.dtype,
            )
            if rank == 0
            else follower_store(kv_cache_config.num_blocks, block_size)
        )
        tier = (
            None
            if connector.tier is None
            else WorkerTier(
                connector.tier, connector.kv_caches, store, rank=rank, num_ranks=num_ranks
            )
        )
        extra = self.vllm_config.kv_transfer_config.kv_connector_extra_config
        max_staged_bytes = self._omni_max_staged_bytes
        if max_staged_bytes is None:
            raise RuntimeError(
                f"{type(self).__name__}: expected vLLM to ask for the KV cache budget "
                "(determine_available_memory) before allocating the KV cache, found it did not: "
                "the staged steps' rows would be outside the budget"
            )
        self.omni_store = LiveStore(
            store,
            max_results=extra.get("max_prompt_results", DEFAULT_MAX_PROMPT_RESULTS),
            tier=tier,
            hit_logprobs=self._omni_logprobs,
            share=None if num_ranks == 1 else share_from_first_rank,
            keeps_results=rank == 0,
            max_staged_bytes=max_staged_bytes,
        )
        connector.bind_worker_side(self.omni_store)
        if self._omni_capture is None:
            raise RuntimeError(
                f"{type(self).__name__}: expected vLLM to load the model before its KV cache"
            )
        self._omni_capture.bind(
            group.layer_names[0],
            self.omni_store,
            forward_first=not self._omni_store_in_kv_budget(),
        )
        kv_bytes = self._omni_kv_bytes = (
            kv_cache_config.num_blocks * self._omni_bytes_per_block()[0]
        )
        where = (
            "the KV cache's budget holds all three"
            if self._omni_store_in_kv_budget()
            else "the store is host memory, outside the device's budget"
        )
        _ENGINE_LOG.info(
            "omnicache (rank %d): vLLM's KV cache %d blocks, %.1f MiB; the store %.1f MiB; "
            "staged steps' rows up to %.1f MiB; %s",
            rank,
            kv_cache_config.num_blocks,
            kv_bytes / 2**20,
            store.nbytes / 2**20,
            max_staged_bytes / 2**20,
            where,
        )

    def execute_model(self, scheduler_output: Any) -> Any:
        metadata = scheduler_output.kv_connector_metadata
        capture = self._omni_capture
        live = None if capture is None else capture.live
        if capture is None or live is None:
            raise RuntimeError(
                f"{type(self).__name__}: a step before the model and store were set up"
            )
        if not isinstance(metadata, OmniStepMetadata):
            raise RuntimeError(
                f"{type(self).__name__}: expected {CONNECTOR_NAME}'s step metadata, found "
                f"{type_name(metadata)}"
            )
        execute = super().execute_model  # type: ignore[misc]
        return capture.step(metadata.plan, partial(execute, scheduler_output))

    # -- collective_rpc methods ------------------------------------------------------

    def omni_take_prompt_hidden_states(
        self,
        requests: Mapping[str, str],
        max_bytes: int | None = None,
        num_positions: Mapping[str, int] | None = None,
    ) -> dict[str, dict[str, Any] | None]:
        """`PromptResults.take`, encoded for vLLM's transport (`prompt_results.encode_result`).

        NOTE: vLLM's msgpack transport from the engine core to the caller
        turns tensors into nested lists; plain bytes travel as they are.
        """
        if self.omni_store is None:
            return {}
        taken = self.omni_store.results.take(
            requests, max_bytes=max_bytes, num_positions=num_positions
        )
        return {req_id: encode_result(value) for req_id, value in taken.items()}

    def omni_live_store_stats(self) -> dict[str, int | float]:
        """The live store's counters and its store's, the latter prefixed ``store_``.

        ``store_nbytes``: the bytes the store holds (a follower's: one a row);
        ``kv_cache_nbytes``: those of vLLM's KV cache on this rank;
        ``max_staged_nbytes``: the bound on the staged steps' rows (all
        three out of the budget on the CPU; the last on a GPU).

        With a tier, also the worker's tier counters (prefixed ``tier_``) and
        those of its Redis client (prefixed ``redis_``).
        """
        live = self.omni_store
        if live is None:
            return {}
        live.flush()
        stats: dict[str, int | float] = asdict(live.stats)
        stats.update({f"store_{k}": v for k, v in asdict(live.store.stats).items()})
        stats["store_nbytes"] = live.store.nbytes
        stats["kv_cache_nbytes"] = self._omni_kv_bytes
        stats["max_staged_nbytes"] = live.max_staged_bytes
        if live.tier is not None:
            stats.update({f"tier_{k}": v for k, v in asdict(live.tier.stats).items()})
            stats.update({f"redis_{k}": v for k, v in asdict(live.tier.tier.stats).items()})
        return stats

    def omni_tier_flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every block saved to the tier is written; False without a tier or in time."""
        live = self.omni_store
        if live is None or live.tier is None:
            return False
        live.flush()
        return live.tier.flush(timeout_s)


_WORKERS = {
    "OmniCPUWorker": ("vllm.v1.worker.cpu_worker", "CPUWorker", "vLLM's CPU worker"),
    "OmniGPUWorker": ("vllm.v1.worker.gpu_worker", "Worker", "vLLM's GPU worker"),
}

if TYPE_CHECKING:

    class OmniCPUWorker(OmniWorkerMixin, CPUWorker): ...  # type: ignore[misc]

    class OmniGPUWorker(OmniWorkerMixin, Worker): ...  # type: ignore[misc]


def __getattr__(name: str) -> type:
    """`OmniCPUWorker` and `OmniGPUWorker`: the mixin over vLLM's worker, made when first named.

    NOTE: vLLM's worker modules import its whole model-running stack, which an
    install of vLLM's scheduler side lacks; `LiveStore` and the rest of this
    module need none of it, so only naming a worker class imports it.
    """
    if name not in _WORKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, base_name, what = _WORKERS[name]
    base = getattr(importlib.import_module(module_name), base_name)
    worker = type(
        name,
        (OmniWorkerMixin, base),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{what}, keeping each step's hidden states in a store (see the module).",
        },
    )
    globals()[name] = worker
    return worker
