"""lm-evaluation-harness scoring through vLLM's OpenAI server, with and without omnicache.

EleutherAI's lm-evaluation-harness (lm-eval), unchanged, scores a
multiple-choice task through its ``local-completions`` model: one
completions request per answer choice, the context and the choice as token
ids, with ``echo`` and ``logprobs``; the choice's log-likelihood is the sum
of its tokens' logprobs. Every request of the task starts with the same
long few-shot prefix. vLLM keeps requests that ask for prompt logprobs off
its prefix cache, so with its caching on each request still recomputes the
prefix; omnicache's store scores the cached prefix from its rows.

The script builds a tiny-but-wide random-weight Qwen2 locally and writes a
small arithmetic task for lm-eval (its data as JSON lines, its YAML: a fixed
description and the first few-shot examples of a fixed split in front of
every question, at least 1,500 tokens). Three servers of the model are
started in turn on a loopback port: prefix caching off, vLLM's prefix
caching, omnicache (its scheduler, worker and connector). Against each,
lm-eval runs as a subprocess with ``--log_samples``; its wall time is
measured from the subprocess's start to its end (the server's start is not
in it). Before it, each server answers the same two untimed warm-up
requests, which share none of the task's text, so that kernel building is
charged to no configuration and the task's prefix is computed within the
timed run everywhere.

It prints, per server, lm-eval's accuracy, its wall time, the speedup over
vLLM's caching, and from ``/metrics`` the prompt tokens vLLM counted as
prefix-cache hits and the engine's time in the requests (the sum of
``vllm:e2e_request_latency_seconds``: from a request's arrival to its last
output, before the server writes the response); then the largest difference
of any choice's log-likelihood from caching off's. It exits nonzero if the
accuracies differ or a log-likelihood differs by more than 1e-4.

The harness's wall time also holds what no cache shortens: its own start
(imports, reading the task, building the contexts), and for each request
the response's round trip (the server writes every echoed position's token
and logprob, lm-eval reads them back). The engine's time is the part the
cache serves; with a model this small, the rest is a large share of the
harness's time.

Run it in the live engine's environment (``./dev live`` prepares it) once
``scripts/install-lm-eval.sh`` has added lm-eval to it; it starts three
servers, about a minute each on 2 cores:

    .venv-live/bin/python examples/lm_eval_scoring.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Beside this file: run as a script, its folder is on sys.path.
from vllm_scoring import OMNICACHE, OMNICACHE_ENV, server

from omnicache.demo.openai_server import read_metrics
from omnicache.integrations.vllm.common import live_engine_missing

LM_EVAL_VERSION = "0.4.13"  # scripts/install-lm-eval.sh installs this one
TASK = "omnicache_sums"
MIN_PREFIX_TOKENS = 1500
MAX_LENGTH = 2048  # the server's --max-model-len (examples/vllm_scoring.py), lm-eval's max_length
# float32 on both sides: a position's logprob from the store equals caching
# off's within 1e-5 (docs/vllm.md, "Scoring from the store"), and the
# positions computed after a hit attend to cached KV, equal in all but the
# last float bits. A choice sums 2 or 3 of them; 1e-4 leaves room for that
# and is far below any difference that reorders choices.
TOLERANCE = 1e-4
SERVERS = {
    "caching off": ["--no-enable-prefix-caching"],
    "vLLM's caching": ["--enable-prefix-caching"],
    "omnicache": OMNICACHE,
}
NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry"]
THINGS = ["apples", "books", "coins", "shells", "stamps", "pencils", "marbles", "cards"]
DESCRIPTION = (
    "The following are questions about adding whole numbers, with answers. Each question "
    "tells how many things a person has and how many more the person gets, then asks how "
    "many the person has in all. The answer is the sum of the two numbers, written in "
    "digits, with no words and no units. Read each question carefully, add the first number "
    "to the second number, and give the total. Nobody loses or gives away anything in these "
    "questions, so the answer is never smaller than either number. Numbers are written in "
    "digits in every question and every answer. Here are worked examples in the same form "
    "as the questions that follow them; every example ends with its correct answer.\n\n"
)
NUM_SHOTS = 14
NUM_QUESTIONS = 24


def question(index: int) -> tuple[str, int]:
    """The text and answer of question ``index``: fixed content, no randomness."""
    name, things = NAMES[index % len(NAMES)], THINGS[(index * 3) % len(THINGS)]
    first, second = 3 + (index * 7) % 41, 2 + (index * 5) % 29
    text = (
        f"Question: {name} has {first} {things} and gets {second} more {things}. "
        f"How many {things} does {name} have now?\nAnswer:"
    )
    return text, first + second


def write_task(folder: Path) -> str:
    """The task's data and YAML in ``folder``; returns the text in front of every question."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for split, indices in (
        ("train", range(NUM_SHOTS)),
        ("test", range(100, 100 + NUM_QUESTIONS)),
    ):
        rows[split] = []
        for index in indices:
            text, answer = question(index)
            wrong = [answer + 1, answer - 1, answer + 10]
            gold = index % 4  # the answer's place among the choices
            choices = [str(n) for n in [*wrong[:gold], answer, *wrong[gold:]]]
            rows[split].append({"question": text, "choices": choices, "label": gold})
        lines = [json.dumps(row) for row in rows[split]]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {split: str(folder / f"{split}.jsonl") for split in rows}},
        "training_split": "train",
        "test_split": "test",
        "output_type": "multiple_choice",
        "description": DESCRIPTION,
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "num_fewshot": NUM_SHOTS,
        "fewshot_config": {"sampler": "first_n", "split": "train"},
        "target_delimiter": " ",
        "fewshot_delimiter": "\n\n",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    # JSON is YAML: the strings keep their escapes exactly.
    (folder / f"{TASK}.yaml").write_text(json.dumps(config, indent=2) + "\n")
    shots = "".join(
        f"{row['question']} {row['choices'][row['label']]}\n\n" for row in rows["train"]
    )
    return DESCRIPTION + shots


