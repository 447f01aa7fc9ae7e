"""The ``--plot`` figure: hit rate and serving time against cache size, drawn with matplotlib.

`sweep_plot` turns the reports of one cache-size sweep into the figure's
data (pure, no matplotlib call); `draw_sweep` draws it on the Agg backend
(no display needed) and `write_sweep_png` saves it. Two panels share a log
x axis of cache sizes, ticked at each size run: the hit rate (%) with this
cache beside the best any cache reaches on the trace, and the serving time
with and without the cache.

matplotlib is an optional extra (``pip install 'omnicache-mm[plot]'``):
importing this module without it raises `ModuleNotFoundError`, which the
command line turns into a usage error before it serves anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from omnicache.demo.oracle import RunReport

__all__ = ["write_sweep_png"]

WIDTH_PX = 1000
HEIGHT_PX = 420
_DPI = 100
_X_LABEL = "cache size (blocks, log scale)"
# Tick labels closer than this share of the x axis would overprint.
_CROWDED = 0.05


class Series(NamedTuple):
    """One line of a panel: a value per cache size."""

    label: str
    color: str
    values: tuple[float, ...]
    # A bound to compare against: drawn dashed, beneath the measured lines.
    reference: bool = False


class Panel(NamedTuple):
    """One panel: its series over ``[0, y_max]``."""

    title: str
    y_label: str
    y_max: float
    series: tuple[Series, ...]


class SweepPlot(NamedTuple):
    """The figure's data: cache sizes across, a panel per measure."""

    title: str
    sizes: tuple[int, ...]
    panels: tuple[Panel, ...]


def sweep_plot(reports: Sequence[RunReport], title: str) -> SweepPlot:
    """The figure of a sweep: one report per cache size, in the order drawn.

    Hit rates are in percent, on a fixed 0 to 100 scale; times are in
    seconds, up to 1.1 times the slowest run.
    """
    if not reports:
        raise ValueError("reports: expected at least one, found none")
    max_seconds = max(max(r.seconds_cached, r.seconds_reference) for r in reports)
    hit_rate = Panel(
        "hit rate",
        "hit rate (%)",
        100.0,
        (
            Series("with this cache", "#1f77b4", tuple(100 * r.hit_rate for r in reports)),
            Series(
                "best possible (infinite cache)",
                "#999999",
                tuple(100 * r.best_hit_rate for r in reports),
                reference=True,
            ),
        ),
    )
    serving_time = Panel(
        "serving time",
        "time (s)",
        1.1 * max_seconds,
        (
            Series("with cache", "#ff7f0e", tuple(r.seconds_cached for r in reports)),
            Series(
                "without cache",
                "#999999",
                tuple(r.seconds_reference for r in reports),
                reference=True,
            ),
        ),
    )
    return SweepPlot(title, tuple(r.num_blocks for r in reports), (hit_rate, serving_time))


def tick_labels(sizes: Sequence[int]) -> list[str]:
    """A label per size (ascending) on two lines, so that close sizes never overprint.

    On a log axis the user's ``--num-blocks`` can sit right next to a size of
    the sweep (29 and 30). A label goes on the first line when it is far
    enough from the last label there, else on the second line; when it fits
    on neither, its tick stays unlabelled.
    """
    gap = _CROWDED * math.log(sizes[-1] / sizes[0]) if len(sizes) > 1 else 0.0
    last: list[float | None] = [None, None]
    labels: list[str] = []
    for size in sizes:
        x = math.log(size)
        line = next((i for i, at in enumerate(last) if at is None or x - at >= gap), None)
        if line is None:
            labels.append("")
            continue
        last[line] = x
        labels.append("\n" * line + str(size))
    return labels


def draw_sweep(plot: SweepPlot) -> Figure:
    """The figure, ``WIDTH_PX`` x ``HEIGHT_PX`` pixels, on an Agg canvas."""
    figure = Figure(figsize=(WIDTH_PX / _DPI, HEIGHT_PX / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(plot.title)
    axes = figure.subplots(1, len(plot.panels), squeeze=False)[0]
    labels = tick_labels(plot.sizes)
    for ax, panel in zip(axes, plot.panels, strict=True):
        for series in panel.series:
            ax.plot(
                plot.sizes, series.values, color=series.color, marker="o", linewidth=2,
                linestyle="--" if series.reference else "-", zorder=2 if series.reference else 3,
                label=series.label,
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(plot.sizes, labels=labels)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(0.0, panel.y_max or 1.0)
        ax.set_title(panel.title)
        ax.set_xlabel(_X_LABEL)
        ax.set_ylabel(panel.y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    return figure


def write_sweep_png(path: Path, reports: Sequence[RunReport], title: str) -> None:
    """Draws the sweep's figure and saves it to ``path`` as a PNG."""
    draw_sweep(sweep_plot(reports, title)).savefig(path, format="png")
