"""Run-time side of the CuTe DSL kernels: loads the prebuilt FFI library and wraps it for JAX.

Needs no CuTe DSL and no CUDA toolkit; see `ops` for the interface used by the API layer.
"""
