// The row-zeroing kernels (jax_padsafe/kernels/common/row_zeroing.py) behind common.h's ZeroUncoveredRows: they
// write zeros to the output rows that no tile of the Hopper kernels covers, in place of a memset of the whole
// output.
#include <string>

#include "common.h"
#include "jps_zero_rows.h"
#include "jps_zero_rows_registry.h"  // generated: kJpsZeroRowsKernels, kJpsNumZeroRowsKernels

namespace jps {
namespace {

ArchLoader g_zero_rows_loader;

const JpsZeroRowsKernel *Find(int arch, int outputs) {
  for (int i = 0; i < kJpsNumZeroRowsKernels; ++i)
    if (kJpsZeroRowsKernels[i].arch == arch && kJpsZeroRowsKernels[i].num_outputs == outputs)
      return &kJpsZeroRowsKernels[i];
  return nullptr;
}

}  // namespace

ffi::Error LoadZeroRowsKernels(const char *target, int arch) {
  return g_zero_rows_loader.Load(arch, [&]() -> ffi::Error {
    for (int i = 0; i < kJpsNumZeroRowsKernels; ++i) {
      const JpsZeroRowsKernel &z = kJpsZeroRowsKernels[i];
      if (z.arch != arch) continue;
      const std::string name = "row zeroing (" + std::to_string(z.num_outputs) + " outputs, sm_" +
                               std::to_string(z.arch) + ")";
      if (ffi::Error e = LoadChecked(target, name.c_str(), [&] { z.load(z.module); }); e.failure()) return e;
    }
    return ffi::Error::Success();
  });
}

bool ZeroRowsAvailable(int arch) { return Find(arch, 1) != nullptr && Find(arch, 2) != nullptr; }

ffi::Error ZeroUncoveredRows(const char *target, int arch, void *a, void *b, int64_t rows, int64_t row_bytes,
                             const int32_t *cu, int64_t batch, int32_t bound, cudaStream_t stream) {
  const JpsZeroRowsKernel *k = Find(arch, b ? 2 : 1);
  if (!k || row_bytes % 16 != 0 || rows >= (int64_t(1) << 31) || row_bytes / 16 >= (int64_t(1) << 31))
    return CudaError(target, "row zeroing", cudaErrorInvalidValue);
  const int32_t rc = k->launch(k->module, a, b ? b : a, int32_t(rows), int32_t(row_bytes / 16),
                               const_cast<int32_t *>(cu), int32_t(batch), bound, stream);
  if (rc != 0) return CudaError(target, "row zeroing", cudaError_t(rc));
  return ffi::Error::Success();
}

}  // namespace jps
