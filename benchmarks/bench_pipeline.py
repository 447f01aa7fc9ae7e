"""A thinker -> talker pipeline on two live vLLM 0.32 engines: requests/s, talker first token.

The staged demo's pipeline (`omnicache.demo.staged`: the synthetic trace,
request by request, through the tiny Qwen2.5-Omni thinker and a tiny
talker that reads the thinker's rows at every position) with the thinker's
text model widened to ``--hidden`` (default 1024; 2 layers, float32), so
that a prefill costs what a real model's rows cost to move. Three pipelines
in one run: caching off in both stages; vLLM's own caching (it returns no
hidden states, so its thinker runs with caching off; its talker caches);
omnicache in both stages. Columns: requests per second over the trace
(median of ``--repeats`` passes, each on fresh engines), the median time
from a request's start to the talker's first token, each stage's hit rate,
the ratio to caching off, and whether every output of omnicache's pipeline
equals caching off's (thinker rows and talker prompt rows within 1e-5,
tokens equal). "of it, thinker" is the part of the time to the talker's
first token spent before the talker got the request: the thinker's whole
request (prefill and its tokens) and the hand-off. Each pipeline serves the
trace once untimed under other salts first (`run_staged_demo`'s
``warm_pass``): vLLM's CPU engine builds a oneDNN kernel for each new number
of rows, once a process, and without the warm pass the run that comes later
finds the kernels of the earlier ones built.

Run with the live engine's environment (``./dev live`` prepares ``.venv-live``):

    .venv-live/bin/python benchmarks/bench_pipeline.py [--hidden 1024] [--requests 40] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from omnicache.demo.live import LiveDemoConfig
from omnicache.demo.staged import RUN_NAMES, StagedReport, run_staged_demo
from omnicache.demo.workloads import SyntheticConfig, synthetic_trace


def _table(reports: list[StagedReport]) -> list[str]:
    first = reports[0]
    rps = [statistics.median(r.runs[i].requests_per_second for r in reports) for i in range(3)]
    ttft = [statistics.median(r.runs[i].median_talker_ttft for r in reports) for i in range(3)]
    before = [statistics.median(r.runs[i].median_before_talker for r in reports) for i in range(3)]
    mismatches = sum(r.num_mismatches for r in reports)
    stale = sum(r.num_stale_reads for r in reports)
    lines = [
        f"thinker: hidden {first.hidden_size}, 2 layers, float32, 8 tokens out, in process; "
        "talker: hidden 64, 16 tokens out, its own process",
        f"trace: {first.trace.name}, one request at a time; median of {len(reports)} pass(es)",
        "",
        f"{'':<16}{'requests/s':>11}{'talker 1st token':>18}{'of it, thinker':>16}"
        f"{'thinker hits':>14}{'talker hits':>13}{'vs off':>8}  outputs == off",
    ]
    for i, name in enumerate(RUN_NAMES):
        run = first.runs[i]
        same = "-" if i != 2 else ("yes" if mismatches == 0 and stale == 0 else "NO")
        lines.append(
            f"{name:<16}{rps[i]:>11.2f}{ttft[i] * 1000:>15.0f} ms{before[i] * 1000:>13.0f} ms"
            f"{run.thinker.hit_rate:>14.1%}"
            f"{run.talker.hit_rate:>13.1%}{rps[i] / rps[0]:>7.2f}x  {same}"
        )
    omni = first.runs[2]
    lines += [
        "",
        f"best possible hits: thinker {omni.thinker.best_hit_rate:.1%}, talker "
        f"{omni.talker.best_hit_rate:.1%}; mismatches {mismatches}, stale reads {stale}",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="the thinker's hidden size")
    parser.add_argument("--requests", type=int, default=40, help="requests in the trace")
    parser.add_argument("--repeats", type=int, default=1, help="passes (fresh engines each)")
    args = parser.parse_args()
    trace = synthetic_trace(SyntheticConfig(num_requests=args.requests), seed=0)
    reports = [
        run_staged_demo(trace, LiveDemoConfig(), hidden_size=args.hidden, warm_pass=True)
        for _ in range(args.repeats)
    ]
    print("\n".join(_table(reports)))


if __name__ == "__main__":
    main()
