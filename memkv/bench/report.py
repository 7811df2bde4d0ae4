"""Results of the benchmark suites: JSON per suite, a PNG plot per suite, BENCHMARKS.md.

Every suite returns one :class:`SuiteResult`: a table (what BENCHMARKS.md shows),
the raw figures (what the JSON keeps) and the series to plot. Nothing here
measures; it only records what a suite measured in the same run.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memkv.errors import InvalidInputError

__all__ = [
    "SCHEMA",
    "PlotKind",
    "PlotSpec",
    "SuiteResult",
    "console",
    "format_cell",
    "load_results",
    "percentile",
    "plot_result",
    "print_result",
    "render_markdown",
    "track",
    "write_markdown",
    "write_result",
]

#: Marks a JSON file as written by ``memkv bench`` (older scripts wrote other shapes
#: to the same folder; BENCHMARKS.md is generated from these files only).
SCHEMA = "memkv-bench/1"

#: Progress bars and tables go to stderr, so stdout stays the measured figures.
console = Console(stderr=True)

_T = TypeVar("_T")

# Significant digits of figures in tables: enough to compare, not to pretend.
_SIG_DIGITS = 3
_PLOT_DPI = 110
_PIPE_WIDTH = 200
_PLOT_SIZE_IN = (7.0, 4.2)


class PlotKind(StrEnum):
    """How a suite's series are drawn."""

    LINE = "line"  # y against a numeric x (capacity, concurrency, tokens)
    BAR = "bar"  # one bar per x label and series


@dataclass(frozen=True, slots=True)
class PlotSpec:
    """The series of a suite's plot.

    Attributes:
        kind: line or grouped bars.
        x_label: the x axis' title.
        y_label: the y axis' title.
        x: the x values (numbers for lines, labels for bars).
        series: series name -> one y per x (None where not measured).
        log_y: a logarithmic y axis (figures spanning decades).
    """

    kind: PlotKind
    x_label: str
    y_label: str
    x: list[Any]
    series: dict[str, list[float | None]]
    log_y: bool = False


@dataclass(slots=True)
class SuiteResult:
    """What one suite measured.

    Attributes:
        suite: the suite's name (the JSON and PNG file stem).
        title: one line for BENCHMARKS.md.
        columns: the table's headers.
        rows: the table, one list of cells per row.
        figures: every raw measurement (JSON-serialisable), for the JSON file.
        notes: sentences printed under the table (where time goes, skips, caveats).
        plot: the series to plot, or None.
        quick: measured with ``--quick`` sizes.
    """

    suite: str
    title: str
    columns: list[str]
    rows: list[list[Any]]
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plot: PlotSpec | None = None
    quick: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON document of this result, with when and where it was measured."""
        doc = asdict(self)
        doc["schema"] = SCHEMA
        doc["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
        doc["platform"] = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "node": platform.node(),
        }
        return doc


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``samples``, nearest-rank.

    Raises:
        InvalidInputError: no samples, or ``q`` outside 0..100.
    """
    if not samples:
        raise InvalidInputError("percentile of no samples; expected at least one")
    if not 0 <= q <= 100:
        raise InvalidInputError(f"percentile q must be in 0..100, got {q}")
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def format_cell(value: Any) -> str:
    """A table cell: floats to three significant digits, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        if abs(value) >= 10**_SIG_DIGITS:
            return f"{value:,.0f}"
        return f"{value:.{_SIG_DIGITS}g}"
    return str(value)


def track(items: Iterable[_T], description: str, total: int | None = None) -> Iterator[_T]:
    """Iterate ``items`` under a rich progress bar on stderr (vanishes when done)."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        yield from progress.track(items, total=total, description=description)


