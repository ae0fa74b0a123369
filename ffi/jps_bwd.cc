// XLA FFI handlers of the backward kernels: targets "jax_padsafe_bwd" and, for masks and biases given as
// tensors, "jax_padsafe_bwd_aux" and the bias gradient "jax_padsafe_bwd_dbias" (platform CUDA), FFI API of the
// oldest supported jaxlib (0.10.2 -> 0.3).
//   initialize: loads the backward and row-zeroing kernel modules of this device's architecture (once).
//   execute:    checks the arguments; zero-fills the Delta workspace; picks the variant; gives dq, dk and dv
//               their zeros (common.h: OutputZeroing); zeroes the Hopper kernels' tile counters where a compact
//               schedule may run; launches preprocess (Delta), dK/dV (or, for variants with a `dk` entry, a dV
//               pass then a dK pass), dQ.  No kernel accumulates a result with atomics (the compact schedules
//               hand out tiles through an atomic counter: that changes which CTA computes a tile, never how),
//               so every call is deterministic (bitwise reproducible) and `deterministic` costs nothing.
#include "aux.h"
#include "common.h"
#include "jps_bwd_args.h"
#include "jps_bwd_registry.h"  // generated: kJpsBwdVariants, kJpsNumBwdVariants

namespace {

namespace ffi = xla::ffi;
constexpr const char *kTarget = "jax_padsafe_bwd";
constexpr const char *kAuxTarget = "jax_padsafe_bwd_aux";
constexpr const char *kDBiasTarget = "jax_padsafe_bwd_dbias";

jps::ArchLoader g_loader;

// Each entry's loader loads all of its modules (preprocess, dK/dV or dV + dK, dQ).
ffi::Error LoadBackwardModules(int arch) {
  for (int i = 0; i < kJpsNumBwdVariants; ++i) {
    const JpsBwdVariant &v = kJpsBwdVariants[i];
    if (v.arch != arch) continue;
    if (ffi::Error e = jps::LoadChecked(kTarget, v.name, v.load); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error LoadModules(int arch) {
  if (ffi::Error e = g_loader.Load(arch, [arch] { return LoadBackwardModules(arch); }); e.failure()) return e;
  return jps::LoadZeroRowsKernels(kTarget, arch);
}

ffi::Error CurrentArch(int *arch) {
  return jps::ArchWithKernels(kTarget, "backward", kJpsBwdVariants, kJpsNumBwdVariants, arch);
}

ffi::Error BwdInitialize(ffi::RemainingArgs, ffi::RemainingRets) {
  int arch = 0;
  if (ffi::Error e = CurrentArch(&arch); e.failure()) return e;
  return LoadModules(arch);
}

// The aux target's extra operands: the aux inputs and the forward's exact row statistics.
struct AuxBackward {
  jps::AuxOperands operands;
  const ffi::Buffer<ffi::F32> *row_max, *log_sum;
};

ffi::Error Backward(const char *target, cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                    ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                    ffi::Buffer<ffi::S32> used_k, ffi::Result<ffi::AnyBuffer> &dq, ffi::Result<ffi::AnyBuffer> &dk,
                    ffi::Result<ffi::AnyBuffer> &dv, ffi::Result<ffi::Buffer<ffi::F32>> &delta,
                    ffi::Result<ffi::Buffer<ffi::S32>> &tile_counters, float scale, float softcap, int32_t window_left,
                    int32_t window_right, int32_t causal, int32_t bottom_right, int32_t max_seqlen_q,
                    int32_t max_seqlen_k, int32_t rows_covered, int32_t partial_keys, const AuxBackward *aux) {
  jps::Problem p{};
  if (ffi::Error e = jps::CheckProblem(target, q, k, v, cu_q, cu_k, used_q, used_k, scale, softcap, max_seqlen_q,
                                       max_seqlen_k, &p);
      e.failure())
    return e;
  int32_t aux_flags = 0;
  if (aux) {
    if (ffi::Error e = jps::CheckAux(target, p, q.element_type(), aux->operands, bottom_right, &aux_flags); e.failure()) return e;
    p.aux = jps::AuxKind(aux_flags);
    if (!jps::HasShape(aux->row_max->dimensions(), p.num_heads, p.total_q) ||
        !jps::HasShape(aux->log_sum->dimensions(), p.num_heads, p.total_q))
      return jps::InvalidArgument(target, "the row statistics must be [N, total_q]");
  }
  const int64_t total_q = p.total_q, total_k = p.total_k, N = p.num_heads, K = p.num_kv_heads, H = p.head_dim, B = p.batch;
  const ffi::DataType et = q.element_type();
  auto like_q = [&](const auto &x) { return jps::HasShape(x.dimensions(), total_q, N, H) && x.element_type() == et; };
  auto like_k = [&](const auto &x) { return jps::HasShape(x.dimensions(), total_k, K, H) && x.element_type() == et; };
  if (!like_q(o) || !like_q(dout) || !like_q(*dq)) return jps::InvalidArgument(target, "o, do and dq must have q's shape and dtype");
  if (!like_k(*dk) || !like_k(*dv)) return jps::InvalidArgument(target, "dk and dv must have k's shape and dtype");
  if (!jps::HasShape(lse.dimensions(), N, total_q) || !jps::HasShape(dlse.dimensions(), N, total_q) ||
      !jps::HasShape(delta->dimensions(), N, total_q))
    return jps::InvalidArgument(target, "lse, dlse and the Delta workspace must be [N, total_q]");
  if (tile_counters->element_count() < 2) return jps::InvalidArgument(target, "tile_counters must have at least two elements");

  auto zero = [&](void *ptr, size_t bytes) { return jps::Zero(target, stream, ptr, bytes); };
  if (ffi::Error e = zero(delta->untyped_data(), delta->size_bytes()); e.failure()) return e;
  if (total_q == 0 || total_k == 0 || B == 0 || N == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    if (ffi::Error e = zero(dq->untyped_data(), dq->size_bytes()); e.failure()) return e;
    if (ffi::Error e = zero(dk->untyped_data(), dk->size_bytes()); e.failure()) return e;
    return zero(dv->untyped_data(), dv->size_bytes());
  }

  int arch = 0;
  if (ffi::Error e = CurrentArch(&arch); e.failure()) return e;
  if (ffi::Error e = LoadModules(arch); e.failure()) return e;  // a no-op once initialize ran
  const JpsBwdVariant *var = nullptr;
  if (ffi::Error e = jps::FindVariant(target, "backward", kJpsBwdVariants, kJpsNumBwdVariants, arch, p,
                                      [](const JpsBwdVariant &) { return true; }, &var);
      e.failure())
    return e;

  const jps::OutputZeroing zeroing = jps::ChooseOutputZeroing(var->family, rows_covered != 0, arch);
  if (zeroing != jps::OutputZeroing::kMemset)
    for (ffi::Result<ffi::AnyBuffer> *x : {&dq, &dk, &dv})
      if (ffi::Error e = jps::Poison(target, stream, (*x)->untyped_data(), (*x)->size_bytes()); e.failure()) return e;
  if (zeroing == jps::OutputZeroing::kZeroUncoveredRows) {
    if (ffi::Error e = jps::ZeroUncoveredRows(target, arch, dq->untyped_data(), nullptr, total_q, N * H * 2,
                                              cu_q.typed_data(), B, max_seqlen_q, stream);
        e.failure())
      return e;
    if (ffi::Error e = jps::ZeroUncoveredRows(target, arch, dk->untyped_data(), dv->untyped_data(), total_k, K * H * 2,
                                              cu_k.typed_data(), B, max_seqlen_k, stream);
        e.failure())
      return e;
  } else if (zeroing == jps::OutputZeroing::kMemset) {
    for (ffi::Result<ffi::AnyBuffer> *x : {&dq, &dk, &dv})
      if (ffi::Error e = zero((*x)->untyped_data(), (*x)->size_bytes()); e.failure()) return e;
  }
  // Any call that may take either kernel's compact schedule zeroes both counters, whichever schedule runs; the
  // padded layout needs them only where a kernel queues every layout (`queue_all`).
  if (var->family == 1 && (!rows_covered || var->queue_all != 0 ||
                           jps::CompactScheduleMayRun(total_k, max_seqlen_k, var->dkdv_block_n, B) ||
                           jps::CompactScheduleMayRun(total_q, max_seqlen_q, var->dq_block_m, B)))
    if (ffi::Error e = zero(tile_counters->untyped_data(), 2 * sizeof(int32_t)); e.failure()) return e;

  JpsBwdArgs a{};
  jps::FillCommonArgs(&a, p, q, k, v, cu_q, cu_k, used_q, used_k, scale, softcap, window_left, window_right, causal,
                      bottom_right, max_seqlen_q);
  a.o = o.untyped_data();
  a.dout = dout.untyped_data();
  a.lse = lse.typed_data();
  a.dlse = dlse.typed_data();
  a.delta = delta->typed_data();
  a.dq = dq->untyped_data();
  a.dk = dk->untyped_data();
  a.dv = dv->untyped_data();
  a.dscale = scale;
  a.max_seqlen_k = max_seqlen_k;
  a.partial_keys = partial_keys != 0;
  a.tile_counters = tile_counters->typed_data();
  if (aux) {
    jps::FillAuxArgs(&a, aux->operands, aux_flags, const_cast<float *>(aux->row_max->typed_data()),
                     const_cast<float *>(aux->log_sum->typed_data()));
    // The bias kind forms natural-unit scores q.k * scale + bias (aux_scores.scores); the mask kind keeps the
    // plain kernels' scores and their score_mul.
    if (p.aux == jps::kAuxKindBias) a.score_mul = scale;
  }
  // The dQ kernel, last, leaves rowsum(P dP) of the P and dP it recomputes in the Delta workspace (kernels/common/
  // dq_shift.py), for the bias and sinks gradients; not where partial_keys.
  int32_t rc = var->pre(var->pre_module, &a, stream);
  if (rc == 0) rc = var->dkdv(var->dkdv_module, &a, stream);         // dK and dV, or the dV pass
  if (rc == 0 && var->dk) rc = var->dk(var->dk_module, &a, stream);  // the dK pass (head_dim > 128, SM80-class)
  if (rc == 0) rc = var->dq(var->dq_module, &a, stream);
  if (rc != 0) return jps::CudaError(target, std::string("launch of ") + var->name, cudaError_t(rc));
  return ffi::Error::Success();
}

ffi::Error BwdExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                      ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                      ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                      ffi::Buffer<ffi::S32> used_k, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                      ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                      ffi::Result<ffi::Buffer<ffi::S32>> tile_counters, float scale, float softcap,
                      int32_t window_left, int32_t window_right, int32_t causal, int32_t bottom_right,
                      int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t /*deterministic: always*/,
                      int32_t rows_covered, int32_t partial_keys) {
  return Backward(kTarget, stream, q, k, v, o, lse, dout, dlse, cu_q, cu_k, used_q, used_k, dq, dk, dv, delta,
                  tile_counters, scale, softcap, window_left, window_right, causal, bottom_right, max_seqlen_q,
                  max_seqlen_k, rows_covered, partial_keys, nullptr);
}

ffi::Error BwdAuxExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                         ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> dlse,
                         ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                         ffi::Buffer<ffi::S32> used_k, ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::AnyBuffer tile_map,
                         ffi::AnyBuffer row_range, ffi::AnyBuffer col_range, ffi::AnyBuffer slopes,
                         ffi::Buffer<ffi::F32> row_max, ffi::Buffer<ffi::F32> log_sum, ffi::Result<ffi::AnyBuffer> dq,
                         ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                         ffi::Result<ffi::Buffer<ffi::S32>> tile_counters, float scale, float softcap,
                         int32_t window_left, int32_t window_right, int32_t causal, int32_t bottom_right,
                         int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t /*deterministic: always*/,
                         int32_t rows_covered, int32_t has_mask, int32_t has_bias, int32_t has_alibi) {
  const AuxBackward aux{{&mask, &bias, &tile_map, &row_range, &col_range, &slopes, has_mask != 0, has_bias != 0,
                         has_alibi != 0},
                        &row_max, &log_sum};
  return Backward(kAuxTarget, stream, q, k, v, o, lse, dout, dlse, cu_q, cu_k, used_q, used_k, dq, dk, dv, delta,
                  tile_counters, scale, softcap, window_left, window_right, causal, bottom_right, max_seqlen_q,
                  max_seqlen_k, rows_covered, /*partial_keys=*/0, &aux);
}

// dbias, the bias gradient, summed over the bias's broadcast batch and head dimensions.  A target of its own (not
// a result of the backward) so that XLA drops it wherever the bias gets no gradient.  It takes the backward's
// Delta and the forward's exact row statistics and recomputes dS per visible tile; every cell of dbias is
// written by one CTA (the kernel loops over the (sequence, head) pairs of its bias slice in a fixed order), so
// it needs no memset and is deterministic.
ffi::Error DBiasExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> cu_q,
                        ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q, ffi::Buffer<ffi::S32> used_k,
                        ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::AnyBuffer tile_map, ffi::AnyBuffer row_range,
                        ffi::AnyBuffer col_range, ffi::AnyBuffer slopes, ffi::Buffer<ffi::F32> row_max,
                        ffi::Buffer<ffi::F32> log_sum, ffi::Result<ffi::AnyBuffer> dbias, float scale,
                        int32_t window_left, int32_t window_right, int32_t causal, int32_t bottom_right,
                        int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t has_mask, int32_t has_alibi) {
  const char *target = kDBiasTarget;
  jps::Problem p{};
  if (ffi::Error e = jps::CheckProblem(target, q, k, v, cu_q, cu_k, used_q, used_k, scale, 0.0f, max_seqlen_q,
                                       max_seqlen_k, &p);
      e.failure())
    return e;
  int32_t aux_flags = 0;
  const jps::AuxOperands ops{&mask, &bias, &tile_map, &row_range, &col_range, &slopes, has_mask != 0, true,
                             has_alibi != 0};
  if (ffi::Error e = jps::CheckAux(target, p, q.element_type(), ops, bottom_right, &aux_flags); e.failure()) return e;
  p.aux = jps::kAuxKindBias;
  const int64_t total_q = p.total_q, N = p.num_heads, H = p.head_dim, B = p.batch;
  const int64_t T = total_q / B, S = p.total_k / B;
  auto bd = bias.dimensions();
  if (bd[2] != T)
    return jps::InvalidArgument(target, "the bias gradient needs a bias with a row per query ([Bx, Hx, T, S])");
  auto dd = dbias->dimensions();
  if (dbias->element_type() != bias.element_type() || dd.size() != 4 || dd[0] != bd[0] || dd[1] != bd[1] ||
      dd[2] != bd[2] || dd[3] != bd[3])
    return jps::InvalidArgument(target, "dbias must have the bias's shape and dtype");
  if (!jps::HasShape(dout.dimensions(), total_q, N, H) || dout.element_type() != q.element_type())
    return jps::InvalidArgument(target, "do must have q's shape and dtype");
  for (const ffi::Buffer<ffi::F32> *x : {&delta, &row_max, &log_sum})
    if (!jps::HasShape(x->dimensions(), N, total_q))
      return jps::InvalidArgument(target, "Delta and the row statistics must be [N, total_q]");
  if (dbias->size_bytes() == 0) return ffi::Error::Success();
  if (total_q == 0 || p.total_k == 0 || N == 0) return jps::Zero(target, stream, dbias->untyped_data(), dbias->size_bytes());

  int arch = 0;
  if (ffi::Error e = CurrentArch(&arch); e.failure()) return e;
  if (ffi::Error e = LoadModules(arch); e.failure()) return e;
  const JpsBwdVariant *var = nullptr;
  if (ffi::Error e = jps::FindVariant(target, "backward", kJpsBwdVariants, kJpsNumBwdVariants, arch, p,
                                      [](const JpsBwdVariant &x) { return x.dbias != nullptr; }, &var);
      e.failure())
    return e;

  JpsBwdArgs a{};
  jps::FillCommonArgs(&a, p, q, k, v, cu_q, cu_k, used_q, used_k, scale, 0.0f, window_left, window_right, causal,
                      bottom_right, int32_t(T));
  a.dout = dout.untyped_data();
  a.delta = const_cast<float *>(delta.typed_data());
  a.max_seqlen_k = int32_t(S);
  jps::FillAuxArgs(&a, ops, aux_flags, const_cast<float *>(row_max.typed_data()),
                   const_cast<float *>(log_sum.typed_data()));
  a.score_mul = scale;  // natural-unit scores, as the bias kind's other kernels
  // dbias takes the bias's slot: the live one its dims, the other the placeholder (never written).
  a.dbias = a.dbias32 = dbias->untyped_data();
  for (int i = 0; i < 4; ++i) {
    a.dbias_dims[i] = a.bias_dims[i];
    a.dbias32_dims[i] = a.bias32_dims[i];
  }
  const int32_t rc = var->dbias(var->dbias_module, &a, stream);
  if (rc != 0) return jps::CudaError(target, std::string("launch of ") + var->name + "_dbias", cudaError_t(rc));
  return ffi::Error::Success();
}

}  // namespace

