"""Scoring answer choices through vLLM's OpenAI server, as evaluation harnesses do, with omnicache.

A harness scores a multiple-choice item by the log-likelihood of each
choice's tokens after a long few-shot prompt: one completion request per
choice, with ``echo`` and ``logprobs`` (so the server returns the prompt's
token logprobs), summing those of the choice. vLLM keeps such requests off
its prefix cache, so every choice recomputes the whole prompt. omnicache's
store scores the cached prefix from its rows instead.

A tiny-but-wide random-weight Qwen2 is built locally (nothing is
downloaded) and served twice on a loopback port: prefix caching off, then
omnicache (its scheduler, worker and connector). The same requests go to
both; the script prints each choice's log-likelihood from each server, the
time each server took, and the prompt tokens omnicache found cached.

Run it in the live engine's environment (``./dev live`` prepares it); it
starts two servers, about 40 s each:

    .venv-live/bin/python examples/vllm_scoring.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omnicache.demo.openai_server import OpenAIServer, ServerError, read_metrics
from omnicache.integrations.vllm.common import (
    SCHEDULER_CLS,
    WORKER_CLS,
    cpu_server_env,
    live_engine_missing,
    store_kv_transfer_config,
)

SHOTS = " ".join(f"Question {i}: which colour is the sky at noon? Answer: blue." for i in range(30))
QUESTIONS = ["Which colour is the sky?", "Which colour is grass?", "Which colour is a fox?"]
CHOICES = [" blue", " green", " red", " brown"]
OMNICACHE = [
    "--enable-prefix-caching",
    "--scheduler-cls", SCHEDULER_CLS,
    "--worker-cls", WORKER_CLS,
    "--kv-transfer-config", json.dumps(store_kv_transfer_config()),
]  # fmt: skip
# vLLM's CPU engine reserves no core for omnicache's connector (see cpu_server_env).
OMNICACHE_ENV = cpu_server_env()


@contextmanager
def server(
    model: Path, options: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """An OpenAI server of ``model`` on a free loopback port; yields its base URL."""
    common = [
        "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(256 * 2**20),
        "--max-model-len", "2048", "--enforce-eager",
    ]  # fmt: skip
    try:
        with OpenAIServer(model, log, common + options, env=env) as running:
            yield running.url
    except ServerError as exc:
        sys.exit(str(exc))


def prefix_cache_hits(url: str) -> int:
    """vLLM's count of prompt tokens found cached, from ``/metrics``."""
    return int(read_metrics(url).get("vllm:prefix_cache_hits_total", 0.0))


def score(url: str, prompts: list[list[int]]) -> tuple[list[list[float]], int, float]:
    """The prompt token logprobs of each prompt (one batched request), cached tokens, seconds."""
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 1, "temperature": 0}
    body.update(echo=True, logprobs=1)  # as lm-evaluation-harness asks for log-likelihoods
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    hits = prefix_cache_hits(url)
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer: dict[str, Any] = json.loads(response.read())
    seconds = time.perf_counter() - start
    logprobs = [choice["logprobs"]["token_logprobs"] for choice in answer["choices"]]
    return logprobs, prefix_cache_hits(url) - hits, seconds


def main() -> None:
    missing = live_engine_missing()
    if missing is not None:
        sys.exit(f"{missing}: run ./dev live once to prepare .venv-live")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from transformers import AutoTokenizer

    from omnicache.demo.tiny_models import build_text_model

    tmp = Path(tempfile.mkdtemp())
    model = build_text_model(tmp / "qwen2-wide", hidden_size=1024)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Context and choice tokenized apart, so that the choice's tokens are known.
    contexts = {q: tokenizer.encode(f"{SHOTS} Question: {q} Answer:") for q in QUESTIONS}
    items = [(q, c, contexts[q], tokenizer.encode(c)) for q in QUESTIONS for c in CHOICES]
    prompts = [context + continuation for _, _, context, continuation in items]

    results = {}
    for name, options, env in (("caching off", [], None), ("omnicache", OMNICACHE, OMNICACHE_ENV)):
        with server(model, options, tmp / f"{name}.log", env) as url:
            score(url, prompts[:1])  # a warm-up request, which also computes the shots
            results[name] = score(url, prompts)

    print(f"{len(prompts)} requests of about {len(prompts[0])} tokens, sharing the few-shot prompt")
    print(f"{'question':<28}{'choice':<9}{'caching off':>14}{'omnicache':>14}")
    for index, (question, choice, context, continuation) in enumerate(items):
        span = slice(len(context), len(context) + len(continuation))
        sums = [sum(results[name][0][index][span]) for name in ("caching off", "omnicache")]
        print(f"{question:<28}{choice!r:<9}{sums[0]:>14.4f}{sums[1]:>14.4f}")
    for name, (_, cached, seconds) in results.items():
        print(f"{name:<12} {seconds:6.2f} s, {cached:,} prompt tokens cached")


if __name__ == "__main__":
    main()
