// Zeroing of the output rows that no tile of the Hopper (sm90) kernels writes, in place of a memset of the
// whole output (jax_padsafe/kernels/row_zeroing.py says which rows those are and why the rest are written).
// Shared by the forward (O) and backward (dQ, dK, dV) handlers.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

// ABI with the generated launch adapters (build/kernels/jps_zero_rows_registry.h, written by
// jax_padsafe/kernels/build.py): outputs as Int32 [rows, words, 4], cu_seqlens [batch + 1].
typedef int32_t (*JpsZeroRowsLaunchFn)(void *module, void *a, void *b, int32_t rows, int32_t words, int32_t *cu,
                                       int32_t batch, int32_t bound, cudaStream_t stream);

struct JpsZeroRowsKernel {
  int arch;         // as JpsFwdVariant::arch
  int num_outputs;  // 1 (O, dQ) or 2 (dK and dV, which share their rows)
  void *module;     // the export's <prefix>_Kernel_Module_t
  void (*load)(void *module);
  JpsZeroRowsLaunchFn launch;
};

// Loads this architecture's row-zeroing kernels (once, behind a mutex); errors surface at launch.  Must run in
// the handlers' initialize stage: loading a module inside a captured command buffer is not allowed.
void JpsZeroRowsLoad(int arch);

// Whether JpsZeroUncoveredRows can run on `arch` (built, and not disabled with JAX_PADSAFE_ROW_MEMSET=1).
bool JpsZeroRowsAvailable(int arch);

// Zeroes, in one or two outputs of `rows` rows of `row_bytes` bytes each (b may be null), every row r with
// r < cu[0], r >= cu[batch], or r - cu[s] >= bound for the s with cu[s] <= r < cu[s + 1]; leaves every other
// row untouched.  row_bytes must be a multiple of 16 and the outputs 16-byte aligned.  Returns the launch's
// cudaError_t (as int32_t).
int32_t JpsZeroUncoveredRows(int arch, void *a, void *b, int64_t rows, int64_t row_bytes, const int32_t *cu,
                             int64_t batch, int32_t bound, cudaStream_t stream);

// Test hook: JAX_PADSAFE_POISON_OUTPUTS=1 in the environment (read once per process) makes the handlers fill
// every output they do not memset with 0xFF bytes (NaN in bf16 and fp16) before the kernels run, so a row that
// no kernel writes comes out NaN instead of whatever the allocator left (often zeros).  The GPU checks and the
// pytest GPU cases set it; it costs a memset per output, so benchmarks leave it off.
bool JpsPoisonOutputs();
