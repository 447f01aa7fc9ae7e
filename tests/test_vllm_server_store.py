"""omnicache's store behind vLLM's OpenAI server: scores from cached prefixes, rows by HTTP.

One server (vLLM 0.32's live CPU engine, default multiprocess mode) serves
the tiny Qwen2-VL of `omnicache.demo.tiny_models` with omnicache's scheduler,
worker and connector, an API key, and ``VLLM_PLUGINS=omnicache`` (the front
end's checks and the route of prompt hidden states). A scripted sequence runs
once against it, as an evaluation harness and a hostile client would use it:

- completions with ``prompt_logprobs`` and with ``echo`` + ``logprobs`` over
  prompts that share a long prefix, and chat completions with an image and
  ``prompt_logprobs``; each repeated prompt hits, and every score equals an
  engine's without caching (in this process);
- prompt hidden states taken over HTTP by the id and key the response
  carries: equal to the engine's without caching, read by the real
  ``safetensors`` library; asked twice, with a forged key, without the API
  key, with a malformed body, over the size limit: refused, nothing taken.

Same conditions as ``test_vllm_live``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_vllm_live as live
from test_vllm_server import Server

pytestmark = pytest.mark.vllm_live

API_KEY = "omnicache-test-key"
# The scored prompts' rows fit (about 550 tokens x 128 float32 values: 283 kB);
# a prompt of about 650 tokens does not.
MAX_BYTES = 300_000
CONNECTOR = json.dumps(
    {
        "kv_connector": "OmniStoreConnector",
        "kv_connector_module_path": "omnicache.integrations.vllm.connector",
        "kv_role": "kv_both",
    }
)
WORKER = "omnicache.integrations.vllm.worker.OmniCPUWorker"
ASK = {"omnicache_prompt_hidden_states": 1}
ASK_ALL = {"omnicache_all_hidden_states": 1}
EVERY_TOKENS = 5
FEW_SHOT = " ".join(
    f"Question {i}: which colour is the sky at noon? Answer: blue." for i in range(12)
)
CHOICES = [" blue", " green", " red", " the colour of grass"]


def completion(prompt: str, **fields: Any) -> dict[str, Any]:
    body = {
        "model": "tiny-vl",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "return_token_ids": True,
    }
    body.update(fields)
    return body


def image_chat(seed: int, **fields: Any) -> dict[str, Any]:
    buffer = io.BytesIO()
    live.picture(seed).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    body = {
        "model": "tiny-vl",
        "messages": chat_messages(url),
        "max_tokens": 2,
        "temperature": 0,
        "return_token_ids": True,
    }
    body.update(fields)
    return body


def chat_messages(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": live.PREAMBLE},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Which colour is it?"},
            ],
        }
    ]


def post(
    server: Server, path: str, body: Any, *, key: str | None = API_KEY
) -> tuple[int, bytes, str]:
    """Status, body and content type of a POST (a JSON body, or raw bytes)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url(path), data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers.get("Content-Type", "")


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnicache.demo.tiny_models import build_vl_model

    return build_vl_model(tmp_path_factory.mktemp("server-store") / "qwen2-vl-tiny")


