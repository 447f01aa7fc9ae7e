"""The --plot figure: the data drawn from a sweep's reports, and how matplotlib draws it."""

from __future__ import annotations

import io

import pytest
from matplotlib.colors import to_hex
from PIL import Image

from omnicache.demo.oracle import RunReport
from omnicache.demo.plot import (
    HEIGHT_PX,
    WIDTH_PX,
    Panel,
    Series,
    SweepPlot,
    draw_sweep,
    sweep_plot,
    tick_labels,
)


def _report(num_blocks: int, hit: int, best: int, cached: float, reference: float) -> RunReport:
    return RunReport(
        num_blocks=num_blocks,
        block_size=16,
        block_algorithm="sha256",
        content_algorithm="blake3",
        num_prompt_tokens=400,
        num_hit_tokens=hit,
        num_best_hit_tokens=best,
        seconds_cached=cached,
        seconds_reference=reference,
    )


REPORTS = [
    _report(10, 100, 300, 2.0, 1.5),
    _report(30, 200, 300, 1.0, 1.25),
    _report(90, 300, 300, 0.5, 1.75),
]
PLOT = SweepPlot(
    "omnicache demo: t",
    (10, 30, 90),
    (
        Panel(
            "hit rate",
            "hit rate (%)",
            100.0,
            (
                Series("with this cache", "#1f77b4", (25.0, 50.0, 75.0)),
                Series("best possible (infinite cache)", "#999999", (75.0, 75.0, 75.0), True),
            ),
        ),
        Panel(
            "serving time",
            "time (s)",
            1.1 * 2.0,
            (
                Series("with cache", "#ff7f0e", (2.0, 1.0, 0.5)),
                Series("without cache", "#999999", (1.5, 1.25, 1.75), True),
            ),
        ),
    ),
)


def test_sweep_plot_holds_each_reports_values() -> None:
    assert sweep_plot(REPORTS, "omnicache demo: t") == PLOT


def test_sweep_plot_needs_a_report() -> None:
    with pytest.raises(ValueError, match=r"^reports: expected at least one, found none$"):
        sweep_plot([], "t")


def test_draw_sweep_puts_the_data_on_log_axes_with_titles_and_legends() -> None:
    figure = draw_sweep(PLOT)
    assert figure.get_suptitle() == "omnicache demo: t"
    assert len(figure.axes) == len(PLOT.panels) == 2
    for ax, panel in zip(figure.axes, PLOT.panels, strict=True):
        assert ax.get_title() == panel.title
        assert ax.get_xlabel() == "cache size (blocks, log scale)"
        assert ax.get_ylabel() == panel.y_label
        assert ax.get_xscale() == "log"
        assert ax.get_ylim() == (0.0, panel.y_max)
        assert list(ax.get_xticks()) == [10, 30, 90]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["10", "30", "90"]
        assert list(ax.get_xticks(minor=True)) == []
        drawn = [
            (
                line.get_label(),
                to_hex(line.get_color()),
                tuple(line.get_xdata()),
                tuple(line.get_ydata()),
                line.get_linestyle(),
            )
            for line in ax.get_lines()
        ]
        assert drawn == [
            (s.label, s.color, PLOT.sizes, s.values, "--" if s.reference else "-")
            for s in panel.series
        ]
        legend = ax.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == [s.label for s in panel.series]


def test_the_png_is_the_figures_size_and_shows_each_measured_series() -> None:
    buffer = io.BytesIO()
    draw_sweep(PLOT).savefig(buffer, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        assert (image.format, image.size) == ("PNG", (WIDTH_PX, HEIGHT_PX)) == ("PNG", (1000, 420))
        colors = {color for _, color in image.convert("RGB").getcolors(WIDTH_PX * HEIGHT_PX)}
    for measured in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x99, 0x99, 0x99)):
        assert measured in colors


@pytest.mark.parametrize(
    ("sizes", "labels"),
    [
        ([20, 27, 37, 49, 67, 90, 160], ["20", "27", "37", "49", "67", "90", "160"]),
        # --num-blocks 30 beside the sweep's 29: the second label drops a line.
        ([18, 23, 29, 30, 36, 46, 58], ["18", "23", "29", "\n30", "36", "46", "58"]),
        # Three within the gap: the third fits on neither line and stays unlabelled.
        ([100, 101, 102, 1000], ["100", "\n101", "", "1000"]),
        ([160], ["160"]),
    ],
)
def test_tick_labels_never_overprint(sizes: list[int], labels: list[str]) -> None:
    assert tick_labels(sizes) == labels
