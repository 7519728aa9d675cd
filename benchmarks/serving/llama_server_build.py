"""Builds llama.cpp's `llama-server` (or another of its tools) once into a cache folder, for the
side-by-side benchmarks.

The sources are the llama.cpp tree vendored in the `llama-cpp-python` sdist on PyPI (the only
registry this project may reach), built with `-DGGML_NATIVE=ON` for this CPU. Nothing of it is
committed; a binary lands in `<cache>/<target>` and later runs reuse it (and its build folder:
a second target, e.g. `llama-batched-bench` for engine/decode_scaling.py, then takes seconds).
Under `CHUNKSERVE_CPU_ISA=avx2` (chunkserve's kernels built as for an AVX2-only CPU) llama.cpp
is built the same way, AVX2/FMA/F16C and no AVX-512, into `<cache>-avx2`, so a side-by-side on
an AVX-512 host compares the two as an AVX2 CPU would run them (its memory and caches aside).

    .venv/bin/python benchmarks/serving/llama_server_build.py [--cache-dir DIR]   # ~15 min, 2 cores
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "chunkserve", "llama.cpp")
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]


def _isa() -> str:
    return os.environ.get("CHUNKSERVE_CPU_ISA", "native") or "native"


def _cmake_flags() -> list[str]:
    if _isa() == "avx2":
        return [f for f in CMAKE_FLAGS if f != "-DGGML_NATIVE=ON"] + AVX2_FLAGS
    return CMAKE_FLAGS


def server_binary(cache_dir: str, target: str = "llama-server") -> str:
    return os.path.join(cache_dir, target)


def _fetch_sources(cache_dir: str) -> str:
    """The vendored llama.cpp folder of the sdist, downloaded and unpacked once."""
    found = glob.glob(os.path.join(cache_dir, "llama_cpp_python-*", "vendor", "llama.cpp"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", cache_dir, LLAMA_CPP_PYTHON], check=True)
    sdist = glob.glob(os.path.join(cache_dir, "llama_cpp_python-*.tar.gz"))[0]
    with tarfile.open(sdist) as tar:
        tar.extractall(cache_dir, filter="data")
    return glob.glob(os.path.join(cache_dir, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]


def build(cache_dir: str = DEFAULT_CACHE, jobs: int = 2, target: str = "llama-server") -> str:
    """Path of a built llama.cpp tool `target`, building it first if the cache has none."""
    if _isa() == "avx2" and cache_dir == DEFAULT_CACHE:
        cache_dir += "-avx2"
    binary = server_binary(cache_dir, target)
    if os.path.isfile(binary):
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError(f"building {target} needs cmake and a C++ compiler")
    os.makedirs(cache_dir, exist_ok=True)
    src = _fetch_sources(cache_dir)
    build_dir = os.path.join(cache_dir, "build")
    subprocess.run(["cmake", "-S", src, "-B", build_dir, *_cmake_flags()], check=True)
    subprocess.run(["cmake", "--build", build_dir, "--target", target, "-j", str(jobs)],
                   check=True)
    shutil.copy(os.path.join(build_dir, "bin", target), binary)
    return binary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", default=DEFAULT_CACHE)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--target", default="llama-server", help="a llama.cpp CMake target")
    args = p.parse_args()
    print(build(args.cache_dir, args.jobs, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
