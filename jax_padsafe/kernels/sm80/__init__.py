"""SM80-class kernels (mma.sync + cp.async): built for every arch."""
