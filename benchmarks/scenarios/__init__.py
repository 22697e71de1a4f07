"""Benchmark scenarios: every module here is discovered by :mod:`benchmarks.harness`.

A scenario module defines ``NAME`` (str), ``DESCRIPTION`` (str),
``add_arguments(parser)`` and ``run(args) -> list[Result]``.
"""
