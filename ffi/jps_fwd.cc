// XLA FFI handlers for the jax_padsafe CuTe DSL forward kernels.
//
// Target "jax_padsafe_fwd" (platform CUDA), FFI API of the oldest supported jaxlib (0.10.2 -> 0.3).
//   initialize: loads the kernel modules for this device's architecture (once, behind a mutex).
//   execute:    validates shapes, zero-fills lse with a stream-ordered memset, picks the variant from the
//               compute capability and the call's static parameters, zeroes O where the kernel does not
//               write every row (a memset; under the sm90 kernel only the rows its tiles miss, or nothing
//               when rows_covered), zeroes the sm90 kernel's tile counter (a 4-byte scratch result) where
//               its compact schedule may run, launches.
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

#include "jps_fwd_args.h"
#include "jps_log_variant.h"
#include "jps_registry.h"  // generated: kJpsFwdVariants, kJpsNumFwdVariants
#include "jps_zero_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static thread_local cudaError_t g_load_error = cudaSuccess;
void jps_note_cuda_error(cudaError_t err) {
  if (err != cudaSuccess && g_load_error == cudaSuccess) g_load_error = err;
}

namespace {

constexpr int kMaxDevices = 64;
std::array<std::atomic<int>, kMaxDevices> g_arch_of_device{};  // 0: unknown, -1: unsupported
std::mutex g_load_mutex;
std::array<bool, 256> g_arch_loaded{};

// Which build serves a device: sm_90 runs the sm_90a build (the Hopper kernel family where built, else
// the SM80-class kernel),
// sm_80/86/87/89 the sm_80 build, sm_100/103 the sm_100a build, sm_120/121 the sm_120 build.
int ArchForCapability(int major, int minor) {
  switch (major) {
    case 8: return 80;
    case 9: return minor == 0 ? 90 : -1;
    case 10: return 100;
    case 12: return 120;
    default: return -1;
  }
}

ffi::Error DeviceArch(int *arch, int *device_out) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jax_padsafe: cudaGetDevice: ") + cudaGetErrorString(e));
  if (device < 0 || device >= kMaxDevices) return ffi::Error::Internal("jax_padsafe: device index out of range");
  int a = g_arch_of_device[device].load();
  if (a == 0) {
    int major = 0, minor = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (e != cudaSuccess) return ffi::Error::Internal(std::string("jax_padsafe: cudaDeviceGetAttribute: ") + cudaGetErrorString(e));
    a = ArchForCapability(major, minor);
    bool built = false;
    for (int i = 0; i < kJpsNumFwdVariants; ++i) built |= kJpsFwdVariants[i].arch == a;
    if (!built) a = -1;
    g_arch_of_device[device].store(a);
    if (a < 0)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "jax_padsafe: no CuTe kernels were built for compute capability " + std::to_string(major) +
                            "." + std::to_string(minor) + " (rebuild with JPS_ARCHS including it)");
  }
  if (a < 0) return ffi::Error(ffi::ErrorCode::kUnimplemented, "jax_padsafe: no CuTe kernels for this GPU's architecture");
  *arch = a;
  if (device_out) *device_out = device;
  return ffi::Error::Success();
}

ffi::Error LoadModulesFor(int arch) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_arch_loaded[arch]) return ffi::Error::Success();
  g_load_error = cudaSuccess;
  for (int i = 0; i < kJpsNumFwdVariants; ++i) {
    const JpsFwdVariant &v = kJpsFwdVariants[i];
    if (v.arch == arch) v.load(v.module);
  }
  JpsZeroRowsLoad(arch);
  if (g_load_error != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_padsafe: loading kernel modules failed: ") + cudaGetErrorString(g_load_error));
  g_arch_loaded[arch] = true;
  return ffi::Error::Success();
}

ffi::Error FwdInitialize(ffi::RemainingArgs, ffi::RemainingRets) {
  int arch = 0;
  if (ffi::Error e = DeviceArch(&arch, nullptr); e.failure()) return e;
  return LoadModulesFor(arch);
}

// JAX_PADSAFE_SM90=0 in the environment keeps the SM80-class kernel on Hopper even where the library has
// the sm90 family (A/B comparisons, a fallback should it misbehave); read once per process.
bool Sm90FamilyEnabled() {
  static const bool enabled = [] {
    const char *e = std::getenv("JAX_PADSAFE_SM90");
    return !(e && e[0] == '0');
  }();
  return enabled;
}

ffi::Error Invalid(const std::string &msg) { return ffi::Error::InvalidArgument("jax_padsafe_fwd: " + msg); }