def complete(url: str, prompt: list[int]) -> None:
    """One completions request as lm-eval sends it (token ids, ``echo`` and ``logprobs``)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    body.update(echo=True, logprobs=1)
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def run_lm_eval(url: str, model: Path, task_dir: Path, output: Path, log: Path) -> float:
    """lm-eval on the task against ``url``; returns its wall time in seconds."""
    model_args = {
        "model": "tiny",
        "base_url": f"{url}/v1/completions",
        "tokenizer": str(model),
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
        "max_length": MAX_LENGTH,
    }
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args", ",".join(f"{key}={value}" for key, value in model_args.items()),
        "--include_path", str(task_dir), "--tasks", TASK,
        "--log_samples", "--output_path", str(output),
    ]  # fmt: skip
    environment = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # everything is local: the model's folder, the task's files
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(task_dir.parent / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    with log.open("wb") as out:
        start = time.perf_counter()
        status = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
        seconds = time.perf_counter() - start
    if status != 0:
        sys.exit(f"lm-eval exited with {status}: {log.read_text(errors='replace')[-3000:]}")
    return seconds


def read_results(output: Path) -> tuple[float, dict[tuple[int, int], float], list[str]]:
    """lm-eval's accuracy, each (doc, choice)'s log-likelihood and each request's context."""
    (results_file,) = output.rglob("results_*.json")
    accuracy = float(json.loads(results_file.read_text())["results"][TASK]["acc,none"])
    (samples_file,) = output.rglob(f"samples_{TASK}_*.jsonl")
    loglikelihoods, contexts = {}, []
    for line in samples_file.read_text().splitlines():
        sample: dict[str, Any] = json.loads(line)
        for choice, (loglikelihood, _greedy) in enumerate(sample["filtered_resps"]):
            loglikelihoods[sample["doc_id"], choice] = float(loglikelihood)
        contexts += [argument["arg_0"] for argument in sample["arguments"].values()]
    return accuracy, loglikelihoods, contexts


