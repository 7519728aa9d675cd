"""Benchmarks, grouped by what they measure (benchmarks/README.md is the index).

Each script runs from the repository root as `.venv/bin/python benchmarks/<group>/<script>.py`;
it puts the root on sys.path itself, so the shared helpers import as `benchmarks.common.*`.
"""
