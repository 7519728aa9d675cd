"""Builds and loads the CPU kernels (`kernels/csrc/*.c`: paged decode attention, bfloat16 and
float32 prefill-chunk attention, the int4/int8 GEMMs for decode rows, a layer's small ops) with
the C compiler, as one shared library.

The library is compiled once per source, compiler and CPU (`-march=native`) into a cache folder
(`$CHUNKSERVE_CACHE_DIR`, default `~/.cache/chunkserve`) and loaded with ctypes. It links
against `libgomp.so.1`; PyTorch is imported first and has loaded its own copy under that
soname, so the kernel's OpenMP loop runs on PyTorch's thread pool (see the C file's header).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache

import torch  # first: its libgomp.so.1 is the one the kernel must bind to

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# `CHUNKSERVE_CPU_ISA=avx2` builds the kernels for an AVX2-only CPU (Haswell's set: AVX2, FMA,
# F16C; x86-64-v3) and makes the engine choose as on one (no AVX512_BF16 paths): how the AVX2
# kernels are tested and measured on an AVX-512 host. Set `ATEN_CPU_CAPABILITY=avx2` and
# `ONEDNN_MAX_CPU_ISA=AVX2` as well to keep PyTorch's own kernels and oneDNN's GEMMs to AVX2.
# Default `native`: all the CPU has.
ISAS = {"native": "-march=native", "avx2": "-march=haswell"}
# The variables that make this CPU run as a smaller one would (above): step times, benchmarks'
# host lines and caches keyed by the machine record them.
FORCED_ISA = ("CHUNKSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
# Linked apart, without -ffast-math: with it, GCC before 13 links crtfastmath.o into a shared
# library too, whose constructor sets flush-to-zero / denormals-are-zero for the whole process
# when the library loads: every float op of PyTorch and Python after it would change.
LDFLAGS = ["-shared", "-fopenmp"]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# out, q, k_cache, v_cache, bf16, kv_kind, block_table, table_width, seq_lens, rows, num_seqs,
# window (0: none), heads, kv_heads, head_dim, block_size, scale, num_threads
ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
            _i64, _i64, _f32, _i64]

# out, q, k_cache, v_cache, kv_kind, block_table, table_width, seq_lens, q_starts, q_lens,
# num_seqs, window (0: none), heads, kv_heads, head_dim, block_size, scale, num_threads
CHUNK_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                  _i64, _i64, _i64, _f32, _i64]

# How the kernels are told an array's storage (kernels/csrc/storage.h's KIND_*).
STORAGE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2,
                 torch.float8_e5m2: 3}


class KernelBuildError(ValueError):
    """The kernel cannot be built or loaded here; a ValueError like every backend's refusal, so
    the command line prints it as a message (and `auto` falls back to `torch`)."""


def cache_dir() -> str:
    root = os.environ.get("CHUNKSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "chunkserve")
    return os.path.join(root, "kernels")


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError(
        "attention backend 'cpu' compiles a small C kernel at first use and found no C "
        "compiler (cc, gcc or clang; or set CC). Install one, or use --attention-backend torch.")


def isa() -> str:
    """The instruction set the kernels are built for (`CHUNKSERVE_CPU_ISA`, default native)."""
    name = os.environ.get("CHUNKSERVE_CPU_ISA", "native") or "native"
    if name not in ISAS:
        raise KernelBuildError(f"CHUNKSERVE_CPU_ISA must be one of {', '.join(ISAS)}, got "
                               f"{name!r}")
    return name


def forced_isa() -> dict[str, str]:
    """FORCED_ISA's variables that are set, and their values."""
    return {name: os.environ[name] for name in FORCED_ISA if os.environ.get(name)}


def cflags(target: str) -> list[str]:
    """CFLAGS with `-march` for the instruction set `target` (a key of ISAS)."""
    return [ISAS[target] if f == "-march=native" else f for f in CFLAGS]


