// XLA FFI handler for the jax_padsafe CuTe DSL backward kernels (jax_padsafe/kernels/bwd_sm80.py).
//
// Target "jax_padsafe_bwd" (platform CUDA), FFI API of the oldest supported jaxlib (0.10.2 -> 0.3).
//   initialize: loads the backward kernel modules for this device's architecture (once, mutex).
//   execute:    validates shapes; zero-fills the Delta workspace and dq, dk, dv (stream-ordered memsets:
//               padded rows are zero by construction, nothing is left to the allocator; under the sm90
//               kernels the gradients' memsets are skipped where the tiles cover every row, see rows_covered,
//               and otherwise replaced by zeroing only the rows the tiles miss, see jps_zero_rows.h); launches
//               preprocess (Delta), dK/dV (or, for variants with a `dk` entry, a dV pass then a dK pass),
//               dQ.  Families 0/1: no atomics on results, no fp32 global accumulator (family 1's compact
//               schedules hand out tiles through an atomic counter, `tile_counters`, zeroed here: that
//               changes which CTA computes a tile, never how).  Family 2 (fused dQ, chosen when
//               the caller passes a large enough `dq_workspace`): the dK/dV kernel adds fp32 dQ partials
//               into the zero-filled workspace in a fixed order (semaphores), then `dq` converts it; every
//               mode is deterministic (bitwise reproducible) either way.
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

#include "jps_bwd_args.h"
#include "jps_log_variant.h"
#include "jps_bwd_registry.h"  // generated: kJpsBwdVariants, kJpsNumBwdVariants
#include "jps_zero_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::mutex g_bwd_mutex;
std::array<bool, 256> g_bwd_loaded{};

ffi::Error BwdArch(int *arch) {
  int device = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jax_padsafe_bwd: device query: ") + cudaGetErrorString(e));
  int a = -1;
  switch (major) {  // same mapping as the forward (jps_fwd.cc)
    case 8: a = 80; break;
    case 9: a = minor == 0 ? 90 : -1; break;
    case 10: a = 100; break;
    case 12: a = 120; break;
    default: a = -1;
  }
  bool built = false;
  for (int i = 0; i < kJpsNumBwdVariants; ++i) built |= kJpsBwdVariants[i].arch == a;
  if (a < 0 || !built)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jax_padsafe_bwd: no CuTe backward kernels were built for compute capability " +
                          std::to_string(major) + "." + std::to_string(minor));
  *arch = a;
  return ffi::Error::Success();
}

ffi::Error BwdLoad(int arch) {
  std::lock_guard<std::mutex> lock(g_bwd_mutex);
  if (g_bwd_loaded[arch]) return ffi::Error::Success();
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < kJpsNumBwdVariants; ++i) {
    const JpsBwdVariant &v = kJpsBwdVariants[i];
    if (v.arch != arch) continue;
    v.load();
  }
  JpsZeroRowsLoad(arch);
  (void)err;
  // Load errors go through jps_note_cuda_error (jps_fwd.cc); a failed load shows up as a launch error.
  g_bwd_loaded[arch] = true;
  return ffi::Error::Success();
}

ffi::Error BwdInitialize(ffi::RemainingArgs, ffi::RemainingRets) {
  int arch = 0;
  if (ffi::Error e = BwdArch(&arch); e.failure()) return e;
  return BwdLoad(arch);
}

ffi::Error Invalid(const std::string &msg) { return ffi::Error::InvalidArgument("jax_padsafe_bwd: " + msg); }

// The fused-dQ family (2) runs only when the caller passes its workspace (bwd_ops requests one only with
// JAX_PADSAFE_FUSED_DQ=1: opt-in).  JAX_PADSAFE_FUSED_DQ=0 here also refuses it when a workspace is passed;
// read once per process.
bool FusedDqEnabled() {
  static const bool enabled = [] {
    const char *e = std::getenv("JAX_PADSAFE_FUSED_DQ");
    return !(e && e[0] == '0');
  }();
  return enabled;
}

// JAX_PADSAFE_SM90_BWD=0 in the environment keeps the SM80-class backward on Hopper even where the library
// has the sm90 backward family (A/B comparisons, a fallback should it misbehave); read once per process.
bool Sm90BwdFamilyEnabled() {
  static const bool enabled = [] {
    const char *e = std::getenv("JAX_PADSAFE_SM90_BWD");
    return !(e && e[0] == '0');
  }();
  return enabled;
}

