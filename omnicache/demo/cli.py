"""The ``omnicache`` command: serve a multimodal workload through the cache, or hash media.

    omnicache demo [--quick] [--requests N] [--seed S]   the embedded synthetic trace
    omnicache demo --engine vllm [--requests N]          the same trace through a live vLLM engine
    omnicache demo --engine vllm --pipeline              ... through a thinker -> talker pipeline
    omnicache replay TRACE.jsonl                         a JSONL trace (omnicache.demo.workloads)
    omnicache hash FILE...                               content digests of media files

``demo`` and ``replay`` compute every request twice, from scratch and through
the prefix cache (`omnicache.demo.engine`), check that both give the same hidden
states and logits (``torch.allclose``, atol = rtol = 1e-5), and print a summary
table. Options: ``--block-size``, ``--num-blocks``, ``--algorithm`` (content
digests and block keys), ``--salt`` (mixed into every tenant's salt),
``--plot out.png`` (hit rate and time against cache size, from reruns at
several ``--num-blocks``; drawn with matplotlib, the ``plot`` extra),
``--progress`` (a tqdm progress bar even when stderr is not a terminal),
``--threads``, and ``--redis URL`` with ``--redis-namespace NS``: share
blocks with other engine processes through a Redis server
(`omnicache.tiers.redis`; a second run, or a run in another process, gets
hits for what the first one computed).

``hash`` and ``replay`` open image and audio files as vLLM's OpenAI server
opens an upload (`omnicache.media`: EXIF orientation, RGB over white, the
allowed formats and limits, float32 mono audio), so the digest ``hash``
prints for a file is the one omnicache's front end computes in the server
for the same file. ``--vllm SERIES`` picks the series whose rules apply
(default 0.32, the series of the front end), ``--max-image-pixels`` the
server's ``VLLM_MAX_IMAGE_PIXELS``.

``demo --engine vllm`` serves the synthetic trace through vLLM 0.32's live
CPU engine instead (`omnicache.demo.live`: caching off, vLLM's
own prefix caching, omnicache; ``--requests``, ``--seed`` and
``--num-blocks``, the KV cache's blocks, apply). vLLM is imported only then;
without its live engine one line says how to get it (exit status 2). With
``--pipeline``, through two engines, a thinker and a talker that reads the
thinker's hidden states at every position (`omnicache.demo.staged`,
`omnicache.pipeline`), prefix caching on in both.

Exit status:
    0  success: every request matched its recompute, no stale read
    1  a mismatch or a stale read (the table says which requests)
    2  usage error: a bad option or value (also a pool too small for a prompt,
       or --plot without matplotlib, or --engine vllm without vLLM's live
       engine: one line says what to install, and nothing is served)
    3  bad input: a malformed trace (the message names the line) or a file
       that cannot be opened as the server would (missing, unreadable,
       unknown, truncated, oversize, a decompression bomb); one line on
       stderr names the file and the reason
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from hashing import ALGORITHMS, Algorithm, ContentHash
from omnicache.demo.config import CacheConfig, ModelConfig
from omnicache.demo.engine import ServingEngine
from omnicache.demo.model import TinyOmniModel
from omnicache.demo.oracle import ATOL, RTOL, ProgressFn, RunReport, check_fits, run_cached
from omnicache.demo.processor import Processor
from omnicache.demo.workloads import SyntheticConfig, Trace, TraceError, load_trace, synthetic_trace
from omnicache.identity import item_identity
from omnicache.media import (
    AUDIO_EXTENSIONS,
    DEFAULT_SERIES,
    VLLM_RULES,
    MediaError,
    MediaRules,
    image_extensions,
)

if TYPE_CHECKING:
    from omnicache.tiers.redis import RedisTier

__all__ = ["main"]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3

ENGINES = ("embedded", "vllm")
# What --engine vllm takes besides --requests, --seed and --num-blocks: nothing
# else of the embedded engine's options.
_EMBEDDED_ONLY = ("quick", "block_size", "algorithm", "salt", "plot", "progress", "threads",
                  "redis", "redis_namespace")  # fmt: skip

QUICK_MODEL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, mlp_size=128)
QUICK_TRACE = SyntheticConfig(num_requests=24, num_images=8, num_audio_clips=3)

# Encoded media `hash` refuses, by extension, and why: their identity is what a
# server's own decoder makes of them, which is not reproduced here.
_NOT_IDENTIFIED = {
    **dict.fromkeys((".m4a", ".aac"), "libsndfile reads no AAC: the server decodes it with "
                    "another backend, whose samples are not reproduced here"),
    **dict.fromkeys((".mp4", ".webm", ".mkv", ".mov", ".avi"), "a video's identity covers "
                    "the frames and metadata the server's video loader makes of it (its "
                    "backend, num_frames and fps settings): pass those to multi_modal_uuids"),
}  # fmt: skip

# What --plot needs, and how to get it.
_PLOT_EXTRA = "--plot needs matplotlib, which is not installed: pip install 'omnicache-mm[plot]'"

# Saves a sweep's figure: (path, a report per cache size, title).
PlotWriter = Callable[[Path, Sequence[RunReport], str], None]


class _UsageError(Exception):
    """A bad option or value: exit status 2, after the usage unless ``show_usage`` is False."""

    def __init__(self, message: str, *, show_usage: bool = True) -> None:
        super().__init__(message)
        self.show_usage = show_usage


@contextmanager
def _progress_bar(label: str, total: int, enabled: bool) -> Iterator[ProgressFn]:
    """A tqdm bar on stderr (nothing when not ``enabled``), moved by `run_cached`'s calls."""
    with tqdm(total=total, desc=label, unit="request", file=sys.stderr, disable=not enabled) as bar:

        def progress(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        yield progress


def _show_progress(args: argparse.Namespace) -> bool:
    """Progress bars on stderr: asked for with --progress, or stderr is a terminal."""
    return bool(args.progress or sys.stderr.isatty())


# -- demo and replay ------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected int >= {minimum}, found {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected int >= {minimum}, found {value}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    parser.add_argument(
        "--num-blocks", type=_positive_int, default=CacheConfig().num_blocks,
        help="blocks in the pool (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--algorithm", choices=ALGORITHMS, default=None,
        help="hash algorithm for content digests and block keys "
        "(default: blake3 for content, sha256 for block keys)",
    )  # fmt: skip
    parser.add_argument("--salt", default="", help="deployment salt mixed into every tenant's salt")
    parser.add_argument(
        "--plot", type=Path, metavar="PNG",
        help="also rerun at several cache sizes and draw hit rate and time against them",
    )  # fmt: skip
    parser.add_argument(
        "--progress", action="store_true", help="show a progress bar even if stderr is no terminal"
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=1,
        help="torch threads (default 1: comparable timings on a shared machine)",
    )  # fmt: skip
    parser.add_argument(
        "--redis", metavar="URL",
        help="share blocks with other engines through the Redis server at URL "
        "(redis://host:port/db); a miss on a server that is down is only a miss",
    )  # fmt: skip
    parser.add_argument(
        "--redis-namespace", default="omnicache-demo", metavar="NS",
        help="key namespace on the Redis server: engines share blocks within one "
        "(default %(default)s)",
    )  # fmt: skip