JPS_EXPORT XLA_FFI_Error *jps_bwd_initialize(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_bwd_dbias_execute(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_bwd_execute(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_bwd_aux_execute(XLA_FFI_CallFrame *call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_bwd_initialize, BwdInitialize, ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets());

// Command-buffer compatible: execute only enqueues memsets and kernel launches on the stream (the modules are
// loaded in initialize, and the device's capability was queried there).
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
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_k
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_k
                                  .Ret<ffi::AnyBuffer>()             // dq
                                  .Ret<ffi::AnyBuffer>()             // dk
                                  .Ret<ffi::AnyBuffer>()             // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()      // Delta workspace [N, total_q]
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
                                  .Attr<int32_t>("rows_covered")
                                  .Attr<int32_t>("partial_keys"),
                              {ffi::Traits::kCmdBufferCompatible});

// The aux target (initialize: jps_bwd_initialize, which loads every backward module of the arch).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_bwd_aux_execute, BwdAuxExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // q
                                  .Arg<ffi::AnyBuffer>()             // k
                                  .Arg<ffi::AnyBuffer>()             // v
                                  .Arg<ffi::AnyBuffer>()             // o
                                  .Arg<ffi::Buffer<ffi::F32>>()      // lse
                                  .Arg<ffi::AnyBuffer>()             // do
                                  .Arg<ffi::Buffer<ffi::F32>>()      // dlse
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_k
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_k
                                  .Arg<ffi::AnyBuffer>()             // mask [Bx, Hx, Tx, S] bool
                                  .Arg<ffi::AnyBuffer>()             // bias [Bx, Hx, Tx, S] q's dtype | float32
                                  .Arg<ffi::AnyBuffer>()             // the mask's block map
                                  .Arg<ffi::AnyBuffer>()             // its row ranges
                                  .Arg<ffi::AnyBuffer>()             // its column ranges
                                  .Arg<ffi::AnyBuffer>()             // ALiBi slopes [Bx, N, 1, 1] float32
                                  .Arg<ffi::Buffer<ffi::F32>>()      // the forward's row max [N, total_q]
                                  .Arg<ffi::Buffer<ffi::F32>>()      // the forward's ln of the row sum [N, total_q]
                                  .Ret<ffi::AnyBuffer>()             // dq
                                  .Ret<ffi::AnyBuffer>()             // dk
                                  .Ret<ffi::AnyBuffer>()             // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()      // Delta workspace [N, total_q]
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
                                  .Attr<int32_t>("rows_covered")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("has_bias")
                                  .Attr<int32_t>("has_alibi"),
                              {ffi::Traits::kCmdBufferCompatible});

// The bias gradient target (initialize: jps_bwd_initialize).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_bwd_dbias_execute, DBiasExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // q
                                  .Arg<ffi::AnyBuffer>()             // k
                                  .Arg<ffi::AnyBuffer>()             // v
                                  .Arg<ffi::AnyBuffer>()             // do
                                  .Arg<ffi::Buffer<ffi::F32>>()      // Delta [N, total_q] (the backward's)
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_k
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_k
                                  .Arg<ffi::AnyBuffer>()             // mask [Bx, Hx, Tx, S] bool
                                  .Arg<ffi::AnyBuffer>()             // bias [Bx, Hx, T, S] q's dtype | float32
                                  .Arg<ffi::AnyBuffer>()             // the mask's block map
                                  .Arg<ffi::AnyBuffer>()             // its row ranges
                                  .Arg<ffi::AnyBuffer>()             // its column ranges
                                  .Arg<ffi::AnyBuffer>()             // ALiBi slopes [Bx, N, 1, 1] float32
                                  .Arg<ffi::Buffer<ffi::F32>>()      // the forward's row max [N, total_q]
                                  .Arg<ffi::Buffer<ffi::F32>>()      // the forward's ln of the row sum [N, total_q]
                                  .Ret<ffi::AnyBuffer>()             // dbias: the bias's shape and dtype
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("max_seqlen_q")
                                  .Attr<int32_t>("max_seqlen_k")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("has_alibi"),
                              {ffi::Traits::kCmdBufferCompatible});

// The built variant table, for the Python side (built_variants, unsupported_reason).
JPS_EXPORT int jps_num_bwd_variants() { return kJpsNumBwdVariants; }
JPS_EXPORT int jps_bwd_variant(int i, int *arch, int *dtype, int *head_dim, int *softcap) {
  if (i < 0 || i >= kJpsNumBwdVariants) return -1;
  const JpsBwdVariant &v = kJpsBwdVariants[i];
  *arch = v.arch;
  *dtype = v.dtype;
  *head_dim = v.head_dim;
  *softcap = v.softcap;
  return 0;
}
JPS_EXPORT int jps_bwd_variant_aux(int i) {
  if (i < 0 || i >= kJpsNumBwdVariants) return -1;
  return kJpsBwdVariants[i].aux;
}
// 1 where the variant has the bias gradient kernel (the bias kind), 0 where not, -1 out of range.
JPS_EXPORT int jps_bwd_variant_dbias(int i) {
  if (i < 0 || i >= kJpsNumBwdVariants) return -1;
  return kJpsBwdVariants[i].dbias != nullptr;
}
