"""Item identity in a live engine: tenants do not share vLLM's caches; videos are their metadata.

- The tenant scope (in process, tiny Qwen2-VL): one picture sent by two
  tenants, each time behind other text (so that no prefix hit covers it),
  runs the vision encoder once per tenant, and hits vLLM's processor cache
  only within a tenant; vLLM on its own runs it once for both (the side
  channel). With the front end (``install_mm_uuids``, what
  ``OMNICACHE_MM_UUIDS=1`` installs) and with a client's
  ``multi_modal_uuids(..., cache_salt=...)`` alike.
- Over HTTP (vLLM's OpenAI server with the front end and the store, tiny
  Qwen2.5-VL): two video files whose frames decode equal and whose fps
  differs share no block of the video, and each answer's prompt hidden states
  (taken by omnicache's route) are an engine's without caching for that file.

In process, the same videos are the matrix's (``test_vllm_architectures``).
Same conventions as ``test_vllm_live``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_vllm_live as live
from test_vllm_server import Server, item_span
from test_vllm_server_store import API_KEY, CONNECTOR, WORKER, post

pytestmark = live.pytestmark

SCOPE_CHILD = """
import json, sys
from pathlib import Path
import test_vllm_live as t
from vllm import LLM
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from omnicache.integrations.vllm import multi_modal_uuids
from omnicache.integrations.vllm.frontend import install_mm_uuids

model = Path(sys.argv[1])
runs = []
original = Qwen2VLForConditionalGeneration.embed_multimodal

def counted(self, **kwargs):
    runs.append(1)
    return original(self, **kwargs)

Qwen2VLForConditionalGeneration.embed_multimodal = counted
# Each request's text before the picture differs from the first block on, so no
# prefix hit covers the picture: only vLLM's encoder cache can spare its encoder.
SEQUENCE = [("a", 1), ("a", 2), ("b", 3), ("b", 4), (None, 5), (None, 6)]

def mm_counters(llm):
    names = ("vllm:mm_cache_queries", "vllm:mm_cache_hits")
    found = {m.name: m.value for m in llm.get_metrics() if m.name in names}
    return found["vllm:mm_cache_queries"], found["vllm:mm_cache_hits"]

report = {}
for mode in ("vllm alone", "client uuids", "front end"):
    if mode == "front end":
        install_mm_uuids()
    scheduler = {} if mode == "vllm alone" else {"scheduler_cls": t.SCHEDULER}
    llm = LLM(**t.engine_args(model, limit_mm_per_prompt={"image": 1}, **scheduler))
    found = {"encoder_runs": [], "processor_cache_hits": [], "hits": []}
    for salt, text in SEQUENCE:
        prompt = t.image_prompt(t.picture(1), salt, with_uuids=mode == "client uuids")
        prompt["prompt"] = f"Request {text}. " + prompt["prompt"]
        before, (_, hits_before) = len(runs), mm_counters(llm)
        output = t.run_one(llm, prompt)
        found["encoder_runs"].append(len(runs) - before)
        found["processor_cache_hits"].append(mm_counters(llm)[1] - hits_before)
        found["hits"].append(output.num_cached_tokens)
    report[mode] = found
    t.shut(llm)