def _add_media_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm", choices=sorted(VLLM_RULES), default=DEFAULT_SERIES, metavar="SERIES",
        help="open files as this vLLM series' OpenAI server opens uploads "
        f"({', '.join(sorted(VLLM_RULES))}; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-image-pixels", type=_positive_int, default=None, metavar="N",
        help="the server's VLLM_MAX_IMAGE_PIXELS "
        f"(default {VLLM_RULES[DEFAULT_SERIES].max_image_pixels:,})",
    )  # fmt: skip


def _media_rules(args: argparse.Namespace) -> MediaRules:
    rules = VLLM_RULES[args.vllm]
    if args.max_image_pixels is not None:
        rules = replace(rules, max_image_pixels=args.max_image_pixels)
    return rules


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnicache",
        description="Content-hash keyed prefix cache for multimodal serving: demo, replay, hash.",
        epilog="exit status: 0 ok, 1 mismatch or stale read, 2 usage error, 3 bad input",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="serve the embedded synthetic trace through a small transformer"
    )
    demo.add_argument("--requests", type=_positive_int, help="requests in the synthetic trace")
    demo.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="seed of the synthetic trace"
    )
    demo.add_argument(
        "--quick", action="store_true", help="a small trace and model (a few seconds)"
    )
    demo.add_argument(
        "--engine", choices=ENGINES, default="embedded",
        help="embedded: the small transformer here (default); vllm: a live vLLM 0.32 CPU "
        "engine serving a tiny Qwen2.5-Omni thinker, against vLLM's own prefix caching",
    )  # fmt: skip
    demo.add_argument(
        "--pipeline", action="store_true",
        help="with --engine vllm: a thinker -> talker pipeline, the talker reading the "
        "thinker's hidden states (two engines, prefix caching on in both)",
    )  # fmt: skip
    _add_serve_options(demo)
    replay = commands.add_parser(
        "replay", help="serve a JSONL trace (see omnicache.demo.workloads)"
    )
    replay.add_argument("trace", type=Path, metavar="TRACE.jsonl")
    replay.add_argument("--quick", action="store_true", help="use the small model")
    _add_serve_options(replay)
    _add_media_options(replay)
    hasher = commands.add_parser(
        "hash", help="print the identities a vLLM server gives image and audio files"
    )
    hasher.add_argument("files", type=Path, nargs="+", metavar="FILE")
    hasher.add_argument("--algorithm", choices=ALGORITHMS, default="blake3")
    _add_media_options(hasher)
    return parser


