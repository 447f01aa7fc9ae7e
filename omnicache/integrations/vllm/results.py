"""A finished request's prompt hidden states, taken out of the engine: from ``LLM``, over HTTP.

The worker keeps a request's prompt hidden states until they are taken
(`prompt_results.PromptResults`), under the request's engine core id and a key that only
its caller learns: the two entries of the request's ``kv_transfer_params``
(``omnicache_request_id``, ``omnicache_result_key``; see the connector). A
result is taken once; an unknown id, a wrong key or a result already taken
find nothing, and change nothing. This module takes them:

- `take_prompt_hidden_states`: from ``LLM``, in the caller's process, through
  vLLM's ``collective_rpc``;
- `OmniEndpoints`: vLLM's ``vllm.endpoint_plugins`` entry point ``omnicache``
  (loaded when ``VLLM_PLUGINS`` names it, beside the front-end plugin of the
  same name) adds ``POST /v1/omnicache/prompt_hidden_states`` to the OpenAI
  server. Its JSON body is a response's ``kv_transfer_params``; it answers
  the rows as a safetensors file (one tensor, ``hidden_states``, of the
  model's dtype), which any safetensors reader loads.
  `fetch_prompt_hidden_states` is a client for it that needs only the
  standard library and torch. The route sits under ``/v1``, so the server's
  ``--api-key`` guards it. A result larger than ``OMNICACHE_HTTP_MAX_BYTES``
  (the API server's environment, default `DEFAULT_MAX_BYTES`) is refused
  with 413 and left in place.

Statuses of the route: 200 (the file), 400 (a body that is not the JSON
object expected), 401 (vLLM's, without the API key), 404 (no such result:
unknown id, wrong key, taken already, dropped past ``max_prompt_results``,
or an engine without omnicache's store), 409 (the worker could not read the
request's hit exactly: nothing is served, the result is gone), 413 (over the
size limit).

Importing this module needs neither vLLM nor FastAPI: the route imports
them when vLLM attaches it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from omnicache.checks import type_name
from omnicache.integrations.vllm.common import CONNECTOR_NAME
from omnicache.integrations.vllm.plan import (
    NUM_POSITIONS_PARAM,
    REQUEST_ID_PARAM,
    RESULT_KEY_PARAM,
)
from omnicache.integrations.vllm.prompt_results import decode_result

__all__ = [
    "MAX_BYTES_ENV",
    "ROUTE",
    "OmniEndpoints",
    "fetch_prompt_hidden_states",
    "take_prompt_hidden_states",
]

TAKE_METHOD = "omni_take_prompt_hidden_states"
"""The worker's method that takes results (``collective_rpc``)."""
ROUTE = "/v1/omnicache/prompt_hidden_states"
MAX_BYTES_ENV = "OMNICACHE_HTTP_MAX_BYTES"
DEFAULT_MAX_BYTES = 512 * 2**20
"""The largest result the route answers by default: 32k tokens of a 4096-wide bf16 model fit."""
TENSOR_NAME = "hidden_states"

_LOG = logging.getLogger(__name__)

# safetensors' names of the dtypes a model's hidden states come in.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}


class _Handle(NamedTuple):
    """What takes one result: a response's ``kv_transfer_params``, checked."""

    req_id: str
    key: str
    # Rows of a request that asked for every position (None: its prompt's).
    num_positions: int | None


def _handle(index: int, params: Any) -> _Handle:
    """The id, key and count of a result, from a response's ``kv_transfer_params``."""
    count = params.get(NUM_POSITIONS_PARAM) if isinstance(params, Mapping) else None
    if (
        not isinstance(params, Mapping)
        or not isinstance(params.get(REQUEST_ID_PARAM), str)
        or not isinstance(params.get(RESULT_KEY_PARAM), str)
        or not (count is None or (type(count) is int and count >= 0))
    ):
        raise ValueError(
            f"outputs[{index}]: expected kv_transfer_params with {REQUEST_ID_PARAM!r} and "
            f"{RESULT_KEY_PARAM!r} (a request that asked for its hidden states), and "
            f"{NUM_POSITIONS_PARAM!r} a count if there, found {params!r}"
        )
    return _Handle(params[REQUEST_ID_PARAM], params[RESULT_KEY_PARAM], count)


