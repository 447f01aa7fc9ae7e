"""The demo's trace as vLLM's benchmark datasets, read back by vLLM 0.32's own loaders.

`export_bench_datasets` writes ``custom_image`` and ``custom_audio`` JSONL
files for ``vllm bench serve``. Here vLLM's ``CustomImageDataset`` and
``CustomAudioDataset`` (the classes behind ``--dataset-name custom_image``
and ``custom_audio``; the audio file read without pandas, which vLLM's
``custom_audio`` loader needs and the live environment lacks) read them,
and what they would send is checked against the trace: every request in
order, its text and pictures in order, every picture's identity as the
server computes it from the file, every clip's samples as vLLM reads them,
and a later turn of a conversation extending the earlier turn's prompt
exactly (the shared prefix the trace exists to test).

Needs vLLM 0.32's benchmark package (the live environment); same gate as
``test_vllm_live``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_vllm_live as live
from PIL import Image

from omnicache.demo.bench_datasets import export_bench_datasets
from omnicache.demo.workloads import AudioItem, ImageItem, SyntheticConfig, synthetic_trace
from omnicache.identity import item_identity

pytestmark = live.pytestmark

ROLES = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


def _expected_parts(request: Any) -> list[tuple[str, Any]]:
    """The request as ("text", str) and ("image", ImageItem) in order, text runs joined."""
    parts: list[tuple[str, Any]] = []
    for index, message in enumerate(request.messages):
        pieces: list[Any] = [("\n\n" if index else "") + ROLES[message.role]]
        pieces += [p for p in message.parts if not isinstance(p, AudioItem)]
        for piece in pieces:
            if isinstance(piece, str):
                if parts and parts[-1][0] == "text":
                    parts[-1] = ("text", parts[-1][1] + piece)
                else:
                    parts.append(("text", piece))
            else:
                parts.append(("image", piece))
    return parts


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    trace = synthetic_trace(SyntheticConfig(num_requests=30, num_tenants=2, audio_probability=0.6))
    return trace, export_bench_datasets(trace, tmp_path_factory.mktemp("bench") / "out")


def test_vllm_reads_every_request_with_its_text_and_pictures_in_order(
    exported: tuple[Any, Any],
) -> None:
    from vllm.benchmarks.datasets import CustomImageDataset

    trace, out = exported
    dataset = CustomImageDataset(dataset_path=str(out.images), disable_shuffle=True)
    sampled = dataset.sample(tokenizer=None, num_requests=0, output_len=16)
    assert len(sampled) == trace.num_requests == out.num_image_requests
    lines = [json.loads(line) for line in out.images.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == [r.request_id for r in trace.requests]
    assert [line["tenant"] for line in lines] == [r.tenant for r in trace.requests]
    images_seen = 0
    for request, sample in zip(trace.requests, sampled, strict=True):
        assert sample.expected_output_len == 16
        expected = _expected_parts(request)
        assert len(sample.prompt) == len(expected)
        for part, (kind, value) in zip(sample.prompt, expected, strict=True):
            if kind == "text":
                assert part == {"type": "text", "text": value}
                continue
            images_seen += 1
            url = part["image_url"]["url"]
            assert part["type"] == "image_url" and url.startswith("file:///")
            path = Path(url.removeprefix("file://"))
            assert path.parent == out.media
            with Image.open(path) as opened:
                assert opened.mode == value.image.mode
                assert item_identity(opened, modality="image") == item_identity(
                    value.image, modality="image"
                )
    assert images_seen > 0
    clips = sum(1 for r in trace.requests for m in r.media() if isinstance(m, AudioItem))
    assert clips > 0 and out.num_clips_left_out == clips
    # Each picture is written once, however many requests name it.
    distinct = {id(m) for r in trace.requests for m in r.media() if isinstance(m, ImageItem)}
    assert len(list(out.media.glob("*.png"))) == len(distinct)


def test_a_later_turn_extends_the_earlier_turns_prompt_exactly(exported: tuple[Any, Any]) -> None:
    trace, out = exported
    flat: dict[str, str] = {}
    for request, line in zip(trace.requests, out.images.read_text().splitlines(), strict=True):
        flat[request.request_id] = "".join(
            part["text"] if part["type"] == "text" else f"<{part['image']}>"
            for part in json.loads(line)["content"]
        )
    by_conversation: dict[str, list[str]] = {}
    for request in trace.requests:
        if request.conversation is not None:
            by_conversation.setdefault(request.conversation, []).append(request.request_id)
    pairs = [(a, b) for ids in by_conversation.values() for a, b in itertools.pairwise(ids)]
    assert pairs, "the trace has no conversation of two turns"
    for earlier, later in pairs:
        assert flat[later].startswith(flat[earlier]) and len(flat[later]) > len(flat[earlier])


def test_vllm_reads_every_clip_as_written(exported: tuple[Any, Any]) -> None:
    from vllm.benchmarks.datasets import CustomAudioDataset
    from vllm.benchmarks.datasets.datasets import process_audio

    class JsonLines(CustomAudioDataset):  # type: ignore[misc]
        """vLLM's loader of ``custom_audio``, its JSONL read by the standard library.

        vLLM reads the file with pandas (``read_json(lines=True)``, a dict a
        line), which the live environment does not install; `sample`, which
        makes the requests, is vLLM's.
        """

        def load_data(self) -> None:
            self.data = [
                json.loads(line) for line in Path(self.dataset_path).read_text().splitlines()
            ]

    trace, out = exported
    with_clip = [r for r in trace.requests if any(isinstance(m, AudioItem) for m in r.media())]
    assert out.audio is not None and out.num_audio_requests == len(with_clip)
    dataset = JsonLines(dataset_path=str(out.audio), disable_shuffle=True)
    sampled = dataset.sample(tokenizer=None, num_requests=0, output_len=16)
    assert len(sampled) == len(with_clip)
    lines = [json.loads(line) for line in out.audio.read_text().splitlines()]
    left_out = 0
    for request, sample, line in zip(with_clip, sampled, lines, strict=True):
        assert line["request_id"] == request.request_id
        text = "\n\n".join(
            ROLES[m.role] + "".join(p for p in m.parts if isinstance(p, str))
            for m in request.messages
        )
        assert sample.prompt == text
        media = list(request.media())
        left_out += len(media) - 1
        clip = next(m for m in media if isinstance(m, AudioItem))
        samples, rate = process_audio(line["audio"])
        assert rate == clip.sample_rate
        # 16-bit PCM as written (round(x * 32767) in float64), read back by soundfile over 32768.
        exact = np.asarray(clip.waveform, dtype=np.float64)
        expected = np.round(np.clip(exact, -1.0, 1.0) * 32767.0) / 32768.0
        np.testing.assert_array_equal(samples, expected.T if expected.ndim == 2 else expected)
    assert out.num_items_left_out_of_audio == left_out
