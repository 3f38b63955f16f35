"""Benchmarks behind ``secagg bench``: one module per benchmark, each exposing ``register(bench_subparsers)``."""