def _take_args(handles: Sequence[_Handle], max_bytes: int | None) -> tuple[Any, ...]:
    """The arguments of the worker's `TAKE_METHOD` for ``handles``."""
    keys = {handle.req_id: handle.key for handle in handles}
    counts = {h.req_id: h.num_positions for h in handles if h.num_positions is not None}
    return (keys, max_bytes, counts)


def take_prompt_hidden_states(llm: Any, outputs: Sequence[Any]) -> list[torch.Tensor | None]:
    """The hidden states finished ``outputs`` of ``llm`` asked for, in order; taken once.

    Args:
        llm: a ``vllm.LLM`` with omnicache's worker and `CONNECTOR_NAME`.
        outputs: ``RequestOutput`` s of requests that asked for their prompt's
            hidden states, or for every position's.

    Returns:
        Per output, ``(num_prompt_tokens, hidden)`` rows, or, for a request
        that asked for every position, ``(num_prompt_tokens +
        num_output_tokens - 1, hidden)`` (the last token never went through
        the model); None when the worker found a hit it could not read (see
        `live_store.LiveStoreStats`).

    Raises:
        ValueError: an output that did not ask, or whose result is gone
            (taken already, or dropped past ``max_prompt_results``).
    """
    handles = [
        _handle(index, getattr(output, "kv_transfer_params", None))
        for index, output in enumerate(outputs)
    ]
    (found, *_) = llm.collective_rpc(TAKE_METHOD, args=_take_args(handles, None))
    missing = [handle.req_id for handle in handles if handle.req_id not in found]
    if missing:
        raise ValueError(
            f"outputs: expected a result for each request, found none for {missing} "
            "(taken already, or dropped past max_prompt_results)"
        )
    rows: list[torch.Tensor | None] = []
    for handle in handles:
        value = decode_result(found[handle.req_id])
        assert not isinstance(value, int)  # no size limit was asked
        rows.append(value)
    return rows


# -- the file the route answers ----------------------------------------------------------


def safetensors_bytes(rows: torch.Tensor, metadata: Mapping[str, str]) -> bytes:
    """``rows`` as a safetensors file of one tensor, `TENSOR_NAME`, with ``metadata``.

    The format (huggingface/safetensors): an 8-byte little-endian header
    length, a JSON header padded with spaces to 8 bytes, then the raw
    little-endian data.
    """
    dtype = _SAFETENSORS_DTYPES.get(rows.dtype)
    if dtype is None:
        raise TypeError(
            f"rows: expected one of {sorted(map(str, _SAFETENSORS_DTYPES))}, found {rows.dtype}"
        )
    data = rows.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    header = {
        "__metadata__": dict(metadata),
        TENSOR_NAME: {"dtype": dtype, "shape": list(rows.shape), "data_offsets": [0, len(data)]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def read_safetensors(data: bytes) -> tuple[torch.Tensor, dict[str, str]]:
    """The tensor and metadata of a file `safetensors_bytes` wrote (or any one-tensor file).

    Raises:
        ValueError: bytes that are not such a file.
    """
    if len(data) < 8:
        raise ValueError(f"data: expected a safetensors file, found {len(data)} bytes")
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + size])
        spec = header[TENSOR_NAME]
        start, stop = spec["data_offsets"]
        dtype = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}[spec["dtype"]]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"data: expected a safetensors file with a tensor {TENSOR_NAME!r} of "
            f"{sorted(_SAFETENSORS_DTYPES.values())}, found a header that is not ({error!r})"
        ) from error
    body = data[8 + size :]
    if stop > len(body):
        raise ValueError(f"data: expected {stop} bytes of data, found {len(body)}")
    rows = torch.frombuffer(bytearray(body[start:stop]), dtype=dtype).reshape(spec["shape"])
    return rows, dict(header.get("__metadata__", {}))


# -- the route and its client --------------------------------------------------------------


def max_bytes_from_env() -> int:
    """``OMNICACHE_HTTP_MAX_BYTES`` (default `DEFAULT_MAX_BYTES`)."""
    value = os.environ.get(MAX_BYTES_ENV, "")
    if value == "":
        return DEFAULT_MAX_BYTES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{MAX_BYTES_ENV}: expected a positive number of bytes, found {value!r}")
    return int(value)


