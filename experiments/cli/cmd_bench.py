"""``secagg bench ...``: benchmark drivers.

Each benchmark lives in its own ``experiments/bench/<name>.py`` module exposing
``register(bench_subparsers)``; they are listed in :data:`BENCH_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["BENCH_MODULES", "register"]

#: Benchmark modules under ``experiments.bench``, in help order.
BENCH_MODULES: tuple[str, ...] = ("aggregation", "he", "fedavg", "lightfr", "flower", "dpf", "secure")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg bench`` and every benchmark in :data:`BENCH_MODULES`."""
    parser = subparsers.add_parser(
        "bench",
        help="measure speed and cost against baselines and peers",
        description="Benchmarks. Every --json output is one JSON object on the last line of stdout.",
    )
    bench_sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name in BENCH_MODULES:
        importlib.import_module(f"experiments.bench.{name}").register(bench_sub)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
