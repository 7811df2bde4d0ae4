"""Running ``memkv bench`` suites and writing their results (see :mod:`memkv.bench`)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from pathlib import Path

from memkv.bench import ALL, SUITES
from memkv.bench.context import DEFAULT_OUT, BenchContext
from memkv.bench.report import (
    SuiteResult,
    console,
    plot_result,
    print_result,
    write_markdown,
    write_result,
)
from memkv.errors import InvalidInputError, MemkvError

__all__ = ["run", "run_suite"]

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


def run(
    suite: str = ALL,
    *,
    quick: bool = False,
    trace: Path | None = None,
    model: Path | None = None,
    out: Path = DEFAULT_OUT,
    markdown: Path | None = None,
    ctx: BenchContext | None = None,
) -> int:
    """Run one suite (or ``all``) and regenerate the markdown table.

    Args:
        suite: a name of :data:`SUITES`, or ``all``.
        quick: small sizes: each suite runs in seconds.
        trace: a Mooncake-format JSONL trace for the eviction suite.
        model: a local HF causal LM directory for the resume suite.
        out: the results folder.
        markdown: the generated table (default: BENCHMARKS.md for the default
            ``out``, else BENCHMARKS.md inside ``out``).
        ctx: a context carrying an existing cluster/gateway (tests); its sizes
            and paths are replaced by the arguments.

    Returns:
        0 when every suite ran, 1 when one failed (the others still run).

    Raises:
        InvalidInputError: an unknown suite, or a trace that is not a file.
    """
    if suite != ALL and suite not in SUITES:
        raise InvalidInputError(f"suite must be one of {[ALL, *SUITES]}, got {suite!r}")
    if trace is not None and not trace.is_file():
        raise InvalidInputError(f"--trace {trace}: expected a JSONL file, found none")
    suites = list(SUITES) if suite == ALL else [suite]
    owned = ctx is None
    context = ctx if ctx is not None else BenchContext()
    context.quick, context.trace, context.model, context.out = quick, trace, model, out
    status = 0
    try:
        for suite in suites:
            start = time.perf_counter()
            console.print(f"[bold]memkv bench {suite}[/bold]{' (quick)' if quick else ''}")
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
    if markdown is None:
        markdown = DEFAULT_MARKDOWN if context.out == DEFAULT_OUT else context.out / "BENCHMARKS.md"
    write_markdown(context.out, markdown, order=list(SUITES))
    console.print(f"wrote {markdown}")
    return status
