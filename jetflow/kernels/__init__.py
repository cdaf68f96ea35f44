"""Batch-invariant kernels: the exact numerics mode's GEMM and attention.

`jetflow.kernels.invariant` is the API (CPU today; the Triton kernels for CUDA are the GPU issue's
work). It imports nothing else of jetflow, so the precision core and the model can both use it.
"""
