"""The prompt results a worker keeps for callers, and their form across vLLM's transport.

A request that asks for its prompt's hidden states (or every position's:
``omnicache_hidden_states``) has its rows gathered chunk by chunk as the
worker's steps compute or hit them (`GatheredPrompt`), then kept under the
request's id and the key only its caller learns (``kv_transfer_params``:
the connector's) until taken, once (`PromptResults.take`). The front end
takes them through vLLM (`results`), encoded by `encode_result` for vLLM's
msgpack transport, which turns tensors into nested lists; plain bytes
travel as they are.

At most ``max_results`` untaken results are kept; the oldest untaken one
goes first (``num_results_dropped``); a request that finishes before all
its prompt positions were seen is dropped (``num_incomplete_dropped``). A
request whose hit could not be read has a result of None
(``num_prompt_failures``).
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnicache.checks import check_int, check_str
from omnicache.integrations.vllm.plan import StepPlan

__all__ = [
    "PromptResults",
    "decode_result",
    "encode_result",
]


@dataclass(slots=True)
class GatheredPrompt:
    """The rows one request asked for, gathered chunk by chunk."""

    # Its prompt's tokens; None: every position, until the request finishes.
    num_tokens: int | None
    # The secret that takes the result (`connector.OmniStoreConnector`'s).
    key: str
    # (first position, rows), in position order.
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, start: int, rows: torch.Tensor) -> torch.Tensor | None:
        """Adds rows from position ``start``; returns the whole prompt once complete.

        A chunk replaces every chunk from its start on: a request recomputed
        after preemption starts over. A request of every position is never
        complete here: it ends when it finishes (`rows`).
        """
        self.chunks = [chunk for chunk in self.chunks if chunk[0] < start]
        if self.num_tokens is None:
            self.chunks.append((start, rows))
            return None
        self.chunks.append((start, rows[: self.num_tokens - start]))
        return self.rows(self.num_tokens)

    def rows(self, num_rows: int | None = None) -> torch.Tensor | None:
        """The first ``num_rows`` rows (None: all gathered); None while they have a gap."""
        position = 0
        for first, part in self.chunks:
            if first != position:
                return None
            position += len(part)
        if num_rows is not None and position < num_rows:
            return None
        if not self.chunks:
            return None
        if len(self.chunks) == 1:
            # NOTE: a chunk is the store's own copy: no need for another.
            return self.chunks[0][1][:num_rows]
        return torch.cat([part for _, part in self.chunks])[:num_rows]


def _nbytes(rows: torch.Tensor) -> int:
    return rows.numel() * rows.element_size()


class PromptResults:
    """The prompts a worker gathers and the results it keeps until taken (see the module).

    Args:
        max_results: results kept until taken.
    """

    def __init__(self, max_results: int) -> None:
        self.max_results = check_int("max_results", max_results, minimum=1)
        # Request id -> its rows gathered so far.
        self.gathering: dict[str, GatheredPrompt] = {}
        # Request id -> (its key, its rows or None).
        self._results: OrderedDict[str, tuple[str, torch.Tensor | None]] = OrderedDict()
        self.num_prompt_results = 0
        self.num_prompt_failures = 0
        self.num_results_dropped = 0
        self.num_incomplete_dropped = 0

    def __len__(self) -> int:
        """The results kept, not yet taken."""
        return len(self._results)

    def expect(self, plan: StepPlan) -> None:
        """Starts gathering the rows of the plan's new requests that ask for them."""
        for req_id, num_tokens in plan.prompt_requests.items():
            every = req_id in plan.sequence_requests
            self.gathering[req_id] = GatheredPrompt(
                None if every else num_tokens, plan.result_keys[req_id]
            )

    def add(self, req_id: str, start: int, rows: torch.Tensor | None) -> None:
        """Rows of a gathered request from position ``start`` (None: its hit could not be read,
        and its result is None)."""
        if rows is None:
            self._finish(req_id, None)
            return
        whole = self.gathering[req_id].add(start, rows)
        if whole is not None:
            self._finish(req_id, whole)

    def finish_requests(self, req_ids: Sequence[str]) -> None:
        """Ends the gathering of finished requests: every position's rows are a result."""
        for req_id in req_ids:
            prompt = self.gathering.get(req_id)
            if prompt is not None and prompt.num_tokens is None:
                self._finish(req_id, prompt.rows())
            elif self.gathering.pop(req_id, None) is not None:
                self.num_incomplete_dropped += 1

    def take(
        self,
        requests: Mapping[str, str],
        *,
        max_bytes: int | None = None,
        num_positions: Mapping[str, int] | None = None,
    ) -> dict[str, torch.Tensor | int | None]:
        """Removes and returns the results of requests, each given with its key.

        Args:
            requests: request id -> the key of its result (``kv_transfer_params``).
            max_bytes: the largest result taken (None: any); a larger one is
                left in place.
            num_positions: request id -> its rows, for requests that asked for
                every position (``omnicache_num_positions`` of its
                ``kv_transfer_params``). Such a request's result is complete
                when its caller sees it finish, before the engine's next step
                tells the worker: with its count, it is taken then.

        Returns:
            Request id -> ``(num_rows, hidden)`` rows: the prompt's, or every
            position's; None when its hit could not be read (stale), or when
            it has fewer rows than its count; or, for a result over
            ``max_bytes``, its size in bytes (not taken). Requests without a
            result, or given another key, are left out.
        """
        counts = dict(num_positions or {})
        for req_id, number in counts.items():
            check_int(f"num_positions[{req_id!r}]", number, minimum=0)
        found: dict[str, torch.Tensor | int | None] = {}
        for req_id, key in requests.items():
            check_str("request id", req_id)
            check_str(f"requests[{req_id!r}]", key)
            count = counts.get(req_id)
            if req_id not in self._results:
                prompt = self.gathering.get(req_id)
                if (
                    prompt is None
                    or prompt.num_tokens is not None
                    or count is None
                    or not hmac.compare_digest(prompt.key.encode(), key.encode())
                ):
                    continue
                self._finish(req_id, prompt.rows(count))
            kept = self._results.get(req_id)
            if kept is None or not hmac.compare_digest(kept[0].encode(), key.encode()):
                continue
            rows = kept[1]
            if rows is not None and count is not None:
                rows = rows[:count] if len(rows) >= count else None
            if rows is not None and max_bytes is not None and _nbytes(rows) > max_bytes:
                found[req_id] = _nbytes(rows)
                continue
            del self._results[req_id]
            found[req_id] = rows
        return found

    def _finish(self, req_id: str, rows: torch.Tensor | None) -> None:
        prompt = self.gathering.pop(req_id)
        if rows is None:
            self.num_prompt_failures += 1
        else:
            self.num_prompt_results += 1
        self._results[req_id] = (prompt.key, rows)
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)
            self.num_results_dropped += 1


def encode_result(value: torch.Tensor | int | None) -> dict[str, Any] | None:
    """A result of `PromptResults.take` as plain values for vLLM's msgpack transport.

    Rows become their dtype's name, shape and raw bytes (copied to the CPU);
    a result left in place for its size becomes ``{"num_bytes": n}``; None
    (a hit that could not be read) stays None.
    """
    if value is None:
        return None
    if isinstance(value, int):
        return {"num_bytes": value}
    rows = value.detach().to("cpu").contiguous()
    return {
        "dtype": str(rows.dtype).removeprefix("torch."),
        "shape": list(rows.shape),
        "data": rows.view(torch.uint8).numpy().tobytes(),
    }


def decode_result(value: dict[str, Any] | None) -> torch.Tensor | int | None:
    """The result `encode_result` encoded."""
    if value is None:
        return None
    if "data" not in value:
        return int(value["num_bytes"])
    dtype = getattr(torch, value["dtype"])
    return torch.frombuffer(bytearray(value["data"]), dtype=dtype).reshape(value["shape"])