def _cpu_id() -> str:
    """What -march=native depends on: a cached build from another CPU may not run here."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _sources() -> list[str]:
    return sorted(os.path.join(SOURCE_DIR, n) for n in os.listdir(SOURCE_DIR) if n.endswith(".c"))


def _source_bytes() -> bytes:
    source = b""
    for name in sorted(os.listdir(SOURCE_DIR)):  # the .c files and the headers they include
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            source += name.encode() + f.read()
    return source


def source_digest() -> str:
    """A digest of the kernels' sources: what a build of them is (the step-time model's cache
    is keyed by it too: other kernels, other step times)."""
    return hashlib.sha256(_source_bytes()).hexdigest()[:16]


def _build(cc: str, target: str) -> str:
    flags = cflags(target)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(_source_bytes() + " ".join(flags + LDFLAGS).encode() + version.encode()
                         + _cpu_id().encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"cpu_kernels-{key}.so")
    if os.path.isfile(path):
        return path
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        # Built beside its final name and renamed: two processes building at once never load
        # a half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
    except OSError as e:
        raise KernelBuildError(f"cannot write the CPU kernel's cache folder {cache_dir()} ({e}); "
                               "set CHUNKSERVE_CACHE_DIR, or use --attention-backend torch.") from e
    os.close(fd)
    try:
        error = compile_shared(cc, _sources(), tmp, flags)
        if error:
            raise KernelBuildError(f"compiling {SOURCE_DIR} with {cc} failed:\n{error}\n"
                                   "Use --attention-backend torch.")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def compile_shared(cc: str, sources: list[str], out: str, flags: list[str] | None = None) -> str:
    """Compiles `sources` (`flags`, default CFLAGS) and links them into the shared library
    `out` (LDFLAGS). Returns the compiler's error text, or "" when it built."""
    flags = CFLAGS if flags is None else flags
    with tempfile.TemporaryDirectory() as tmp:
        objects = [os.path.join(tmp, f"{i}.o") for i in range(len(sources))]
        for src, obj in zip(sources, objects):
            done = subprocess.run([cc, *flags, "-c", src, "-o", obj], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                return done.stderr.strip()
        done = subprocess.run([cc, *LDFLAGS, *objects, "-o", out, "-lm"], capture_output=True,
                              text=True)
        return done.stderr.strip() if done.returncode != 0 else ""


def library(target: str | None = None) -> ctypes.CDLL:
    """The kernels' library for the instruction set `target` (default: `isa()`), compiled first
    if this machine has no build of it yet."""
    return _library(target or isa())


@cache
def _library(target: str) -> ctypes.CDLL:
    return ctypes.CDLL(_build(_compiler(), target))


def load(target: str | None = None) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The paged decode attention entry point (of the build for `target`, default `isa()`)."""
    fn = library(target).paged_decode_attention
    fn.argtypes = ARGTYPES
    fn.restype = ctypes.c_int
    return fn


# The group GEMMs, best first where a build has several (measured: docs/performance.md, issue
# 54): (name, the C entry point's prefix, whether it takes bfloat16 activations and a y_bf16 flag).
GROUP_GEMMS = (("vnni", "group_gemm_vnni", True), ("bf16", "group_gemm_bf16", True),
               ("avx2", "group_gemm_avx2", False))


def group_gemms(target: str | None = None
                ) -> dict[str, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    """Every group GEMM the build for `target` (default `isa()`) has, by name, best first:
    "vnni" (group_gemm_vnni.c, AVX512_VNNI), "bf16" (group_gemm_bf16.c, AVX512_BF16), "avx2"
    (group_gemm_avx2.c, AVX2/FMA/F16C). Empty where the kernels do not build."""
    try:
        lib = library(target)
    except KernelBuildError:
        return {}
    found = {}
    for name, entry, bf16 in GROUP_GEMMS:
        if not getattr(lib, f"{entry}_supported")():
            continue
        fn = getattr(lib, entry)
        # y, [y_bf16,] x, M, K, levels, scales, N, bits, num_threads
        fn.argtypes = [_ptr, *([_i64] if bf16 else []), _ptr, _i64, _i64, _ptr, _ptr, _i64,
                       _i64, _i64]
        fn.restype = ctypes.c_int
        found[name] = fn
    return found


def load_group_gemm(target: str | None = None
                    ) -> tuple[str, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    """The GEMM for group-quantized weights and decode rows, as (its name, its entry point):
    the first of `group_gemms(target)`; None where there is none."""
    found = group_gemms(target)
    return next(iter(found.items()), None)


def load_chunk_bf16(head_dim: int, target: str | None = None
                    ) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The bfloat16 prefill-chunk attention entry point (chunk_attention_bf16.c), or None where
    the build (`target`, default `isa()`) does not have it (no AVX512_BF16) or not for this
    head size (64, 128, 256)."""
    return _load_chunk(library(target), "chunk_attention_bf16", head_dim)


def load_chunk_avx2(head_dim: int, target: str | None = None
                    ) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The float32 prefill-chunk attention entry point (chunk_attention_avx2.c), or None where
    the build (`target`, default `isa()`) has no AVX2 and FMA or the head size is not a multiple
    of 8 up to 256."""
    return _load_chunk(library(target), "chunk_attention_avx2", head_dim)


def _load_chunk(lib: ctypes.CDLL, name: str,
                head_dim: int) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """Chunk kernel `name` of `lib` (CHUNK_ARGTYPES), or None where `name`_supported says no."""
    supported = getattr(lib, f"{name}_supported")
    supported.argtypes = [_i64]
    if not supported(head_dim):
        return None
    fn = getattr(lib, name)
    fn.argtypes = CHUNK_ARGTYPES
    fn.restype = ctypes.c_int
    return fn