def write_result(result: SuiteResult, out: Path) -> Path:
    """Write ``<out>/<suite>.json``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.suite}.json"
    path.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
    return path


def plot_result(result: SuiteResult, out: Path) -> Path | None:
    """Draw ``<out>/<suite>.png`` from the result's plot spec (None when it has none)."""
    spec = result.plot
    if spec is None:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=_PLOT_SIZE_IN)
    try:
        if spec.kind is PlotKind.LINE:
            for name, ys in spec.series.items():
                pts = [(x, y) for x, y in zip(spec.x, ys, strict=True) if y is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        else:
            n = max(1, len(spec.series))
            width = 0.8 / n
            for i, (name, ys) in enumerate(spec.series.items()):
                xs = [j + (i - (n - 1) / 2) * width for j in range(len(spec.x))]
                ax.bar(xs, [y if y is not None else 0.0 for y in ys], width, label=name)
            ax.set_xticks(range(len(spec.x)))
            ax.set_xticklabels([str(x) for x in spec.x], rotation=20, ha="right", fontsize=8)
        if spec.log_y:
            ax.set_yscale("log")
        ax.set_xlabel(spec.x_label)
        ax.set_ylabel(spec.y_label)
        ax.set_title(result.title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{result.suite}.png"
        fig.savefig(path, dpi=_PLOT_DPI)
    finally:
        plt.close(fig)
    return path


def load_results(out: Path) -> list[dict[str, Any]]:
    """Every ``memkv bench`` result JSON in ``out``, by suite name (other JSONs skipped)."""
    docs: list[dict[str, Any]] = []
    for path in sorted(out.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # not ours or half-written: BENCHMARKS.md shows only complete results
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            docs.append(doc)
    return docs


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    # A "|" inside a cell (e.g. "|err| <= ...") would split it: escape it.
    lines += [
        "| " + " | ".join(format_cell(c).replace("|", "\\|") for c in row) + " |" for row in rows
    ]
    return lines


def render_markdown(docs: Sequence[dict[str, Any]], order: Sequence[str] = ()) -> str:
    """BENCHMARKS.md from result documents, suites in ``order`` first."""
    rank = {name: i for i, name in enumerate(order)}
    docs = sorted(docs, key=lambda d: (rank.get(d["suite"], len(rank)), d["suite"]))
    lines = [
        "# memkv benchmarks",
        "",
        "Generated by `memkv bench` from the JSON files next to the plots; every figure was",
        "measured in the run that wrote it, on the machine named under each table. Targets",
        "and anchors: see TARGETS.md in the design notes. Ratios are measured side by side,",
        "since absolute times on shared machines drift.",
        "",
    ]
    if docs:
        from memkv.bench.claims import claims_table

        lines += claims_table(docs)
    for doc in docs:
        quick = " (quick sizes)" if doc.get("quick") else ""
        lines += [f"## {doc['suite']}: {doc['title']}{quick}", ""]
        lines += _table(doc["columns"], doc["rows"])
        lines.append("")
        for note in doc.get("notes", []):
            lines.append(f"- {note}")
        plat = doc.get("platform", {})
        lines += [
            "",
            f"Measured {doc.get('measured_at', '?')} on {plat.get('node', '?')} "
            f"({plat.get('machine', '?')}, Python {plat.get('python', '?')}); "
            f"plot: `{doc['suite']}.png`.",
            "",
        ]
    return "\n".join(lines)


def write_markdown(out: Path, path: Path, order: Sequence[str] = ()) -> Path:
    """Regenerate ``path`` (BENCHMARKS.md) from every result JSON in ``out``."""
    text = render_markdown(load_results(out), order)
    if out.resolve().parent != path.resolve().parent:
        # Point readers at the plots when the page lives elsewhere than the results.
        text = text.replace("plot: `", f"plot: `{out.as_posix()}/")
    path.write_text(text)
    return path


def print_result(result: SuiteResult) -> None:
    """Print the suite's table and notes on stdout."""
    from rich.table import Table

    table = Table(title=f"{result.suite}: {result.title}", title_justify="left")
    for col in result.columns:
        table.add_column(col, justify="right")
    for row in result.rows:
        table.add_row(*(format_cell(c) for c in row))
    # Wide enough for a suite's columns when stdout is a file or a pipe.
    out = Console(width=None if Console().is_terminal else _PIPE_WIDTH)
    out.print(table)
    for note in result.notes:
        out.print(f"  - {note}", highlight=False)
