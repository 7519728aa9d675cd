"""The CPU C kernels and GEMM formats called directly, outside the engine."""