def _fmt_int(value: int) -> str:
    return f"{value:,}"


def _count(value: int, noun: str) -> str:
    return f"{value:,} {noun}{'' if value == 1 else 's'}"


def _summary(
    trace: Trace, model: TinyOmniModel, report: RunReport, threads: int, salt: str
) -> list[str]:
    cfg = model.config
    num_images, distinct_images, num_clips, distinct_clips = trace.count_media()
    rows = [
        ("requests", _fmt_int(report.num_requests), _count(report.num_tenants, "tenant salt")),
        ("prompt tokens", _fmt_int(report.num_prompt_tokens), ""),
        (
            "hit tokens",
            _fmt_int(report.num_hit_tokens),
            f"hit rate {report.hit_rate:.1%}",
        ),
        (
            "best possible hit rate",
            f"{report.best_hit_rate:.1%}",
            f"an infinite local cache on this trace "
            f"({_fmt_int(report.num_best_hit_tokens)} tokens)",
        ),
        (
            "recompute saved",
            f"{report.flops_saved:.1%}",
            f"of model FLOPs (est.); {report.num_items_encoded} of {report.num_items} "
            "item encodings run",
        ),
        ("time without cache", f"{report.seconds_reference:.2f} s", "full recompute per request"),
        ("time with cache", f"{report.seconds_cached:.2f} s", "hashing and store included"),
        ("speedup", f"{report.speedup:.2f}x", ""),
        ("evictions", _fmt_int(report.num_evictions), ""),
        ("stale reads", _fmt_int(report.num_stale_reads), "must be 0"),
        ("mismatches", _fmt_int(report.num_mismatches), "must be 0"),
    ]
    salt_note = ", with a deployment salt" if salt else ""
    lines = [
        f"trace: {trace.name}: {_count(report.num_requests, 'request')}, "
        f"{_count(len(trace.tenants), 'tenant')}, {_count(num_images, 'image')} in prompts "
        f"({distinct_images} distinct), {_count(num_clips, 'audio clip')} ({distinct_clips} "
        "distinct)",
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
        f"MLP {cfg.mlp_size}, float32 on CPU, {threads} thread{'s' if threads > 1 else ''}",
        f"cache: {report.num_blocks} blocks x {report.block_size} tokens, block keys "
        f"{report.block_algorithm}, content digests {report.content_algorithm}{salt_note}",
        "",
    ]
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    for name, value, note in rows:
        line = f"  {name:<{width}}  {value:>{value_width}}"
        lines.append(f"{line}   {note}" if note else line)
    lines.append("")
    lines.append(
        f"oracle: torch.allclose(atol={ATOL:g}, rtol={RTOL:g}) against a full recompute, over "
        "the hidden states of"
    )
    lines.append(
        "        every prompt token and the next-token logits; "
        f"max |diff| {report.max_abs_diff:.1e}"
    )
    return lines


