"""Hopper kernels (TMA + wgmma, warp-specialised): built for sm_90a."""
