"""Builds and loads the batch-invariant CPU kernels (csrc/: the GEMM and its weight packing, attention, a
decode step's RoPE and KV-cache write, the activation quantizer) as a small shared library.

The library is compiled once per machine and source version with the system's C++ compiler
(`-O3 -march=native -fopenmp -ffp-contract=off`; about 2 s) into a cache directory keyed by the
source, the flags, the compiler and the CPU's feature flags (a home directory shared by machines of
another kind gets its own build), and loaded with ctypes. OpenMP is the libgomp that torch already
loaded, so the kernels share torch's threads (`torch.set_num_threads`).

`JETFLOW_KERNEL_CACHE` moves the cache (default ~/.cache/jetflow/kernels). Besides the `native`
build, the variants `avx512` (AVX-512 without the bf16 dot products: what an AVX-512 machine without
AVX512_BF16 runs), `avx2` (-mavx2 -mfma: what an AVX2-only machine runs) and `scalar` (-DJF_NO_SIMD:
the reference, one element at a time) compile the same kernels, which the tests compare bit for bit
(`avx512` only where the CPU has AVX-512).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first, which the library then shares)

from jetflow.errors import UserError

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "gemm.cpp", CSRC / "pack.cpp", CSRC / "attention.cpp", CSRC / "rope.cpp", CSRC / "quant.cpp"]
HEADERS = [CSRC / "simd.h", CSRC / "convert.h"]
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++17"]
VARIANTS = {"native": ["-march=native"],
            "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
            "avx2": ["-mavx2", "-mfma"], "scalar": ["-DJF_NO_SIMD"]}


class KernelBuildError(UserError, RuntimeError):
    """The batch-invariant CPU kernels could not be compiled or loaded."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise KernelBuildError(
            "precision.numerics=exact builds jetflow's batch-invariant CPU kernels once and needs a C++ compiler: "
            "install one (Debian: apt-get install g++) or run with precision.numerics=fast")
    return cxx


def _cache_dir() -> Path:
    return Path(os.environ.get("JETFLOW_KERNEL_CACHE", Path.home() / ".cache" / "jetflow" / "kernels"))


@functools.lru_cache(maxsize=None)
def load_library(variant: str = "native") -> ctypes.CDLL:
    """The compiled kernels (built on first use, then taken from the cache)."""
    if variant not in VARIANTS:
        raise ValueError(f"kernel variant {variant!r}: valid variants are {sorted(VARIANTS)}")
    cxx = _compiler()
    flags = FLAGS + VARIANTS[variant]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), *version, _cpu_flags()]).encode())
    path = _cache_dir() / f"jetflow_invariant_{variant}_{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            proc = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", str(out)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelBuildError(f"building {CSRC} with {cxx} failed:\n{proc.stderr[-2000:]}\n"
                                       "(or run with precision.numerics=fast)")
            os.replace(out, path)  # atomic: concurrent builders (torchrun ranks) leave one whole file
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}; delete it to rebuild") from None
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.jf_panel_width.restype = ctypes.c_int
    lib.jf_isa.restype = ctypes.c_char_p
    lib.jf_gemm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, i64, ptr, i64, i64]
    lib.jf_gemm.restype = None
    lib.jf_gemm_fp8.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_int, ptr, i64, ctypes.c_int, i64, ptr, i64,
                                i64]
    lib.jf_gemm_fp8.restype = None
    lib.jf_linear_fp8.argtypes = [ptr, i64, i64, i64, ctypes.c_int, f32, ptr, ctypes.c_int, ptr, i64, ctypes.c_int, i64,
                                  ptr, i64, i64]
    lib.jf_linear_fp8.restype = i64
    lib.jf_pack_panels.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, ptr]
    lib.jf_pack_panels.restype = None
    lib.jf_pack_pairs.argtypes = [ptr, ctypes.c_int, i64, i64, ptr]
    lib.jf_pack_pairs.restype = ctypes.c_int
    lib.jf_e4m3_to_f32.argtypes = [ptr, i64, ptr]
    lib.jf_e4m3_to_f32.restype = None
    lib.jf_quantize_1x128.argtypes = [ptr, i64, i64, i64, i64, ctypes.c_int, f32, ptr, ptr]
    lib.jf_quantize_1x128.restype = i64
    lib.jf_round_to_bf16.argtypes = [ptr, i64, ptr]
    lib.jf_round_to_bf16.restype = None
    lib.jf_attention.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, f32]
    lib.jf_attention.restype = None
    lib.jf_rope_decode.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, ptr, i64,
                                   i64, i64, i64, i64, i64, i64]
    lib.jf_rope_decode.restype = None
    lib.jf_attention_paged.argtypes = [ptr, ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, i64, f32, f32, ptr, i64, ptr,
                                       ptr, i64, i64, i64, i64, i64, f32]
    lib.jf_attention_paged.restype = None
    lib.jf_rope_decode_paged.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64,
                                         i64, i64, ptr, i64, i64, i64, f32, f32, ptr, i64, i64, i64, i64, i64]
    lib.jf_rope_decode_paged.restype = None
    return lib
