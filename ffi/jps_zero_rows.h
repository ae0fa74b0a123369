// ABI between the row-zeroing functions (jps_zero_rows.cc, declared in common.h) and the generated launch
// adapters (<kernel dir>/jps_zero_rows_registry.h, written by the kernel build from
// jax_padsafe/kernels/common/row_zeroing.py, which says which rows the Hopper kernels leave to it and why).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

// Outputs as Int32 [rows, words, 4] (one 16-byte word per entry), cu_seqlens [batch + 1]; b == a for one output.
typedef int32_t (*JpsZeroRowsLaunchFn)(void *module, void *a, void *b, int32_t rows, int32_t words, int32_t *cu,
                                       int32_t batch, int32_t bound, cudaStream_t stream);

struct JpsZeroRowsKernel {
  int arch;         // as JpsFwdVariant::arch
  int num_outputs;  // 1 (O, dQ) or 2 (dK and dV, which share their rows)
  void *module;     // the export's <prefix>_Kernel_Module_t
  void (*load)(void *module);
  JpsZeroRowsLaunchFn launch;
};