ffi::Error FwdExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                      ffi::Buffer<ffi::S32> used_k, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                      float scale, float softcap, int32_t window_left, int32_t window_right, int32_t causal,
                      int32_t bottom_right, int32_t max_seqlen_q, int32_t rows_covered) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = o->dimensions(), ld = lse->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || od.size() != 3 || ld.size() != 2)
    return Invalid("expected q/k/v/o of rank 3 and lse of rank 2");
  const int64_t total_q = qd[0], N = qd[1], H = qd[2], total_k = kd[0], K = kd[1];
  if (kd[2] != H || vd[0] != total_k || vd[1] != K || vd[2] != H) return Invalid("k and v must be [total_k, K, H] with q's H");
  if (od[0] != total_q || od[1] != N || od[2] != H) return Invalid("o must have q's shape");
  if (ld[0] != N || ld[1] != total_q) return Invalid("lse must be [N, total_q]");
  if (tile_counter->element_count() < 1) return Invalid("tile_counter must have at least one element");
  if (K <= 0 || N % K != 0) return Invalid("num_heads must be a positive multiple of num_kv_heads");
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() || q.element_type() != o->element_type())
    return Invalid("q, k, v and o must share one dtype");
  int dtype;
  if (q.element_type() == ffi::BF16) dtype = 0;
  else if (q.element_type() == ffi::F16) dtype = 1;
  else return Invalid("dtype must be bfloat16 or float16");
  const int64_t B = used_q.element_count();
  if (cu_q.element_count() != B + 1 || cu_k.element_count() != B + 1 || used_k.element_count() != B)
    return Invalid("cu_seqlens_q/k must have batch+1 entries and seqused_q/k batch entries");
  if (total_q >= (int64_t(1) << 30) || total_k >= (int64_t(1) << 30) || max_seqlen_q < 0)
    return Invalid("lengths must be below 2**30");
  if (N > 65535 || B > 65535) return Invalid("num_heads and batch must be at most 65535");
  // scale > 0: the kernel folds it into exp2(s * scale * log2e - m * scale * log2e) with m the max of the raw
  // scores.  ops.flash_forward maps scale < 0 onto (-q, -scale) and scale == 0 onto (q = 0, scale 1).
  if (!(scale > 0.0f) || std::isinf(scale) || !(softcap >= 0.0f) || std::isinf(softcap))
    return Invalid("scale must be finite and > 0, softcap finite and >= 0");

  // Padding is zero by construction: lse starts as zeros and the kernel writes valid rows only.
  auto zero = [&](void *p, size_t bytes) -> ffi::Error {
    cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream);
    if (err != cudaSuccess) return ffi::Error::Internal(std::string("jax_padsafe_fwd: memset: ") + cudaGetErrorString(err));
    return ffi::Error::Success();
  };
  if (ffi::Error e = zero(lse->untyped_data(), lse->size_bytes()); e.failure()) return e;
  if (total_q == 0 || B == 0 || max_seqlen_q == 0 || N == 0) return zero(o->untyped_data(), o->size_bytes());

  int arch = 0;
  if (ffi::Error e = DeviceArch(&arch, nullptr); e.failure()) return e;
  if (ffi::Error e = LoadModulesFor(arch); e.failure()) return e;  // no-op once initialize ran
  const int cap = softcap > 0.0f ? 1 : 0;
  // Prefer the Hopper kernel family (1) where it was built for this combination, else the SM80-class one.
  const JpsFwdVariant *var = nullptr;
  const bool allow_sm90 = Sm90FamilyEnabled();
  for (int i = 0; i < kJpsNumFwdVariants; ++i) {
    const JpsFwdVariant &c = kJpsFwdVariants[i];
    if (c.arch != arch || c.dtype != dtype || c.head_dim != H || c.softcap != cap) continue;
    if (c.family == 1 && !allow_sm90) continue;
    // The sm90 kernel numbers its query tiles linearly in grid.x (ceil(max_seqlen_q / block_m) * N * B
    // blocks), which must stay below 2**31; the SM80-class kernel's 3-D grid has no such limit.
    if (c.family == 1 && (int64_t(max_seqlen_q) + c.block_m - 1) / c.block_m * N * B >= (int64_t(1) << 31) - 1) continue;
    if (!var || c.family > var->family) var = &c;
  }
  if (!var)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jax_padsafe_fwd: no kernel built for head_dim " + std::to_string(H) + ", dtype " +
                          (dtype ? "float16" : "bfloat16") + ", softcap " + std::to_string(cap) + " on sm_" + std::to_string(arch));

  // O: the sm90 family writes every row of its tiles up to the sequence's slot end
  // (cu_seqlens_q[b+1]), rows past the used length as zeros.  When the caller promises that those
  // tiles cover every row (rows_covered: the dense padded layout), that is all of O and its memset
  // (a full extra write of O, ~5% of a 2k forward) is skipped.  Otherwise (packed layouts) the
  // row-zeroing kernel writes zeros to the rows the tiles miss (lead, tail, slot rows past max_seqlen_q)
  // first; the SM80-class kernel writes valid rows only, so O is memset for it.
  const bool o_tiles_cover = var->family == 1 && rows_covered;
  const bool o_zero_rows = var->family == 1 && !rows_covered && JpsZeroRowsAvailable(arch);
  if (JpsPoisonOutputs() && (o_tiles_cover || o_zero_rows))
    if (cudaError_t err = cudaMemsetAsync(o->untyped_data(), 0xFF, o->size_bytes(), stream); err != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_padsafe_fwd: poison: ") + cudaGetErrorString(err));
  if (o_zero_rows) {
    int32_t rc = JpsZeroUncoveredRows(arch, o->untyped_data(), nullptr, total_q, N * H * 2, cu_q.typed_data(), B,
                                      max_seqlen_q, stream);
    if (rc != 0) return ffi::Error::Internal(std::string("jax_padsafe_fwd: row zeroing: ") + cudaGetErrorString((cudaError_t)rc));
  } else if (!o_tiles_cover) {
    if (ffi::Error e = zero(o->untyped_data(), o->size_bytes()); e.failure()) return e;
  }

  // The sm90 kernel's compact schedule (packed batches where the dense grid would be mostly empty tiles:
  // the same rule as kernels/bounds.use_compact_grid, whose int32 products stay in range under the
  // grid limit above) has persistent CTAs claim tiles from a counter, which must start at zero.  The
  // padded layout never takes it; any packed call zeroes the counter, whichever schedule runs.
  const bool may_be_compact =
      !rows_covered || 2 * (total_q / var->block_m + B) <= (int64_t(max_seqlen_q) + var->block_m - 1) / var->block_m * B;
  if (var->family == 1 && may_be_compact)
    if (ffi::Error e = zero(tile_counter->untyped_data(), sizeof(int32_t)); e.failure()) return e;

  const float log2e = 1.4426950408889634f;
  JpsFwdArgs a{};
  a.q = q.untyped_data(); a.k = k.untyped_data(); a.v = v.untyped_data(); a.o = o->untyped_data();
  a.lse = lse->typed_data();
  a.cu_q = cu_q.typed_data(); a.cu_k = cu_k.typed_data(); a.used_q = used_q.typed_data(); a.used_k = used_k.typed_data();
  a.total_q = (int32_t)total_q; a.total_k = (int32_t)total_k; a.num_heads = (int32_t)N; a.num_kv_heads = (int32_t)K;
  a.head_dim = (int32_t)H; a.batch = (int32_t)B;
  a.score_mul = cap ? scale / softcap : scale * log2e;
  a.cap_mul = cap ? softcap * log2e : 1.0f;
  a.window_left = window_left < 0 ? -1 : window_left;
  int32_t right = window_right < 0 ? -1 : window_right;
  if (causal) right = 0;  // causal: j <= i + off, i.e. min(right, 0) = 0 for any right >= 0
  a.window_right = right;
  a.bottom_right = bottom_right ? 1 : 0;
  a.max_seqlen_q = max_seqlen_q;
  a.tile_counter = tile_counter->typed_data();
  JpsLogVariantOnce(kJpsFwdVariants, var, "forward kernel");
  int32_t rc = var->launch(var->module, &a, stream);
  if (rc != 0) return ffi::Error::Internal(std::string("jax_padsafe_fwd: launch of ") + var->name + ": " + cudaGetErrorString((cudaError_t)rc));
  return ffi::Error::Success();
}

}  // namespace

#define JPS_EXPORT extern "C" __attribute__((visibility("default")))

JPS_EXPORT XLA_FFI_Error *jps_fwd_initialize(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_fwd_execute(XLA_FFI_CallFrame *call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_fwd_initialize, FwdInitialize,
                              ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_fwd_execute, FwdExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tile counter (scratch)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("max_seqlen_q")
                                  .Attr<int32_t>("rows_covered"),
                              {ffi::Traits::kCmdBufferCompatible});

// Introspection for Python (library_available / unsupported_reason): the built variant table.
JPS_EXPORT int jps_num_fwd_variants() { return kJpsNumFwdVariants; }
JPS_EXPORT int jps_fwd_variant(int i, int *arch, int *dtype, int *head_dim, int *softcap) {
  if (i < 0 || i >= kJpsNumFwdVariants) return -1;
  const JpsFwdVariant &v = kJpsFwdVariants[i];
  *arch = v.arch; *dtype = v.dtype; *head_dim = v.head_dim; *softcap = v.softcap;
  return 0;
}
JPS_EXPORT int jps_ffi_api_version(int *major, int *minor) {
  *major = XLA_FFI_API_MAJOR; *minor = XLA_FFI_API_MINOR;
  return 0;
}
