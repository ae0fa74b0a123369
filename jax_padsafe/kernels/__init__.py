"""Build-time CuTe DSL kernel sources for jax_padsafe.

Nothing in this package is imported at run time: `python -m jax_padsafe.kernels.build` compiles the
kernels ahead of time (no GPU needed) and exports them as C objects that `ffi/` links into
`jax_padsafe/_cute/lib/libjax_padsafe_kernels.so`.  Importing these modules needs `nvidia-cutlass-dsl`.

Modules:
- `tiles`    : shared-memory layouts and pad-safe (predicated, zero-filling) global->shared tile loads
- `bounds`   : per-sequence lengths, visibility offsets and the K-tile range a query tile must visit
- `masking`  : the visibility mask applied to a score tile with selects
- `softmax`  : online softmax that never evaluates exp(-inf - -inf), and its finalisation (O scale, lse)
- `fwd_sm80` : the SM80-class (mma.sync + cp.async) forward kernel built from the pieces above
- `row_zeroing`: zeros the output rows no Hopper kernel tile writes (packed layouts), in place of memsets
- `variants` : the variant matrix (dtype x head dim x softcap) and symbol naming shared with `ffi/`
- `build`    : the AOT build script
"""
