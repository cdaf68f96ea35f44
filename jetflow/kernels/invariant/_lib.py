"""What the invariant kernels' modules share: the device check, the compiled CPU library's handle and the
instruction set it computes with, and the raw pointers its entry points take."""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import Tensor

from jetflow.kernels import triton as cuda_kernels  # imports no triton until a kernel is used

_PACKAGE = __name__.rpartition(".")[0]  # jetflow.kernels.invariant


def library(variant: str = "native") -> ctypes.CDLL:
    """The compiled kernels of `variant`: the package's `load_library` (jetflow.kernels.cpu_build's), looked
    up there on each call, so whoever replaces `jetflow.kernels.invariant.load_library` (a test counting the
    kernel calls, scripts/profile_exact_rollout.py timing them) reaches every kernel of the package."""
    return sys.modules[_PACKAGE].load_library(variant)


def check_device(device: torch.device | str) -> None:
    """The exact kernels run on the CPU (C++) and on CUDA (Triton: MissingDependencyError without it)."""
    kind = torch.device(device).type
    if kind == "cuda":
        cuda_kernels.require()
    elif kind != "cpu":
        raise NotImplementedError(
            f"precision.numerics=exact runs on the CPU and on CUDA (got device {device}): use "
            "precision.numerics=fast here")


def ptr(t: Tensor) -> int:
    return t.data_ptr()


def isa(variant: str = "native") -> str:
    """The instruction set a build computes with: avx512_bf16, avx512, avx2 or scalar."""
    return library(variant).jf_isa().decode()
