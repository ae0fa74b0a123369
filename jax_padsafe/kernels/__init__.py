"""Build-time CuTe DSL kernel sources for jax_padsafe.

Nothing in this package is imported at run time: `python -m jax_padsafe.kernels.build` compiles the
kernels ahead of time (no GPU needed) and exports them as C objects that `ffi/` links into the kernel
library.  Importing these modules needs `nvidia-cutlass-dsl`.

- `common/`: what every architecture's kernels share: `bounds` (per-sequence lengths, visibility offsets,
  the key / query tile ranges and whether a tile needs masking), `masking` (the visibility mask applied with
  selects), `softmax` (online softmax that never evaluates exp(-inf - -inf)), `bwd_scores` (the backward's
  P and dS), `tiles` (shared-memory layouts and pad-safe zero-filling loads), `tile_schedule` (the compact
  tile schedule of packed batches), `tile_queue` (persistent CTAs claiming tiles from a counter) and
  `row_zeroing` (zeros the output rows no Hopper kernel tile writes, in place of memsets).
- `sm80/`: the SM80-class kernels (mma.sync + cp.async), built for every arch: `fwd`, and the backward's
  `bwd_preprocess`, `bwd_dkdv`, `bwd_dq`.
- `sm90/`: the Hopper kernels (TMA + wgmma, warp-specialised), sm_90a only: `fwd` (+ `fwd_schedule`,
  `fwd_producer`), `bwd_dkdv` and `bwd_dq` (+ `bwd_base`, `bwd_dkdv_steps`); `common` holds their building blocks.
- `build/`: the variant table and the ahead-of-time build.
"""
