// The core shared by the forward (jps_fwd.cc) and backward (jps_bwd.cc) XLA FFI handlers: which kernel build
// serves a device, checked loading of the exported kernel modules, the argument checks both handlers make,
// the variant lookup, and how outputs get their zeros (memsets, or the row-zeroing kernels of jps_zero_rows.cc).
//
// Errors name the FFI target ("jax_padsafe_fwd", "jax_padsafe_bwd") they come from.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <array>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

#define JPS_EXPORT extern "C" __attribute__((visibility("default")))

namespace jps {

namespace ffi = xla::ffi;

ffi::Error InvalidArgument(const char *target, const std::string &msg);
ffi::Error CudaError(const char *target, const std::string &what, cudaError_t err);  // kInternal

// ---- architecture ------------------------------------------------------------------------------------------

// The kernel build (`arch` of the registries) that serves a device of compute capability major.minor, or -1:
// sm_80/86/87/89 run the sm_80 build, sm_90 the sm_90a build, sm_100/103 the sm_100a build, sm_120/121 the
// sm_120 build.  sm_90a code runs on compute capability 9.0 only.
int ArchForCapability(int major, int minor);

struct DeviceCapability {
  int major, minor;
  int arch;  // ArchForCapability(major, minor)
};

// The current device's capability, queried once per device.
ffi::Error CurrentCapability(const char *target, DeviceCapability *cap);

// kUnimplemented: no `what` kernels (e.g. "forward") were built for this device.
ffi::Error NoKernelsForDevice(const char *target, const char *what, const DeviceCapability &cap);

// The current device's build arch, checked to have entries in `table` (a registry: kJpsFwdVariants, ...).
template <typename Variant>
ffi::Error ArchWithKernels(const char *target, const char *what, const Variant *table, int count, int *arch) {
  DeviceCapability cap{};
  if (ffi::Error e = CurrentCapability(target, &cap); e.failure()) return e;
  for (int i = 0; i < count; ++i)
    if (cap.arch > 0 && table[i].arch == cap.arch) {
      *arch = cap.arch;
      return ffi::Error::Success();
    }
  return NoKernelsForDevice(target, what, cap);
}

// Whether the Hopper kernel families (family 1 of both registries) may serve compute capability 9.0.
// JAX_PADSAFE_SM90=0 in the environment keeps the SM80-class kernels on Hopper, forward and backward, so that
// the tests can run those kernels on a Hopper GPU.  Read once per process.
bool Sm90FamilyEnabled();

// ---- module loading ----------------------------------------------------------------------------------------

// The exported loaders report CUDA errors through CUTE_DSL_CUDA_ERROR_CHECK, redirected to jps_note_cuda_error
// (jps_fwd_args.h), which keeps the first error of the calling thread.  Returns that error and clears it.
cudaError_t TakeLoadError();

// Runs one kernel module's loader and returns its first CUDA error as an error naming `kernel`.
template <typename Load>
ffi::Error LoadChecked(const char *target, const char *kernel, Load &&load) {
  TakeLoadError();
  load();
  if (cudaError_t err = TakeLoadError(); err != cudaSuccess)
    return CudaError(target, std::string("loading kernel module ") + kernel, err);
  return ffi::Error::Success();
}

// Loads a registry's modules once per arch, behind a mutex.  A failed load is not remembered as done: the next
// call tries again and reports the error again.  Loading must happen in the handlers' initialize stage, since
// loading a module inside a captured command buffer is not allowed (execute calls it too, a no-op by then).
class ArchLoader {
 public:
  template <typename LoadArch>
  ffi::Error Load(int arch, LoadArch &&load_arch) {
    if (arch < 0 || arch >= int(loaded_.size()))
      return ffi::Error::Internal("jax_padsafe: kernel arch " + std::to_string(arch) + " out of range");
    std::lock_guard<std::mutex> lock(mutex_);
    if (loaded_[arch]) return ffi::Error::Success();
    if (ffi::Error e = load_arch(); e.failure()) return e;
    loaded_[arch] = true;
    return ffi::Error::Success();
  }