ffi::Error BwdExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                      ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                      ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                      ffi::Buffer<ffi::S32> used_k, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                      ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                      ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace,
                      ffi::Result<ffi::Buffer<ffi::S32>> tile_counters, float scale,
                      float softcap, int32_t window_left, int32_t window_right, int32_t causal, int32_t bottom_right,
                      int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t deterministic, int32_t rows_covered) {
  (void)deterministic;  // this design is deterministic in every mode (no atomics)
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 3) return Invalid("expected q/k/v of rank 3");
  const int64_t total_q = qd[0], N = qd[1], H = qd[2], total_k = kd[0], K = kd[1];
  auto same3 = [](auto d, int64_t a, int64_t b, int64_t c) { return d.size() == 3 && d[0] == a && d[1] == b && d[2] == c; };
  auto same2 = [](auto d, int64_t a, int64_t b) { return d.size() == 2 && d[0] == a && d[1] == b; };
  if (!same3(k.dimensions(), total_k, K, H) || !same3(v.dimensions(), total_k, K, H)) return Invalid("k and v must be [total_k, K, H] with q's H");
  if (!same3(o.dimensions(), total_q, N, H) || !same3(dout.dimensions(), total_q, N, H) || !same3(dq->dimensions(), total_q, N, H))
    return Invalid("o, do and dq must have q's shape");
  if (!same3(dk->dimensions(), total_k, K, H) || !same3(dv->dimensions(), total_k, K, H)) return Invalid("dk, dv must have k's shape");
  if (!same2(lse.dimensions(), N, total_q) || !same2(dlse.dimensions(), N, total_q) || !same2(delta->dimensions(), N, total_q))
    return Invalid("lse, dlse and the Delta workspace must be [N, total_q]");
  if (K <= 0 || N % K != 0) return Invalid("num_heads must be a positive multiple of num_kv_heads");
  if (tile_counters->element_count() < 2) return Invalid("tile_counters must have at least two elements");
  auto et = q.element_type();
  if (k.element_type() != et || v.element_type() != et || o.element_type() != et || dout.element_type() != et ||
      dq->element_type() != et || dk->element_type() != et || dv->element_type() != et)
    return Invalid("q, k, v, o, do, dq, dk, dv must share one dtype");
  int dtype;
  if (et == ffi::BF16) dtype = 0;
  else if (et == ffi::F16) dtype = 1;
  else return Invalid("dtype must be bfloat16 or float16");
  const int64_t B = used_q.element_count();
  if (cu_q.element_count() != B + 1 || cu_k.element_count() != B + 1 || used_k.element_count() != B)
    return Invalid("cu_seqlens_q/k must have batch+1 entries and seqused_q/k batch entries");
  if (total_q >= (int64_t(1) << 30) || total_k >= (int64_t(1) << 30) || max_seqlen_q < 0 || max_seqlen_k < 0)
    return Invalid("lengths must be below 2**30");
  if (N > 65535 || B > 65535) return Invalid("num_heads and batch must be at most 65535");
  if (!(scale > 0.0f) || std::isinf(scale) || !(softcap >= 0.0f) || std::isinf(softcap))
    return Invalid("scale must be finite and > 0, softcap finite and >= 0");

  // Padded rows stay exactly 0 and nothing comes from the allocator: the Delta workspace is always
  // zeroed; dq/dk/dv are zeroed unless the chosen kernels write every row themselves (below).
  auto zero = [&](void *p, size_t bytes) -> ffi::Error {
    cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream);
    if (err != cudaSuccess) return ffi::Error::Internal(std::string("jax_padsafe_bwd: memset: ") + cudaGetErrorString(err));
    return ffi::Error::Success();
  };
  auto zero_grads = [&]() -> ffi::Error {
    if (ffi::Error e = zero(dq->untyped_data(), dq->size_bytes()); e.failure()) return e;
    if (ffi::Error e = zero(dk->untyped_data(), dk->size_bytes()); e.failure()) return e;
    return zero(dv->untyped_data(), dv->size_bytes());
  };
  if (ffi::Error e = zero(delta->untyped_data(), delta->size_bytes()); e.failure()) return e;
  if (total_q == 0 || total_k == 0 || B == 0 || N == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) return zero_grads();

  int arch = 0;
  if (ffi::Error e = BwdArch(&arch); e.failure()) return e;
  if (ffi::Error e = BwdLoad(arch); e.failure()) return e;
  const int cap = softcap > 0.0f ? 1 : 0;
  // Prefer the fused-dQ Hopper family (2) where it was built and the caller gave it a large enough fp32
  // workspace (dQ accumulator + one semaphore per (sequence, head, 64-query tile)), then the Hopper family
  // (1), else the SM80-class one.
  const int64_t sem_count = B * N * ((int64_t(max_seqlen_q) + 63) / 64);
  const int64_t accum_count = total_q * N * H;
  const bool fused_fits = dq_workspace->element_count() >= accum_count + sem_count && sem_count < (int64_t(1) << 31);
  const JpsBwdVariant *var = nullptr;
  const bool allow_sm90 = Sm90BwdFamilyEnabled();
  const bool allow_fused = allow_sm90 && fused_fits && FusedDqEnabled();
  for (int i = 0; i < kJpsNumBwdVariants; ++i) {
    const JpsBwdVariant &c = kJpsBwdVariants[i];
    if (c.arch != arch || c.dtype != dtype || c.head_dim != H || c.softcap != cap) continue;
    if (c.family == 1 && !allow_sm90) continue;
    if (c.family == 2 && !allow_fused) continue;
    if (!var || c.family > var->family) var = &c;
  }
  if (!var)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jax_padsafe_bwd: no backward kernel built for head_dim " + std::to_string(H) + ", dtype " +
                          (dtype ? "float16" : "bfloat16") + ", softcap " + std::to_string(cap) + " on sm_" + std::to_string(arch));

  // The sm90 family writes every row of its dQ and dK/dV tiles up to the sequence's slot end
  // (cu_seqlens[b+1]), rows past the used length and tiles nothing sees as zeros.  When the caller
  // promises those tiles cover every row (rows_covered: the dense padded layout), the three memsets
  // (a full extra write of each gradient) are skipped.  Otherwise (packed layouts) the row-zeroing kernel
  // writes zeros to only the rows the tiles miss (lead, tail, slot rows past max_seqlen), before the kernels
  // run: the memsets' result for a fraction of their writes.
  // Family 2 writes every dq row itself (the conversion covers [0, total_q), and the zero-filled accumulator
  // only ever receives exact zeros outside the valid rows), so dq is never memset; its workspace always is.
  const bool fused = var->family == 2;
  const bool sm90 = var->family == 1 || fused;
  const bool zero_rows = sm90 && !rows_covered && JpsZeroRowsAvailable(arch);
  auto zero_missed_rows = [&](void *a, void *b, int64_t rows, int64_t heads, const int32_t *cu, int32_t bound) -> ffi::Error {
    int32_t rc = JpsZeroUncoveredRows(arch, a, b, rows, heads * H * 2, cu, B, bound, stream);
    if (rc != 0) return ffi::Error::Internal(std::string("jax_padsafe_bwd: row zeroing: ") + cudaGetErrorString((cudaError_t)rc));
    return ffi::Error::Success();
  };
  if (fused)
    if (ffi::Error e = zero(dq_workspace->untyped_data(), size_t(accum_count + sem_count) * 4); e.failure()) return e;
  if (JpsPoisonOutputs()) {  // test hook (jps_zero_rows.h): outputs no memset covers start as NaN
    auto poison = [&](ffi::Result<ffi::AnyBuffer> &x) -> ffi::Error {
      cudaError_t err = cudaMemsetAsync(x->untyped_data(), 0xFF, x->size_bytes(), stream);
      if (err != cudaSuccess) return ffi::Error::Internal(std::string("jax_padsafe_bwd: poison: ") + cudaGetErrorString(err));
      return ffi::Error::Success();
    };
    if (fused || (sm90 && (rows_covered || zero_rows)))
      if (ffi::Error e = poison(dq); e.failure()) return e;
    if (sm90 && (rows_covered || zero_rows)) {
      if (ffi::Error e = poison(dk); e.failure()) return e;
      if (ffi::Error e = poison(dv); e.failure()) return e;
    }
  }
  if (!fused && zero_rows) {  // (the fused family's dq is written whole by its conversion kernel)
    if (ffi::Error e = zero_missed_rows(dq->untyped_data(), nullptr, total_q, N, cu_q.typed_data(), max_seqlen_q); e.failure()) return e;
  } else if (!fused && !(rows_covered && sm90)) {
    if (ffi::Error e = zero(dq->untyped_data(), dq->size_bytes()); e.failure()) return e;
  }
  if (zero_rows) {
    if (ffi::Error e = zero_missed_rows(dk->untyped_data(), dv->untyped_data(), total_k, K, cu_k.typed_data(), max_seqlen_k); e.failure()) return e;
  } else if (!(rows_covered && sm90)) {
    if (ffi::Error e = zero(dk->untyped_data(), dk->size_bytes()); e.failure()) return e;
    if (ffi::Error e = zero(dv->untyped_data(), dv->size_bytes()); e.failure()) return e;
  }

  // The sm90 kernels' compact schedules (packed batches where the dense grid would be mostly empty tiles:
  // the rule of kernels/bounds.use_compact_grid, per kernel, in int64) run persistent CTAs that claim
  // their tiles from a counter, which must start at zero.  Any call that may take either compact schedule
  // zeroes both counters, whichever schedule runs; the padded layout needs them only where a kernel queues
  // every layout (`queue_all`).
  if (var->family == 1) {
    auto compact = [&](int64_t total, int32_t max_seqlen, int64_t block) {
      return block > 0 && 2 * (total / block + B) <= (int64_t(max_seqlen) + block - 1) / block * B;
    };
    if (!rows_covered || var->queue_all != 0 || compact(total_k, max_seqlen_k, var->dkdv_block_n) ||
        compact(total_q, max_seqlen_q, var->dq_block_m))
      if (ffi::Error e = zero(tile_counters->untyped_data(), 2 * sizeof(int32_t)); e.failure()) return e;
  }

  const float log2e = 1.4426950408889634f;
  JpsBwdArgs a{};
  a.q = q.untyped_data(); a.k = k.untyped_data(); a.v = v.untyped_data(); a.o = o.untyped_data();
  a.dout = dout.untyped_data(); a.lse = lse.typed_data(); a.dlse = dlse.typed_data(); a.delta = delta->typed_data();
  a.dq = dq->untyped_data(); a.dk = dk->untyped_data(); a.dv = dv->untyped_data();
  a.cu_q = cu_q.typed_data(); a.cu_k = cu_k.typed_data(); a.used_q = used_q.typed_data(); a.used_k = used_k.typed_data();
  a.total_q = (int32_t)total_q; a.total_k = (int32_t)total_k; a.num_heads = (int32_t)N; a.num_kv_heads = (int32_t)K;
  a.head_dim = (int32_t)H; a.batch = (int32_t)B;
  a.score_mul = cap ? scale / softcap : scale * log2e;
  a.cap_mul = cap ? softcap * log2e : 1.0f;
  a.dscale = scale;
  a.window_left = window_left < 0 ? -1 : window_left;
  int32_t right = window_right < 0 ? -1 : window_right;
  if (causal) right = 0;
  a.window_right = right;
  a.bottom_right = bottom_right ? 1 : 0;
  a.max_seqlen_q = max_seqlen_q;
  a.max_seqlen_k = max_seqlen_k;
  a.tile_counters = tile_counters->typed_data();
  if (fused) {
    a.dq_accum = dq_workspace->typed_data();
    a.dq_sem = reinterpret_cast<int32_t *>(dq_workspace->typed_data() + accum_count);
    a.dq_sem_count = (int32_t)sem_count;
  }
  JpsLogVariantOnce(kJpsBwdVariants, var, "backward kernels");
  int32_t rc = var->pre(var->pre_module, &a, stream);
  if (rc == 0) rc = var->dkdv(var->dkdv_module, &a, stream);              // dK and dV, or the dV pass
  if (rc == 0 && var->dk) rc = var->dk(var->dk_module, &a, stream);       // the dK pass (head_dim > 128)
  if (rc == 0) rc = var->dq(var->dq_module, &a, stream);
  if (rc != 0) return ffi::Error::Internal(std::string("jax_padsafe_bwd: launch of ") + var->name + ": " + cudaGetErrorString((cudaError_t)rc));
  return ffi::Error::Success();
}

}  // namespace

