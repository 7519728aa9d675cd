"""The machine a benchmark ran on: its CPU model and the SIMD flags that decide its speed.

Every benchmark prints this (the development host changes between sessions; a figure means
nothing without the CPU it was measured on).
"""
from __future__ import annotations

import os
import platform
import re
from typing import Any

# forced_isa: what keeps chunkserve's kernels, PyTorch's and oneDNN's to a smaller instruction set
from chunkserve.model.kernels.cpu_library import forced_isa

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    text = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            text = f.read()
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = re.search(r"flags\s*:\s*(.*)", text)
    have = [f for f in FLAGS if flags and f in flags.group(1).split()]
    info: dict[str, Any] = {
        "model": model.group(1).strip() if model else platform.processor() or "unknown",
        "flags": have, "cores": os.cpu_count()}
    forced = forced_isa()
    if forced:
        info["forced_isa"] = forced
    return info


def cpu_model() -> str:
    """One line: model, cores and flags, e.g. "AMD EPYC, 2 cores, avx2 fma f16c"."""
    info = cpu_info()
    line = f"{info['model']}, {info['cores']} cores, {' '.join(info['flags']) or 'no AVX2'}"
    forced = [f"{k}={v}" for k, v in forced_isa().items()]
    return line + (f" (run as on a smaller CPU: {' '.join(forced)})" if forced else "")
