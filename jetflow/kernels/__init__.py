"""Batch-invariant kernels: the exact numerics mode's GEMM and attention.

`jetflow.kernels.invariant` is the API: C++ kernels on the CPU (csrc/), Triton kernels on CUDA
(`jetflow.kernels.triton`, imported lazily: Triton is optional). It imports nothing else of jetflow
but jetflow.errors, so the precision core and the model can both use it.
"""