class OmniEndpoints:
    """The ``vllm.endpoint_plugins`` entry point ``omnicache``: the route of prompt results.

    See the module for the route; vLLM's ``EndpointPlugin`` protocol
    (``vllm/plugins/endpoint_plugins/interface.py``) for the hooks.
    """

    name = "omnicache"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        # NOTE: a plain Starlette route: the handler reads the request itself.
        app.add_route(ROUTE, _take_route, methods=["POST"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        config = getattr(getattr(engine_client, "vllm_config", None), "kv_transfer_config", None)
        keeps = getattr(config, "kv_connector", None) == CONNECTOR_NAME
        if not keeps:
            _LOG.warning(
                "omnicache: %s answers 404: the engine keeps no prompt hidden states "
                "(its kv_transfer_config does not name %s)",
                ROUTE,
                CONNECTOR_NAME,
            )
        state.omnicache_results = (engine_client if keeps else None, max_bytes_from_env())


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(
        status, "RequestTooLargeError"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


async def _take_route(request: Any) -> Any:
    """``POST ROUTE``: the prompt hidden states of the request the body names, taken once."""
    from fastapi.responses import Response

    engine, max_bytes = request.app.state.omnicache_results
    try:
        body = await request.json()
    except ValueError:
        body = None
    try:
        handle = _handle(0, body)
    except ValueError:
        return _error(
            400,
            f"expected a JSON object with the strings {REQUEST_ID_PARAM!r} and "
            f"{RESULT_KEY_PARAM!r} (a response's kv_transfer_params; "
            f"{NUM_POSITIONS_PARAM!r} a count if there), found "
            f"{type_name(body) if not isinstance(body, dict) else sorted(body)}",
        )
    req_id = handle.req_id
    if engine is None:
        return _error(404, "no prompt hidden states: this engine does not keep them")
    (found, *_) = await engine.collective_rpc(TAKE_METHOD, args=_take_args([handle], max_bytes))
    if req_id not in found:
        return _error(
            404,
            f"no prompt hidden states for {REQUEST_ID_PARAM} {req_id!r} with that key: taken "
            "already, dropped past max_prompt_results, or never asked for",
        )
    value = decode_result(found[req_id])
    if value is None:
        return _error(
            409,
            f"the prompt hidden states of {req_id!r} could not be served exactly (a cached "
            "block lost its rows); send the request again",
        )
    if isinstance(value, int):
        return _error(
            413,
            f"the prompt hidden states of {req_id!r} take {value} bytes, over this server's "
            f"limit of {max_bytes} ({MAX_BYTES_ENV}); the result is kept until taken",
        )
    data = safetensors_bytes(value, {REQUEST_ID_PARAM: req_id})
    return Response(content=data, media_type="application/octet-stream")


def fetch_prompt_hidden_states(
    base_url: str,
    kv_transfer_params: Mapping[str, Any],
    *,
    api_key: str | None = None,
    timeout: float = 60.0,
) -> torch.Tensor | None:
    """Takes a finished request's prompt hidden states from an OpenAI server's route.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        kv_transfer_params: the response's ``kv_transfer_params``.
        api_key: the server's ``--api-key``, if it has one.
        timeout: seconds to wait for the answer.

    Returns:
        ``(num_prompt_tokens, hidden)`` rows of the model's dtype, or None
        when the worker could not read the request's hit exactly (409).

    Raises:
        ValueError: parameters without the id and key, or the server's
            refusal (404: none such, 413: too large, 400), with its message.
    """
    handle = _handle(0, kv_transfer_params)
    body: dict[str, Any] = {REQUEST_ID_PARAM: handle.req_id, RESULT_KEY_PARAM: handle.key}
    if handle.num_positions is not None:
        body[NUM_POSITIONS_PARAM] = handle.num_positions
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        base_url.rstrip("/") + ROUTE,
        data=json.dumps(body).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = response.read()
    except urllib.error.HTTPError as error:
        if error.code == 409:
            return None
        detail = error.read().decode(errors="replace")
        raise ValueError(f"POST {ROUTE}: expected 200, found {error.code}: {detail}") from error
    rows, _ = read_safetensors(data)
    return rows