 private:
  std::mutex mutex_;
  std::array<bool, 256> loaded_{};
};

// Loads every entry of `table` built for `arch`: registries whose entries have `module`, `load(module)` and
// `name` (the forward's; the backward's entries load several modules each, the row-zeroing ones have no name).
template <typename Variant>
ffi::Error LoadModules(const char *target, const Variant *table, int count, int arch) {
  for (int i = 0; i < count; ++i) {
    const Variant &v = table[i];
    if (v.arch != arch) continue;
    if (ffi::Error e = LoadChecked(target, v.name, [&] { v.load(v.module); }); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// ---- arguments ---------------------------------------------------------------------------------------------

// The sizes of one call, checked by CheckProblem: q [total_q, N, H], k and v [total_k, K, H].
struct Problem {
  int64_t total_q, total_k;
  int64_t num_heads, num_kv_heads, head_dim;  // N, K, H
  int64_t batch;                              // B: entries of seqused_q
  int dtype;                                  // registry code: 0 bfloat16, 1 float16
  int softcap;                                // 0/1: softcap > 0
  int aux;                                    // 0, or the aux kind (aux.h): masks and biases as tensors
};

// The checks both handlers make on q, k, v, the sequence bounds and the scalars: ranks and shapes, one dtype
// (bfloat16 or float16), N a positive multiple of K, cu_seqlens_q/k of B + 1 and seqused_q/k of B entries,
// lengths below 2**30, N and B at most 65535 (grid limits), scale finite and > 0, softcap finite and >= 0.
// scale > 0 because the kernels fold it into exp2(s * scale * log2e - m * scale * log2e) with m the max of the
// raw scores; the Python side maps scale < 0 onto (-q, -scale) and scale == 0 onto (q = 0, scale 1).
ffi::Error CheckProblem(const char *target, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v,
                        const ffi::Buffer<ffi::S32> &cu_q, const ffi::Buffer<ffi::S32> &cu_k,
                        const ffi::Buffer<ffi::S32> &used_q, const ffi::Buffer<ffi::S32> &used_k, float scale,
                        float softcap, int32_t max_seqlen_q, int32_t max_seqlen_k, Problem *p);

// Whether `dims` is exactly [d0, d1, d2] / [d0, d1].
bool HasShape(ffi::Span<const int64_t> dims, int64_t d0, int64_t d1, int64_t d2);
bool HasShape(ffi::Span<const int64_t> dims, int64_t d0, int64_t d1);

// kUnimplemented: no `what` variant serves `p` on `arch`.  `built_dims`: the other head dims built for that
// dtype and softcap; `excluded`: variants of this head dim were built but none was allowed.
ffi::Error NoVariant(const char *target, const char *what, const Problem &p, int arch, const std::string &built_dims,
                     bool excluded);

// The registry entry that serves `p` on `arch`: among the entries of this head dim, dtype and softcap that
// `allowed(entry)` accepts, the one of the highest family (the Hopper family 1 over the SM80-class 0).
template <typename Variant, typename Allowed>
ffi::Error FindVariant(const char *target, const char *what, const Variant *table, int count, int arch,
                       const Problem &p, Allowed &&allowed, const Variant **out) {
  const Variant *best = nullptr;
  std::string built_dims;
  bool excluded = false;
  for (int i = 0; i < count; ++i) {
    const Variant &c = table[i];
    if (c.arch != arch || c.dtype != p.dtype || c.softcap != p.softcap || c.aux != p.aux) continue;
    if (c.head_dim != p.head_dim) {
      const std::string dim = std::to_string(c.head_dim);
      if ((" " + built_dims + " ").find(" " + dim + " ") == std::string::npos)
        built_dims += (built_dims.empty() ? "" : " ") + dim;
      continue;
    }
    if ((c.family == 1 && !Sm90FamilyEnabled()) || !allowed(c)) {
      excluded = true;
      continue;
    }
    if (!best || c.family > best->family) best = &c;
  }
  if (!best) return NoVariant(target, what, p, arch, built_dims, excluded);
  *out = best;
  return ffi::Error::Success();
}

// The kernel arguments both argument structs (JpsFwdArgs, JpsBwdArgs) share, from the call's buffers and
// attributes.  Soft-capping computes cap * tanh(s * scale / cap) in the kernels' log2 domain; causal folds
// into window_right = 0 (j <= i + offset is min(right, 0) = 0 for any right >= 0).
template <typename Args>
void FillCommonArgs(Args *a, const Problem &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k,
                    const ffi::AnyBuffer &v, const ffi::Buffer<ffi::S32> &cu_q, const ffi::Buffer<ffi::S32> &cu_k,
                    const ffi::Buffer<ffi::S32> &used_q, const ffi::Buffer<ffi::S32> &used_k, float scale, float softcap,
                    int32_t window_left, int32_t window_right, int32_t causal, int32_t bottom_right,
                    int32_t max_seqlen_q) {
  const float log2e = 1.4426950408889634f;
  a->q = q.untyped_data();
  a->k = k.untyped_data();
  a->v = v.untyped_data();
  a->cu_q = cu_q.typed_data();
  a->cu_k = cu_k.typed_data();
  a->used_q = used_q.typed_data();
  a->used_k = used_k.typed_data();
  a->total_q = int32_t(p.total_q);
  a->total_k = int32_t(p.total_k);
  a->num_heads = int32_t(p.num_heads);
  a->num_kv_heads = int32_t(p.num_kv_heads);
  a->head_dim = int32_t(p.head_dim);
  a->batch = int32_t(p.batch);
  a->score_mul = p.softcap ? scale / softcap : scale * log2e;
  a->cap_mul = p.softcap ? softcap * log2e : 1.0f;
  a->window_left = window_left < 0 ? -1 : window_left;
  a->window_right = causal ? 0 : (window_right < 0 ? -1 : window_right);
  a->bottom_right = bottom_right ? 1 : 0;
  a->max_seqlen_q = max_seqlen_q;
}

// ---- schedules and outputs ---------------------------------------------------------------------------------

// Whether a Hopper kernel with `block`-row tiles may take its compact schedule (packed batches where the dense
// grid, ceil(max_seqlen / block) tiles per sequence, would be mostly empty): the rule of
// kernels/common/tile_schedule.use_compact_grid, in int64.  Its persistent CTAs claim tiles from a counter that
// must then start at zero.
bool CompactScheduleMayRun(int64_t total, int32_t max_seqlen, int64_t block, int64_t batch);

// Stream-ordered memset of `bytes` bytes to 0.
ffi::Error Zero(const char *target, cudaStream_t stream, void *p, size_t bytes);

// How a call's outputs get the zeros of the rows no kernel writes.  The SM80-class kernels write valid rows
// only: the outputs are memset first.  The Hopper kernels write every row of their tiles up to the sequence's
// slot end (cu_seqlens[b + 1]), rows past the used length as zeros: when the caller promises those tiles cover
// every row (rows_covered: the dense padded layout) nothing more is needed; otherwise (packed layouts) the
// row-zeroing kernels write zeros to the rows the tiles miss (lead, tail, slot rows past max_seqlen), a
// fraction of a memset's writes.
enum class OutputZeroing { kMemset, kTilesCoverRows, kZeroUncoveredRows };
OutputZeroing ChooseOutputZeroing(int family, bool rows_covered, int arch);

// Test hook: JAX_PADSAFE_POISON_OUTPUTS=1 in the environment (read once per process) makes the handlers fill
// every output they do not memset with 0xFF bytes (NaN in bfloat16 and float16) before the kernels run, so a
// row that no kernel writes comes out NaN instead of whatever the allocator left (often zeros).  The tests set
// it; it costs a memset per output, so benchmarks leave it off.  Poison() is a no-op without it.
ffi::Error Poison(const char *target, cudaStream_t stream, void *p, size_t bytes);

// ---- row zeroing (jps_zero_rows.cc) ------------------------------------------------------------------------

// Loads `arch`'s row-zeroing kernels once (none built for it: nothing to load).  Initialize stage only.
ffi::Error LoadZeroRowsKernels(const char *target, int arch);

// Whether both row-zeroing kernels (one and two outputs) were built for `arch`.
bool ZeroRowsAvailable(int arch);

// Zeroes, in one or two outputs of `rows` rows of `row_bytes` bytes each (b may be null), every row r with
// r < cu[0], r >= cu[batch], or r - cu[s] >= bound for the s with cu[s] <= r < cu[s + 1]; leaves every other
// row untouched.  row_bytes must be a multiple of 16 and the outputs 16-byte aligned.
ffi::Error ZeroUncoveredRows(const char *target, int arch, void *a, void *b, int64_t rows, int64_t row_bytes,
                             const int32_t *cu, int64_t batch, int32_t bound, cudaStream_t stream);

}  // namespace jps
