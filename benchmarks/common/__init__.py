"""Helpers shared by the benchmarks, not benchmarks themselves: the host's CPU (host.py) and
wall-clock timing (timing.py)."""