def main() -> None:
    missing = live_engine_missing()
    if missing is not None:
        sys.exit(f"{missing}: run ./dev live once to prepare .venv-live")
    try:
        import lm_eval
    except ImportError:
        sys.exit("lm-eval is not installed here: run scripts/install-lm-eval.sh once")
    from transformers import AutoTokenizer

    from omnicache.demo.tiny_models import build_text_model

    tmp = Path(tempfile.mkdtemp())
    model = build_text_model(tmp / "qwen2-wide", hidden_size=1024)
    tokenizer = AutoTokenizer.from_pretrained(model)
    task_dir = tmp / "task"
    task_dir.mkdir()
    prefix = write_task(task_dir)
    prefix_tokens = len(tokenizer.encode(prefix))
    if prefix_tokens < MIN_PREFIX_TOKENS:
        sys.exit(f"the few-shot prefix is {prefix_tokens} tokens, under {MIN_PREFIX_TOKENS}")
    # Two warm-up requests, the second sharing the first's start: no text of the task.
    warm_up = tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 160))
    warm_ups = [warm_up[: prefix_tokens + 40], warm_up[:prefix_tokens] + warm_up[-40:]]

    runs: dict[str, dict[str, Any]] = {}
    for name, options in SERVERS.items():
        slug = name.replace(" ", "-").replace("'", "")
        env = OMNICACHE_ENV if name == "omnicache" else None
        with server(model, options, tmp / f"server-{slug}.log", env) as url:
            for prompt in warm_ups:
                complete(url, prompt)
            before = read_metrics(url)
            output = tmp / f"lm-eval-{slug}"
            seconds = run_lm_eval(url, model, task_dir, output, tmp / f"lm-eval-{slug}.log")
            after = read_metrics(url)
        accuracy, loglikelihoods, contexts = read_results(output)
        if not all(context.startswith(prefix) for context in contexts):
            sys.exit(f"{name}: lm-eval sent a context that does not start with the prefix")
        runs[name] = {
            "accuracy": accuracy,
            "seconds": seconds,
            "loglikelihoods": loglikelihoods,
            "requests": len(contexts),
            **{key: after.get(key, 0.0) - before.get(key, 0.0) for key in after},
        }

    baseline = runs["caching off"]["loglikelihoods"]
    print(
        f"lm-eval {lm_eval.__version__}: {runs['caching off']['requests']} loglikelihood "
        f"requests ({NUM_QUESTIONS} questions x 4 choices), each behind the same "
        f"{prefix_tokens}-token few-shot prefix; files in {tmp}"
    )
    print(
        f"{'server':<16}{'accuracy':>10}{'lm-eval s':>11}{'vs vLLM':>11}"
        f"{'hit tokens':>12}{'engine s':>10}"
    )
    reference = runs["vLLM's caching"]["seconds"]
    for name, run in runs.items():
        print(
            f"{name:<16}{run['accuracy']:>10.4f}{run['seconds']:>11.2f}"
            f"{reference / run['seconds']:>10.2f}x{int(run['vllm:prefix_cache_hits_total']):>12,}"
            f"{run['vllm:e2e_request_latency_seconds_sum']:>10.2f}"
        )
    failures = []
    for name in ("omnicache", "vLLM's caching"):
        run = runs[name]
        if run["loglikelihoods"].keys() != baseline.keys():
            sys.exit(f"{name}: lm-eval scored other choices than with caching off")
        largest = max(abs(run["loglikelihoods"][key] - baseline[key]) for key in baseline)
        print(f"largest |log-likelihood difference|, {name} vs caching off: {largest:.2e}")
        if largest > TOLERANCE:
            failures.append(f"{name}'s log-likelihoods differ by {largest:.2e} > {TOLERANCE}")
        if run["accuracy"] != runs["caching off"]["accuracy"]:
            failures.append(f"{name}'s accuracy {run['accuracy']} is not caching off's")
    print(
        f"omnicache vs vLLM's caching: lm-eval wall time "
        f"{reference / runs['omnicache']['seconds']:.2f}x faster"
    )
    if failures:
        sys.exit("; ".join(failures))


if __name__ == "__main__":
    main()