print(json.dumps(report))
"""


def test_a_second_tenant_runs_the_encoder_again_and_the_same_tenant_does_not(
    tmp_path: Path,
) -> None:
    from omnicache.demo.tiny_models import build_vl_model

    model = build_vl_model(tmp_path / "qwen2-vl-tiny")
    report = json.loads(live.run_child(SCOPE_CHILD, str(model), timeout_s=600))
    # vLLM alone: the encoder runs once for the picture, whoever sends it after.
    assert report["vllm alone"]["encoder_runs"] == [1, 0, 0, 0, 0, 0]
    assert report["vllm alone"]["processor_cache_hits"] == [0, 1, 1, 1, 1, 1]
    for mode in ("client uuids", "front end"):
        # Scoped to the salt: once per tenant (and once for requests without one).
        assert report[mode]["encoder_runs"] == [1, 0, 1, 0, 1, 0], mode
        assert report[mode]["processor_cache_hits"] == [0, 1, 0, 1, 0, 1], mode
    # Every text differs from the first block on: no prefix hit at all.
    assert {hit for found in report.values() for hit in found["hits"]} == {0}


# -- two video files, one set of frames, two fps: over HTTP ---------------------------


def video_file(path: Path, fps: float) -> Path:
    """An MJPEG AVI of the same eight 112x112 frames, at ``fps``."""
    import cv2

    frames = np.random.default_rng(7).integers(0, 256, (8, 112, 112, 3), dtype=np.uint8)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (112, 112))
    for frame in frames:
        writer.write(frame)
    writer.release()
    return path


def video_messages(path: Path) -> list[dict[str, Any]]:
    url = "data:video/x-msvideo;base64," + base64.b64encode(path.read_bytes()).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": live.PREAMBLE},
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "What happens in it?"},
            ],
        }
    ]


ASK = {"omnicache_prompt_hidden_states": 1}


@pytest.fixture(scope="module")
def video_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_architectures import build_qwen25vl_model

    return build_qwen25vl_model(tmp_path_factory.mktemp("identity") / "qwen2.5-vl-tiny")


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("videos")
    return {"2 fps": video_file(root / "two.avi", 2.0), "1 fps": video_file(root / "one.avi", 1.0)}


@pytest.fixture(scope="module")
def video_server(video_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    options = [
        "--scheduler-cls", live.SCHEDULER, "--worker-cls", WORKER,
        "--kv-transfer-config", CONNECTOR, "--api-key", API_KEY,
        "--limit-mm-per-prompt", json.dumps({"video": 1}),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("identity-server") / "server.log"
    running = Server(video_model, log, options, {"VLLM_PLUGINS": "omnicache"})
    try:
        running.wait_ready()
        yield running
    finally:
        running.close()


def oracle_states(model: Path, videos: dict[str, Path]) -> dict[str, Any]:
    """Each file's prompt hidden states and tokens from an engine without caching (in process:
    the caller holds the ``in_process`` fixture)."""
    from vllm import LLM, SamplingParams

    from omnicache.integrations.vllm.results import take_prompt_hidden_states

    llm = LLM(
        **live.engine_args(
            model,
            enable_prefix_caching=False,
            limit_mm_per_prompt={"video": 1},
            worker_cls=WORKER,
            kv_transfer_config=json.loads(CONNECTOR),
        )
    )
    params = SamplingParams(max_tokens=live.MAX_TOKENS, temperature=0, extra_args=ASK)
    found = {}
    for name, path in videos.items():
        (output,) = llm.chat(video_messages(path), params, use_tqdm=False)
        (states,) = take_prompt_hidden_states(llm, [output])
        found[name] = {"ids": list(output.prompt_token_ids), "states": states}
    live.shut(llm)
    return found


def test_two_video_files_that_differ_in_fps_alone_share_no_block_and_get_their_own_rows(
    video_server: Server, video_model: Path, videos: dict[str, Path], in_process: None
) -> None:
    import torch

    from omnicache.integrations.vllm.results import fetch_prompt_hidden_states

    served = []
    for name in ("2 fps", "1 fps", "2 fps"):
        body = {
            "model": "tiny-vl",
            "messages": video_messages(videos[name]),
            "max_tokens": live.MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "vllm_xargs": ASK,
        }
        status, data, _ = post(video_server, "/v1/chat/completions", body)
        assert status == 200, data[-2000:]
        answer = json.loads(data)
        states = fetch_prompt_hidden_states(
            video_server.url(""), answer["kv_transfer_params"], api_key=API_KEY
        )
        served.append((name, answer, states))
    oracle = oracle_states(video_model, videos)
    ids = oracle["2 fps"]["ids"]
    assert oracle["1 fps"]["ids"] == ids  # the same tokens: only the rows can tell them apart
    video_pad, _ = item_span(ids, video_model, "<|video_pad|>")
    full = (len(ids) - 1) // live.BLOCK_SIZE * live.BLOCK_SIZE
    before_video = video_pad // live.BLOCK_SIZE * live.BLOCK_SIZE
    hits = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for _, answer, _ in served]
    assert hits == [0, before_video, full]
    for name, answer, states in served:
        assert answer["prompt_token_ids"] == ids
        want = oracle[name]["states"]
        assert torch.allclose(states, want, atol=1e-5, rtol=1e-5), name
    # The fps reaches the model: the two files' rows differ from the video on.
    one, two = oracle["1 fps"]["states"], oracle["2 fps"]["states"]
    assert torch.equal(one[:video_pad], two[:video_pad])
    assert not torch.allclose(one[video_pad:], two[video_pad:], atol=1e-5, rtol=1e-5)
