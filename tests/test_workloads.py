"""Synthetic traces and the JSONL trace reader with its errors (media: test_media.py)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hashing import hash_audio, hash_image
from omnicache.demo.wav import write_wav
from omnicache.demo.workloads import (
    SYSTEM_PROMPT,
    AudioItem,
    ImageItem,
    Message,
    SyntheticConfig,
    Trace,
    TraceError,
    load_trace,
    synthetic_trace,
)

SMALL = SyntheticConfig(num_requests=40, num_images=8, num_audio_clips=3)


def _fingerprint(trace: Trace) -> list[tuple[object, ...]]:
    """Everything a trace holds, as comparable values (pixels and samples by digest)."""
    out: list[tuple[object, ...]] = []
    for request in trace.requests:
        parts: list[object] = []
        for message in request.messages:
            for part in message.parts:
                if isinstance(part, str):
                    parts.append((message.role, part))
                elif isinstance(part, ImageItem):
                    parts.append((message.role, part.name, hash_image(part.image).hex()))
                else:
                    digest = hash_audio(part.waveform, part.sample_rate).hex()
                    parts.append((message.role, part.name, digest))
        out.append(
            (request.request_id, request.tenant, request.cache_salt, request.conversation, *parts)
        )
    return out


# -- synthetic traces ---------------------------------------------------------------


def test_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    first = _fingerprint(synthetic_trace(SMALL, seed=3))
    assert first == _fingerprint(synthetic_trace(SMALL, seed=3))
    assert first != _fingerprint(synthetic_trace(SMALL, seed=4))


def test_synthetic_trace_has_tenants_with_their_own_salts_and_a_shared_system_prompt() -> None:
    trace = synthetic_trace(SMALL, seed=0)
    assert trace.num_requests == 40
    assert sorted(trace.tenants) == ["acme", "globex", "initech"]
    salts = {r.tenant: r.cache_salt for r in trace.requests}
    assert len(set(salts.values())) == 3
    for request in trace.requests:
        assert request.cache_salt == salts[request.tenant]
        assert request.messages[0] == Message("system", (SYSTEM_PROMPT,))
        assert request.messages[-1].role == "user"


def test_synthetic_media_vary_in_size_mode_rate_and_channels() -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=80), seed=0)
    images = {id(i): i for r in trace.requests for i in r.media() if isinstance(i, ImageItem)}
    clips = {id(c): c for r in trace.requests for c in r.media() if isinstance(c, AudioItem)}
    assert len({i.image.mode for i in images.values()}) >= 3
    assert len({i.image.size for i in images.values()}) >= 3
    assert len({c.sample_rate for c in clips.values()}) >= 2
    assert {c.waveform.ndim for c in clips.values()} == {1, 2}
    for clip in clips.values():
        assert clip.waveform.dtype == np.float32
        assert float(np.abs(clip.waveform).max()) <= 1.0


def test_popular_images_recur_across_requests() -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=120), seed=0)
    uses = Counter(
        item.name
        for request in trace.requests
        for item in request.messages[1].parts
        if isinstance(item, ImageItem)
    )
    counts = sorted(uses.values(), reverse=True)
    # Zipf popularity: the favourite opens many conversations, the tail few.
    assert counts[0] >= 3 * counts[len(counts) // 2]


def test_each_turn_extends_the_previous_turn_of_its_conversation() -> None:
    trace = synthetic_trace(SMALL, seed=1)
    last: dict[str, tuple[Message, ...]] = {}
    num_followups = 0
    for request in trace.requests:
        assert request.conversation is not None
        previous = last.get(request.conversation)
        if previous is not None:
            num_followups += 1
            assert request.messages[: len(previous)] == previous
            assert request.messages[len(previous)].role == "assistant"
            assert len(request.messages) == len(previous) + 2
        last[request.conversation] = request.messages
    assert num_followups >= 10


def test_bad_synthetic_config_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^num_requests: expected int >= 1, found 0$"):
        SyntheticConfig(num_requests=0)
    with pytest.raises(
        ValueError, match=r"^continue_probability: expected a number in \[0.0, 1.0\], found 1.5$"
    ):
        SyntheticConfig(continue_probability=1.5)
    with pytest.raises(ValueError, match=r"^seed: expected int >= 0, found -1$"):
        synthetic_trace(SMALL, seed=-1)
    with pytest.raises(ValueError, match=r"^zipf_a: expected a number > 0, found 0.0$"):
        SyntheticConfig(zipf_a=0.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SyntheticConfig(num_images=8.0), "num_images: expected int, found float"),
        (lambda: SyntheticConfig(max_turns=True), "max_turns: expected int, found bool"),
        (
            lambda: SyntheticConfig(audio_probability="0.5"),
            "audio_probability: expected a number, found str",
        ),
        (lambda: SyntheticConfig(zipf_a=None), "zipf_a: expected a number, found NoneType"),
        (lambda: synthetic_trace(SMALL, seed=1.0), "seed: expected int, found float"),
    ],
)
def test_bad_synthetic_config_types_are_type_errors(
    make: Callable[[], object], message: str
) -> None:
    with pytest.raises(TypeError) as caught:
        make()
    assert (type(caught.value), str(caught.value)) == (TypeError, message)


# -- JSONL traces ---------------------------------------------------------------------


@pytest.fixture
def media(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(folder / "green.png")
    Image.new("L", (33, 64), 90).save(folder / "grey.png")
    write_wav(folder / "tone.wav", np.sin(np.arange(800) / 5.0) * 0.5, 16_000)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but then nothing")
    return tmp_path


def _write(folder: Path, lines: list[object]) -> Path:
    path = folder / "trace.jsonl"
    text = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path


def test_load_trace_builds_prompts_with_markers_conversations_and_defaults(media: Path) -> None:
    path = _write(
        media,
        [
            {"id": "q1", "tenant": "acme", "cache_salt": "s", "conversation": "c",
             "system": "Be brief.", "text": "Look <image> then <audio>.",
             "images": ["media/green.png"], "audio": [{"path": "media/tone.wav"}],
             "reply": "Done."},
            "",
            {"tenant": "acme", "cache_salt": "s", "conversation": "c", "text": "Again",
             "images": [str(media / "media" / "green.png"), "media/grey.png"]},
            {"text": "plain"},
        ],
    )  # fmt: skip
    trace = load_trace(path)
    assert trace.name == str(path)
    first, second, third = trace.requests
    assert (first.request_id, first.tenant, first.cache_salt, first.line_number) == (
        "q1", "acme", "s", 1,
    )  # fmt: skip
    green, tone = first.messages[1].parts[1], first.messages[1].parts[3]
    assert isinstance(green, ImageItem) and isinstance(tone, AudioItem)
    assert first.messages == (
        Message("system", ("Be brief.",)),
        Message("user", ("Look ", green, " then ", tone, ".")),
    )
    assert green.image.size == (40, 30)
    assert tone.sample_rate == 16_000 and tone.num_samples == 800
    # A later turn repeats the conversation and its reply; the same file is one item.
    assert second.request_id == "line-3"
    assert second.messages[:2] == first.messages
    assert second.messages[2] == Message("assistant", ("Done.",))
    grey = second.messages[3].parts[1]
    # Opened as the server opens it: the RGB picture the model sees.
    assert isinstance(grey, ImageItem) and grey.image.mode == "RGB"
    assert grey.image.tobytes() == Image.new("L", (33, 64), 90).convert("RGB").tobytes()
    assert second.messages[3] == Message("user", (green, grey, "Again"))
    assert (third.tenant, third.cache_salt, third.conversation) == ("default", None, None)
    assert third.messages == (Message("user", ("plain",)),)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"text": "x",', r"malformed JSON: Expecting property name"),
        ("[1, 2]", r"expected a JSON object, found array"),
        ({"text": "x", "imgs": []}, r"unknown field 'imgs'"),
        ({"tenant": "a"}, r"field 'text': required, found none"),
        ({"text": 3}, r"field 'text': expected a string, found number"),
        ({"text": "x", "tenant": 5}, r"field 'tenant': expected a string or null, found number"),
        ({"text": "x", "images": "a.png"}, r"field 'images': expected an array, found string"),
        ({"text": "x", "images": [7]}, r"images\[0\]: expected a path string"),
        ({"text": "x", "audio": [{"path": "a", "start": 1}]},
         r"audio\[0\]: expected only the key 'path'"),
        ({"text": "x", "images": ["media/missing.png"]},
         r"images\[0\]: cannot read image .*missing\.png: no such file$"),
        ({"text": "x", "images": ["media/green.png", "media/broken.png"]},
         r"images\[1\]: cannot read image .*broken\.png: expected an image in a format the "
         r"server accepts \(PNG, JPEG, WEBP, GIF and 33 more\), found none that Pillow "
         r"identifies \(another format, or a corrupt file\)$"),
        ({"text": "x", "audio": ["media/green.png"]},
         r"audio\[0\]: cannot read audio .*green\.png: cannot decode the audio: "
         r"Format not recognised\.$"),
        ({"text": "<image> <image>", "images": ["media/green.png"]},
         r"expected 1 <image> and 0 <audio> markers .* found 2 and 0"),
        ({"text": "x", "reply": "y"}, r"field 'reply': expected only with a 'conversation'"),
        ({"text": "x", "id": "first"}, r"field 'id': expected a new id, found 'first' again"),
        ({"text": "x", "conversation": "c", "tenant": "other"},
         r"conversation 'c': expected tenant 'default' .* found tenant 'other'"),
        ({"text": "x", "conversation": "c", "system": "s"},
         r"field 'system': expected only on the first turn"),
    ],
)  # fmt: skip
def test_bad_line_is_an_error_naming_the_file_and_line(
    media: Path, bad_line: object, message: str
) -> None:
    good = {"id": "first", "text": "hello <image>", "images": ["media/green.png"],
            "conversation": "c", "reply": "hi"}  # fmt: skip
    path = _write(media, [good, "", bad_line, {"text": "never reached"}])
    with pytest.raises(TraceError, match=message) as caught:
        load_trace(path)
    assert caught.value.line_number == 3
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}:3: ")


def test_missing_or_empty_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read the trace") as caught:
        load_trace(tmp_path / "absent.jsonl")
    assert caught.value.line_number == 0
    path = _write(tmp_path, ["", "   "])
    with pytest.raises(TraceError, match=r"expected at least one request, found none"):
        load_trace(path)