#define JPS_EXPORT extern "C" __attribute__((visibility("default")))

JPS_EXPORT XLA_FFI_Error *jps_bwd_initialize(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_bwd_execute(XLA_FFI_CallFrame *call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_bwd_initialize, BwdInitialize,
                              ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_bwd_execute, BwdExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // q
                                  .Arg<ffi::AnyBuffer>()             // k
                                  .Arg<ffi::AnyBuffer>()             // v
                                  .Arg<ffi::AnyBuffer>()             // o
                                  .Arg<ffi::Buffer<ffi::F32>>()      // lse
                                  .Arg<ffi::AnyBuffer>()             // do
                                  .Arg<ffi::Buffer<ffi::F32>>()      // dlse
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()             // dq
                                  .Ret<ffi::AnyBuffer>()             // dk
                                  .Ret<ffi::AnyBuffer>()             // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()      // Delta workspace
                                  .Ret<ffi::Buffer<ffi::F32>>()      // fused-dQ workspace (may be empty)
                                  .Ret<ffi::Buffer<ffi::S32>>()      // tile counters (scratch, [2])
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("max_seqlen_q")
                                  .Attr<int32_t>("max_seqlen_k")
                                  .Attr<int32_t>("deterministic")
                                  .Attr<int32_t>("rows_covered"),
                              {ffi::Traits::kCmdBufferCompatible});

JPS_EXPORT int jps_num_bwd_variants() { return kJpsNumBwdVariants; }
JPS_EXPORT int jps_bwd_variant(int i, int *arch, int *dtype, int *head_dim, int *softcap) {
  if (i < 0 || i >= kJpsNumBwdVariants) return -1;
  const JpsBwdVariant &v = kJpsBwdVariants[i];
  *arch = v.arch; *dtype = v.dtype; *head_dim = v.head_dim; *softcap = v.softcap;
  return 0;
}