def _redis_tier(args: argparse.Namespace) -> RedisTier:
    try:
        from omnicache.tiers.redis import RedisTier
    except ImportError as exc:
        raise _UsageError(f"--redis: {exc}") from None
    try:
        return RedisTier.from_url(args.redis, namespace=args.redis_namespace)
    except ValueError as exc:
        raise _UsageError(f"--redis: {exc}") from None


def _tier_summary(args: argparse.Namespace, tier: RedisTier, report: RunReport) -> list[str]:
    stats = tier.stats
    lost = stats.num_write_errors + stats.num_dropped_values + stats.num_oversize_values
    return [
        "",
        f"redis tier {args.redis} (namespace {args.redis_namespace}):",
        f"  hit tokens from the tier {_fmt_int(report.num_tier_hit_tokens)}",
        f"  blocks found {_fmt_int(stats.num_hit_blocks)} of {_fmt_int(stats.num_get_blocks)} "
        f"asked; values written {_fmt_int(stats.num_written_values)}, lost {_fmt_int(lost)}",
        f"  values rejected {_fmt_int(stats.num_rejected_values)}, faults "
        f"{_fmt_int(stats.num_faults)} (read errors {_fmt_int(stats.num_read_errors)}, "
        f"reconnects {_fmt_int(stats.num_reconnects)})",
    ]