@pytest.fixture(scope="module")
def server(vl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    options = [
        "--scheduler-cls", live.SCHEDULER, "--worker-cls", WORKER,
        "--kv-transfer-config", CONNECTOR, "--api-key", API_KEY, "--enable-prompt-embeds",
    ]  # fmt: skip
    env = {"VLLM_PLUGINS": "omnicache", "OMNICACHE_HTTP_MAX_BYTES": str(MAX_BYTES)}
    running = Server(vl_model, tmp_path_factory.mktemp("server-store") / "server.log", options, env)
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()


def ask(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, data, _ = post(server, path, body)
    assert status == 200, data[-2000:]
    answer: dict[str, Any] = json.loads(data)
    return answer


@pytest.fixture(scope="module")
def served(server: Server) -> dict[str, Any]:
    """The scoring sequence: what the server answered, and its prefix-cache counters."""
    results: dict[str, Any] = {"scored": [], "echoed": [], "chats": []}
    for choice in CHOICES:
        body = completion(FEW_SHOT + " Question: which colour is the sky? Answer:" + choice)
        results["scored"].append(ask(server, "/v1/completions", {**body, "prompt_logprobs": 3}))
    for choice in CHOICES[:2]:
        body = completion(FEW_SHOT + choice, echo=True, logprobs=2)
        results["echoed"].append(ask(server, "/v1/completions", body))
    for seed in (1, 1, 2):
        results["chats"].append(
            ask(server, "/v1/chat/completions", image_chat(seed, prompt_logprobs=2))
        )
    results["counters"] = server.counters()
    return results


@pytest.fixture(scope="module")
def reference(vl_model: Path, served: dict[str, Any]) -> dict[str, Any]:
    """The same prompts' scores from an engine without caching, in this process."""
    from vllm import LLM, SamplingParams

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(
            **live.engine_args(
                vl_model,
                enable_prefix_caching=False,
                limit_mm_per_prompt={"image": 1},
                worker_cls=WORKER,
                kv_transfer_config=json.loads(CONNECTOR),
            )
        )
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, extra_args=ASK)
        ids = [
            answer["choices"][0]["prompt_token_ids"]
            for answer in served["scored"] + served["echoed"]
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        chats = []
        chat_params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
        for seed in (1, 1, 2):
            buffer = io.BytesIO()
            live.picture(seed).save(buffer, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
            chats += llm.chat(chat_messages(url), chat_params, use_tqdm=False)
        from omnicache.integrations.vllm.results import take_prompt_hidden_states

        every = SamplingParams(
            max_tokens=EVERY_TOKENS, temperature=0, ignore_eos=True, extra_args=ASK_ALL
        )
        (sequence,) = llm.generate([{"prompt_token_ids": ids[0]}], every, use_tqdm=False)
        return {
            "outputs": outputs,
            "chats": chats,
            "states": take_prompt_hidden_states(llm, outputs),
            "sequence": sequence,
            "sequence_states": take_prompt_hidden_states(llm, [sequence])[0],
        }
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def served_logprobs(answer: dict[str, Any]) -> list[dict[int, tuple[float, int]] | None]:
    """A response's ``prompt_logprobs`` (a completion's first choice's, or a chat's):
    per position, token id -> (logprob, rank)."""
    served = answer["choices"][0]["prompt_logprobs"] if "text" in answer["choices"][0] else None
    return [
        None
        if position is None
        else {int(token): (value["logprob"], value["rank"]) for token, value in position.items()}
        for position in (served if served is not None else answer["prompt_logprobs"])
    ]


def assert_scores_equal(answer: dict[str, Any], want: Any) -> None:
    got = served_logprobs(answer)
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    pairs = zip(got[1:], want.prompt_logprobs[1:], strict=True)
    for position, (mine, theirs) in enumerate(pairs, start=1):
        assert sorted(mine) == sorted(theirs), position
        for token, (logprob, rank) in mine.items():
            assert rank == theirs[token].rank, (position, token)
            assert abs(logprob - theirs[token].logprob) <= live.LOGPROB_ATOL, (position, token)


def test_completions_score_from_the_cached_prefix_as_an_engine_without_caching(
    served: dict[str, Any], reference: dict[str, Any]
) -> None:
    scored = served["scored"]
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in scored]
    prefix = len(scored[0]["choices"][0]["prompt_token_ids"]) // live.BLOCK_SIZE
    # The first choice computed the few-shot prefix; the others hit it.
    assert cached[0] == 0
    assert all(hit >= (prefix - 1) * live.BLOCK_SIZE for hit in cached[1:]), cached
    for answer, want in zip(scored, reference["outputs"][: len(scored)], strict=True):
        assert answer["choices"][0]["prompt_token_ids"] == want.prompt_token_ids
        assert_scores_equal(answer, want)


def test_echo_with_logprobs_scores_the_prompt_from_the_cache(
    served: dict[str, Any], reference: dict[str, Any]
) -> None:
    echoed = served["echoed"]
    assert echoed[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for answer, want in zip(echoed, reference["outputs"][len(served["scored"]) :], strict=True):
        ids = want.prompt_token_ids
        logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
        # The prompt's tokens, then the one generated: the first has no logprob.
        assert logprobs[0] is None and len(logprobs) == len(ids) + 1
        expected = [want.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        pairs = zip(logprobs[1 : len(ids)], expected, strict=True)
        assert max(abs(a - b) for a, b in pairs) <= live.LOGPROB_ATOL


def test_chat_with_an_image_scores_from_the_cache(
    served: dict[str, Any], reference: dict[str, Any]
) -> None:
    chats = served["chats"]
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in chats]
    num_prompt = len(chats[0]["prompt_token_ids"])
    full = (num_prompt - 1) // live.BLOCK_SIZE * live.BLOCK_SIZE
    # The same picture again hits all of it; another picture the text before it.
    assert cached == [0, full, live.BLOCK_SIZE]
    for answer, want in zip(chats, reference["chats"], strict=True):
        assert answer["prompt_token_ids"] == want.prompt_token_ids
        assert_scores_equal(answer, want)
    # vLLM's counters saw every hit of the sequence.
    every = served["scored"] + served["echoed"] + chats
    hits = sum(answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in every)
    assert served["counters"][1] == hits


# -- prompt hidden states over HTTP ---------------------------------------------------------

ROUTE = "/v1/omnicache/prompt_hidden_states"


def asked(server: Server, prompt: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a completion that asked for its prompt's hidden states."""
    answer = ask(server, "/v1/completions", completion(prompt, vllm_xargs=ASK))
    params: dict[str, Any] = answer["kv_transfer_params"]
    assert sorted(params) == ["omnicache_request_id", "omnicache_result_key"]
    return {**params, "prompt_token_ids": answer["choices"][0]["prompt_token_ids"]}


def error_of(data: bytes) -> str:
    message: str = json.loads(data)["error"]["message"]
    return message


def test_hidden_states_over_http_equal_an_engine_without_caching_and_are_taken_once(
    server: Server, served: dict[str, Any], reference: dict[str, Any]
) -> None:
    import safetensors.torch
    import torch

    from omnicache.integrations.vllm.results import fetch_prompt_hidden_states

    # Behind the first scoring request's prompt: its prefix hits.
    prompt = FEW_SHOT + " Question: which colour is the sky? Answer:" + CHOICES[0]
    params = asked(server, prompt)
    handle = {k: params[k] for k in ("omnicache_request_id", "omnicache_result_key")}
    want = reference["states"][0]
    assert params["prompt_token_ids"] == reference["outputs"][0].prompt_token_ids
    # A forged key, no API key, a body that is not the parameters: nothing taken.
    forged = {**handle, "omnicache_result_key": "0" * 32}
    status, data, _ = post(server, ROUTE, forged)
    assert (status, error_of(data).startswith("no prompt hidden states for")) == (404, True)
    status, data, _ = post(server, ROUTE, handle, key=None)
    assert (status, json.loads(data)) == (401, {"error": "Unauthorized"})
    status, data, _ = post(server, ROUTE, b"not json")
    assert status == 400
    assert error_of(data) == (
        "expected a JSON object with the strings 'omnicache_request_id' and "
        "'omnicache_result_key' (a response's kv_transfer_params; 'omnicache_num_positions' a "
        "count if there), found NoneType"
    )
    status, data, _ = post(server, ROUTE, {"omnicache_request_id": handle["omnicache_request_id"]})
    assert (status, error_of(data).endswith("found ['omnicache_request_id']")) == (400, True)
    status, data, _ = post(server, ROUTE, {**handle, "omnicache_num_positions": "all"})
    assert status == 400
    # The caller takes them with the key: a safetensors file any reader loads.
    status, data, kind = post(server, ROUTE, handle)
    assert (status, kind) == (200, "application/octet-stream")
    loaded = safetensors.torch.load(data)
    assert sorted(loaded) == ["hidden_states"]
    rows = loaded["hidden_states"]
    assert rows.dtype == torch.float32 and tuple(rows.shape) == tuple(want.shape)
    assert torch.allclose(rows, want, atol=1e-5, rtol=1e-5)
    # Taken once.
    status, data, _ = post(server, ROUTE, handle)
    assert status == 404
    # The client helper, on a second request's result.
    again = asked(server, prompt)
    fetched = fetch_prompt_hidden_states(server.url(""), again, api_key=API_KEY)
    assert fetched is not None and torch.allclose(fetched, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expected 200, found 404"):
        fetch_prompt_hidden_states(server.url(""), again, api_key=API_KEY)
    # A stop string would end the request in the front end, whose response
    # then carries no kv_transfer_params: refused, with the reason.
    status, data, _ = post(
        server, "/v1/completions", completion(prompt, stop=["sky"], vllm_xargs=ASK)
    )
    assert status == 400
    assert "its response carries no kv_transfer_params to take the result with" in error_of(data)


def test_every_positions_hidden_states_over_http_equal_an_engine_without_caching(
    server: Server, served: dict[str, Any], reference: dict[str, Any]
) -> None:
    import torch

    from omnicache.integrations.vllm.results import fetch_prompt_hidden_states

    prompt = FEW_SHOT + " Question: which colour is the sky? Answer:" + CHOICES[0]
    body = completion(prompt, max_tokens=EVERY_TOKENS, ignore_eos=True, vllm_xargs=ASK_ALL)
    answer = ask(server, "/v1/completions", body)
    params = answer["kv_transfer_params"]
    num_prompt = len(answer["choices"][0]["prompt_token_ids"])
    # Every token but the last went through the model.
    assert params["omnicache_num_positions"] == num_prompt + EVERY_TOKENS - 1
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    want = reference["sequence"]
    assert answer["choices"][0]["token_ids"] == list(want.outputs[0].token_ids)
    rows = fetch_prompt_hidden_states(server.url(""), params, api_key=API_KEY)
    expected = reference["sequence_states"]
    assert rows is not None and rows.shape == expected.shape == (num_prompt + EVERY_TOKENS - 1, 128)
    assert torch.allclose(rows, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expected 200, found 404"):
        fetch_prompt_hidden_states(server.url(""), params, api_key=API_KEY)
    # A stop string ends a request in the front end, after the engine may have
    # computed past it: refused, with the reason.
    status, data, _ = post(server, "/v1/completions", {**body, "stop": ["sky"]})
    assert status == 400
    assert "expected no stop strings" in error_of(data)


def test_a_result_over_the_size_limit_is_refused_and_kept(server: Server) -> None:
    params = asked(server, FEW_SHOT + FEW_SHOT[:300])
    handle = {k: params[k] for k in ("omnicache_request_id", "omnicache_result_key")}
    size = len(params["prompt_token_ids"]) * 128 * 4
    assert size > MAX_BYTES
    for _ in range(2):
        status, data, _ = post(server, ROUTE, handle)
        assert status == 413
        assert error_of(data) == (
            f"the prompt hidden states of {handle['omnicache_request_id']!r} take {size} bytes, "
            f"over this server's limit of {MAX_BYTES} (OMNICACHE_HTTP_MAX_BYTES); the result is "
            "kept until taken"
        )


def test_prompt_logprobs_with_prompt_embeds_are_refused_and_change_nothing(
    server: Server,
) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(torch.zeros(40, 128), buffer)
    embeds = base64.b64encode(buffer.getvalue()).decode()
    before = server.counters()
    body = {"model": "tiny-vl", "prompt_embeds": embeds, "max_tokens": 1, "prompt_logprobs": 1}
    status, data, _ = post(server, "/v1/completions", body)
    assert status == 400
    assert error_of(data) == "prompt_logprobs is not compatible with prompt embeds."
    assert server.counters() == before
