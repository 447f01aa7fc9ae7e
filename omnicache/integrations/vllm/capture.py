"""The step's rows, captured where vLLM's model runner runs the forward pass.

`StepCapture` wraps the model runner's ``_model_forward`` (vLLM's override
point for the forward pass, which calls the model however it is wrapped,
CUDA graphs included) and runs each of the worker's steps: the step's plan
goes to the `LiveStore` with the final hidden states (before the LM head,
one row per scheduled token, padding after them), the forward context's
slot mapping of the KV cache group (``block_id * block_size + offset``) and
the model runner's batch order, right after the forward pass and before
vLLM samples or pools the step. Only steps with a plan apply, so warm-up and
profiling runs are ignored. It imports vLLM when made; importing it needs
none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnicache.checks import type_name
from omnicache.integrations.vllm.common import WORKER_CLS
from omnicache.integrations.vllm.live_store import LiveStore
from omnicache.integrations.vllm.plan import StepPlan

__all__ = ["StepCapture"]


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
        "context",
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
        from vllm.forward_context import get_forward_context

        self.context = get_forward_context
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
        # pass, where vLLM has just written them: after it, which leaves the
        # host's caches cold, the same reads took twice as long (18 us against
        # 9, in a decode step whose capture took about 37 us). So are a steady
        # decode step's slot values, with every check of it that needs no
        # rows (`LiveStore.decode_slot_values`): after it, `apply` only
        # stages such a step.
        mapping = self.context().slot_mapping
        if not isinstance(mapping, dict) or self.layer_name not in mapping:
            raise RuntimeError(
                f"{WORKER_CLS}: expected the forward context's slot mapping of layer "
                f"{self.layer_name!r}, found {type_name(mapping)}"
            )
        slot_mapping = mapping[self.layer_name]
        # NOTE: vLLM's ``InputBatch.req_ids`` is a property that casts the
        # batch's own list (``_req_ids``, changed in place). The property and
        # a comprehension took about half of the capture's own time: the list
        # is read directly once ``req_ids`` is seen to be it (checked for each
        # new input batch; otherwise the property, each step). It holds None
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