def _sweep_sizes(longest: int, block_size: int, num_distinct: int, chosen: int) -> list[int]:
    """Cache sizes for the plot: from the smallest pool that admits every prompt to no eviction."""
    smallest = -(-longest // block_size)
    largest = max(smallest + 1, smallest + num_distinct)
    sizes = {chosen}
    for i in range(6):
        sizes.add(round(smallest * (largest / smallest) ** (i / 5)))
    return sorted(sizes)


def _plot_writer(path: Path) -> PlotWriter:
    """`omnicache.demo.plot.write_sweep_png`, checked before anything is served.

    Raises:
        _UsageError: matplotlib is not installed (one line, no usage), or
            ``path``'s folder does not exist.
    """
    try:
        from omnicache.demo.plot import write_sweep_png
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "matplotlib":
            raise
        raise _UsageError(_PLOT_EXTRA, show_usage=False) from None
    if not path.parent.is_dir():
        raise _UsageError(f"--plot: expected a file in an existing folder, found {path}")
    return write_sweep_png


def _sweep(
    args: argparse.Namespace,
    model: TinyOmniModel,
    processor: Processor,
    trace: Trace,
    cache_config: CacheConfig,
    report: RunReport,
    longest: int,
) -> list[RunReport]:
    """Reruns the trace at several cache sizes and prints a row per size.

    Returns:
        A report per size, smallest first; ``report`` stands for ``args.num_blocks``.
    """
    sizes = _sweep_sizes(longest, args.block_size, report.num_distinct_blocks, args.num_blocks)
    print()
    print("cache size sweep (--plot):")
    print(f"  {'blocks':>7}  {'hit rate':>8}  {'best':>6}  {'without':>9}  {'with cache':>10}  "
          f"{'speedup':>7}  {'evictions':>9}  {'mismatches':>10}")  # fmt: skip
    if args.redis is not None:
        print("  (without the Redis tier: each size is served by its local cache alone)")
    sweep: list[RunReport] = []
    for size in sizes:
        if size == args.num_blocks:
            result = report
        else:
            # NOTE: fresh references, each computed next to its cached run:
            # on a shared machine only paired timings are comparable.
            with _progress_bar(f"{size} blocks", trace.num_requests, _show_progress(args)) as bar:
                result = run_cached(
                    model, processor, trace, replace(cache_config, num_blocks=size), [], bar
                )
        sweep.append(result)
        print(f"  {size:>7}  {result.hit_rate:>8.1%}  {result.best_hit_rate:>6.1%}  "
              f"{result.seconds_reference:>7.2f} s  {result.seconds_cached:>8.2f} s  "
              f"{result.speedup:>6.2f}x  "
              f"{result.num_evictions:>9}  {result.num_mismatches:>10}")  # fmt: skip
    return sweep


def _serve(
    args: argparse.Namespace,
    trace: Trace,
    model_config: ModelConfig,
    write_plot: PlotWriter | None,
) -> int:
    torch.set_num_threads(args.threads)
    algorithm: Algorithm | None = args.algorithm
    model = TinyOmniModel(model_config)
    processor = Processor(model_config, algorithm=algorithm or "blake3")
    cache_config = CacheConfig(
        num_blocks=args.num_blocks, block_size=args.block_size, algorithm=algorithm, salt=args.salt
    )
    try:
        longest = check_fits(model, processor, trace, cache_config)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    tier = _redis_tier(args) if args.redis is not None else None
    # Warm-up (not counted): first calls pay for lazy imports and allocator growth.
    first = Trace(trace.name, trace.requests[:1])
    run_cached(model, Processor(model_config), first, cache_config, [])
    engine = None if tier is None else ServingEngine(model, processor, cache_config, tier=tier)
    try:
        with _progress_bar("serving", trace.num_requests, _show_progress(args)) as progress:
            report = run_cached(model, processor, trace, cache_config, [], progress, engine=engine)
    finally:
        if tier is not None:
            # NOTE: the writes are behind: another engine sees them once flushed.
            tier.close()
    print(f"omnicache {args.command}")
    for line in _summary(trace, model, report, args.threads, args.salt):
        print(line)
    if tier is not None:
        for line in _tier_summary(args, tier, report):
            print(line)
    reports = [report]
    if write_plot is not None:
        sweep = _sweep(args, model, processor, trace, cache_config, report, longest)
        reports += [r for r in sweep if r is not report]
        write_plot(args.plot, sweep, f"omnicache {args.command}: {trace.name}")
        print(f"plot written to {args.plot}")
    failed = [r for r in reports if not r.ok]
    if failed:
        for r in failed:
            shown = ", ".join(r.mismatched_requests[:5])
            more = " ..." if len(r.mismatched_requests) > 5 else ""
            print(
                f"omnicache: FAILED at {r.num_blocks} blocks: {r.num_mismatches} mismatches "
                f"({shown}{more}), {r.num_stale_reads} stale reads",
                file=sys.stderr,
            )
        return EXIT_MISMATCH
    print()
    print("ok: every request matched its full recompute; no stale read")
    return EXIT_OK


def _serve_live(args: argparse.Namespace, defaults: argparse.Namespace) -> int:
    """``demo --engine vllm``: the synthetic trace through a live vLLM engine."""
    for name in _EMBEDDED_ONLY:
        if getattr(args, name) != getattr(defaults, name):
            option = "--" + name.replace("_", "-")
            raise _UsageError(
                f"{option}: expected only with --engine embedded, found --engine vllm"
            )
    from omnicache.demo.live import LiveDemoConfig, run_live_demo, summary_lines
    from omnicache.demo.staged import run_staged_demo, staged_summary_lines

    try:
        config = LiveDemoConfig(num_blocks=args.num_blocks)
    except ValueError as exc:
        raise _UsageError(f"--engine vllm: {exc}") from None
    cfg = SyntheticConfig()
    if args.requests is not None:
        cfg = replace(cfg, num_requests=args.requests)
    trace = synthetic_trace(cfg, seed=args.seed)

    def log(line: str) -> None:
        print(f"omnicache: {line}", file=sys.stderr)

    try:
        if args.pipeline:
            staged = run_staged_demo(trace, config, log=log)
        else:
            report = run_live_demo(trace, config, log=log)
    except ImportError as exc:
        raise _UsageError(f"--engine vllm: {exc}", show_usage=False) from None
    if args.pipeline:
        print(f"omnicache {args.command} --engine vllm --pipeline")
        for line in staged_summary_lines(staged):
            print(line)
        return _verdict(staged.ok, staged.num_mismatches, staged.mismatched_requests,
                        staged.num_stale_reads, "every request's thinker rows, talker prompt "
                        "hidden states and tokens matched caching off's")  # fmt: skip
    print(f"omnicache {args.command} --engine vllm")
    for line in summary_lines(report):
        print(line)
    return _verdict(report.ok, report.num_mismatches, report.mismatched_requests,
                    report.num_stale_reads, "every request's prompt hidden states matched "
                    "caching off's")  # fmt: skip


def _verdict(ok: bool, num_mismatches: int, mismatched: list[str], num_stale: int,
             what: str) -> int:  # fmt: skip
    """The last lines of a live demo, and its exit status."""
    if not ok:
        shown = ", ".join(mismatched[:5])
        more = " ..." if len(mismatched) > 5 else ""
        print(
            f"omnicache: FAILED: {num_mismatches} mismatches ({shown}{more}), "
            f"{num_stale} stale reads",
            file=sys.stderr,
        )
        return EXIT_MISMATCH
    print()
    print(f"ok: {what}; no stale read")
    return EXIT_OK


# -- hash ------------------------------------------------------------------------


def _hash_file(path: Path, algorithm: Algorithm, rules: MediaRules) -> tuple[ContentHash, str]:
    """The file's identity (`omnicache.identity.item_identity`) and its modality.

    Raises:
        MediaError: The file cannot be opened as the server would open it,
            or is of a kind whose identity cannot be computed here.
    """
    suffix = path.suffix.lower()
    if suffix in image_extensions():
        modality = "image"
    elif suffix in AUDIO_EXTENSIONS:
        modality = "audio"
    elif suffix in _NOT_IDENTIFIED:
        raise MediaError(path, f"not identified here: {_NOT_IDENTIFIED[suffix]}")
    else:
        raise MediaError(
            path,
            f"unknown file type {suffix or '(no extension)'!r}: expected an image "
            f"({', '.join(sorted(image_extensions())[:6])}, ...) or audio "
            f"({', '.join(sorted(AUDIO_EXTENSIONS)[:6])}, ...)",
        )
    return item_identity(path, modality=modality, algorithm=algorithm, rules=rules), modality


def _hash(args: argparse.Namespace) -> int:
    rules = _media_rules(args)
    status = EXIT_OK
    for path in args.files:
        try:
            digest, kind = _hash_file(path, args.algorithm, rules)
        except MediaError as exc:
            print(f"omnicache hash: {exc}", file=sys.stderr)
            status = EXIT_BAD_INPUT
            continue
        print(f"{digest.hex()}  {kind:<11}  {path}")
    return status


# -- entry point ------------------------------------------------------------------


def _warnings_to_stderr() -> None:
    """Shows the library's warnings (a Redis tier that is down, ...) on stderr.

    Only when the process configured no logging of its own.
    """
    log = logging.getLogger("omnicache")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("omnicache: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (see the module docstring)."""
    _warnings_to_stderr()
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "hash":
            return _hash(args)
        if args.command == "demo" and args.engine == "vllm":
            return _serve_live(args, parser.parse_args(["demo"]))
        if args.command == "demo" and args.pipeline:
            raise _UsageError("--pipeline: expected with --engine vllm, found --engine embedded")
        write_plot = None if args.plot is None else _plot_writer(args.plot)
        if args.command == "demo":
            cfg = QUICK_TRACE if args.quick else SyntheticConfig()
            if args.requests is not None:
                cfg = replace(cfg, num_requests=args.requests)
            trace = synthetic_trace(cfg, seed=args.seed)
        else:
            trace = load_trace(args.trace, rules=_media_rules(args))
        return _serve(args, trace, QUICK_MODEL if args.quick else ModelConfig(), write_plot)
    except _UsageError as exc:
        if exc.show_usage:
            parser.print_usage(sys.stderr)
        print(f"omnicache: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TraceError as exc:
        print(f"omnicache: bad trace: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
