"""Kernel sources and their builders: the CPU kernels in C (csrc/, built by cpu_library.py)
and the Triton attention kernels (triton_attention.py)."""
