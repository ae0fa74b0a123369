"""The GPU kernels' backend: the prebuilt FFI library (``library``), its forward and backward entry
points (``forward``, ``backward``), the few-query-rows rewrite (``split_kv``) and the ``Backend``
that calls them on the canonical problem (``backend``).

Needs no CuTe DSL and no CUDA toolkit at run time: only the built library.
"""
