"""Batch-invariant kernels: the exact numerics mode's GEMM and attention.

`jetflow.kernels.invariant` is the API (a package: weight packing, quantizers, GEMMs, attention): C++ kernels
on the CPU (csrc/, built by `cpu_build`), Triton kernels on CUDA (`jetflow.kernels.triton`, imported lazily:
Triton is optional). `canonical` defines the GEMMs' one order of additions, `paged` the exact attention over a
paged KV cache, `support` where the kernels can run. It imports nothing else of jetflow but jetflow.errors, so
the precision core and the model can both use it.
"""
