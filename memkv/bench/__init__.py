"""``memkv bench``: the figures memkv is judged by, side by side with the alternatives.

Usage::

    memkv bench [all|resume|dataplane|codecs|eviction|scale] [--quick] [--trace PATH]
                [--model PATH] [--out benchmarks/results] [--markdown BENCHMARKS.md]

Each suite writes ``<out>/<suite>.json`` and ``<out>/<suite>.png``; then
BENCHMARKS.md is regenerated from every result JSON in ``<out>``. Every figure
printed is measured in that run.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from memkv.bench.context import DEFAULT_OUT, BenchContext
from memkv.bench.report import (
    SuiteResult,
    console,
    plot_result,
    print_result,
    write_markdown,
    write_result,
)
from memkv.errors import MemkvError

__all__ = ["SUITES", "BenchContext", "SuiteResult", "main", "run_suite"]

#: Suite name -> module under memkv.bench with ``run(ctx) -> SuiteResult``; the
#: order is the order of ``all`` and of BENCHMARKS.md.
SUITES: dict[str, str] = {
    "resume": "memkv.bench.resume",
    "dataplane": "memkv.bench.dataplane",
    "codecs": "memkv.bench.codecs",
    "eviction": "memkv.bench.eviction",
    "scale": "memkv.bench.scale",
}
ALL = "all"
DEFAULT_MARKDOWN = Path("BENCHMARKS.md")


def _runner(suite: str) -> Callable[[BenchContext], SuiteResult]:
    module = importlib.import_module(SUITES[suite])
    run: Callable[[BenchContext], SuiteResult] = module.run
    return run


def run_suite(suite: str, ctx: BenchContext) -> SuiteResult:
    """Run one suite and write its JSON and PNG under ``ctx.out``.

    Raises:
        KeyError: no suite of that name (the CLI checks names first).
    """
    result = _runner(suite)(ctx)
    write_result(result, ctx.out)
    plot_result(result, ctx.out)
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memkv bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", default=ALL, choices=[ALL, *SUITES],
                        help="which suite to run (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: each suite runs in seconds")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake-format JSONL trace for the eviction suite")
    parser.add_argument("--model", type=Path, default=None,
                        help="local HF causal LM directory for the resume suite")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--markdown", type=Path, default=None,
                        help=f"the generated table (default {DEFAULT_MARKDOWN} for the default "
                        "--out, else BENCHMARKS.md inside --out)")
    return parser


def main(argv: Sequence[str] | None = None, *, ctx: BenchContext | None = None) -> int:
    """Run the suites named in ``argv``; returns the exit status (0 = all ran).

    Args:
        argv: command-line arguments after ``memkv bench``.
        ctx: a context carrying an existing cluster/gateway (tests); its sizes
            and paths are replaced by the arguments.

    Returns:
        0 when every suite ran, 1 when one failed (the others still run).
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    if args.trace is not None and not args.trace.is_file():
        console.print(f"[red]--trace {args.trace}: expected a JSONL file, found none[/red]")
        return 2
    suites = list(SUITES) if args.suite == ALL else [args.suite]
    owned = ctx is None
    context = ctx if ctx is not None else BenchContext()
    context.quick, context.trace, context.model, context.out = (
        args.quick, args.trace, args.model, args.out
    )
    status = 0
    try:
        for suite in suites:
            start = time.perf_counter()
            console.print(f"[bold]memkv bench {suite}[/bold]{' (quick)' if args.quick else ''}")
            try:
                result = run_suite(suite, context)
            except (MemkvError, OSError, RuntimeError) as e:
                # One suite's failure must not cost the figures of the others.
                console.print(f"[red]{suite} failed: {type(e).__name__}: {e}[/red]")
                status = 1
                continue
            print_result(result)
            console.print(f"{suite}: {time.perf_counter() - start:.1f} s, wrote "
                          f"{context.out / (suite + '.json')}")
    finally:
        if owned:
            context.close()
    # Results written elsewhere (a quick or trial run) never overwrite the
    # repository's BENCHMARKS.md, which belongs to the default results folder.
    markdown = args.markdown
    if markdown is None:
        markdown = DEFAULT_MARKDOWN if context.out == DEFAULT_OUT else context.out / "BENCHMARKS.md"
    write_markdown(context.out, markdown, order=list(SUITES))
    console.print(f"wrote {markdown}")
    return status
