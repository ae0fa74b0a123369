// XLA FFI handlers of the forward kernels: targets "jax_padsafe_fwd" and, for masks and biases given as tensors,
// "jax_padsafe_fwd_aux" (platform CUDA), FFI API of the oldest supported jaxlib (0.10.2 -> 0.3).
//   initialize: loads the forward and row-zeroing kernel modules of this device's architecture (once).
//   execute:    checks the arguments, zero-fills lse (the kernels write valid rows only), picks the variant,
//               passes the attention sinks ([N] float32, joined in the kernels' epilogue; [0]: none),
//               gives O its zeros (common.h: OutputZeroing), zeroes the Hopper kernel's tile counter where its
//               compact schedule may run, launches.
#include "aux.h"
#include "common.h"
#include "jps_fwd_args.h"
#include "jps_registry.h"  // generated: kJpsFwdVariants, kJpsNumFwdVariants

namespace {

namespace ffi = xla::ffi;
constexpr const char *kTarget = "jax_padsafe_fwd";
constexpr const char *kAuxTarget = "jax_padsafe_fwd_aux";

jps::ArchLoader g_loader;

ffi::Error LoadModules(int arch) {
  auto load_forward = [arch] { return jps::LoadModules(kTarget, kJpsFwdVariants, kJpsNumFwdVariants, arch); };
  if (ffi::Error e = g_loader.Load(arch, load_forward); e.failure()) return e;
  return jps::LoadZeroRowsKernels(kTarget, arch);
}

ffi::Error CurrentArch(int *arch) {
  return jps::ArchWithKernels(kTarget, "forward", kJpsFwdVariants, kJpsNumFwdVariants, arch);
}

ffi::Error FwdInitialize(ffi::RemainingArgs, ffi::RemainingRets) {
  int arch = 0;
  if (ffi::Error e = CurrentArch(&arch); e.failure()) return e;
  return LoadModules(arch);
}

// The aux target's extra operands: the aux inputs and the exact row statistics it writes.
struct AuxForward {
  jps::AuxOperands operands;
  ffi::Result<ffi::Buffer<ffi::F32>> *row_max, *log_sum;
};

ffi::Error Forward(const char *target, cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                   ffi::Buffer<ffi::S32> used_k, ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> &o,
                   ffi::Result<ffi::Buffer<ffi::F32>> &lse,
                   ffi::Result<ffi::Buffer<ffi::S32>> &tile_counter, float scale, float softcap, int32_t window_left,
                   int32_t window_right, int32_t causal, int32_t bottom_right, int32_t max_seqlen_q, int32_t rows_covered,
                   const AuxForward *aux) {
  jps::Problem p{};
  if (ffi::Error e = jps::CheckProblem(target, q, k, v, cu_q, cu_k, used_q, used_k, scale, softcap, max_seqlen_q, 0, &p);
      e.failure())
    return e;
  if (!jps::HasShape(o->dimensions(), p.total_q, p.num_heads, p.head_dim) || o->element_type() != q.element_type())
    return jps::InvalidArgument(target, "o must have q's shape and dtype");
  if (!jps::HasShape(lse->dimensions(), p.num_heads, p.total_q)) return jps::InvalidArgument(target, "lse must be [N, total_q]");
  if (tile_counter->element_count() < 1) return jps::InvalidArgument(target, "tile_counter must have at least one element");
  if (sinks.dimensions().size() != 1 || (sinks.element_count() != 0 && int64_t(sinks.element_count()) != p.num_heads))
    return jps::InvalidArgument(target, "sinks must be float32 [N] (one per query head) or [0] (none)");
  int32_t aux_flags = 0;
  if (aux) {
    if (ffi::Error e = jps::CheckAux(target, p, q.element_type(), aux->operands, bottom_right, &aux_flags); e.failure()) return e;
    p.aux = jps::AuxKind(aux_flags);
    for (auto *x : {aux->row_max, aux->log_sum}) {
      if (!jps::HasShape((*x)->dimensions(), p.num_heads, p.total_q))
        return jps::InvalidArgument(target, "the row statistics must be [N, total_q]");
      // Padded rows keep these zeros (the kernels write valid rows only), as lse does.
      if (ffi::Error e = jps::Zero(target, stream, (*x)->untyped_data(), (*x)->size_bytes()); e.failure()) return e;
    }
  }

  if (ffi::Error e = jps::Zero(target, stream, lse->untyped_data(), lse->size_bytes()); e.failure()) return e;
  if (p.total_q == 0 || p.batch == 0 || max_seqlen_q == 0 || p.num_heads == 0)
    return jps::Zero(target, stream, o->untyped_data(), o->size_bytes());

  int arch = 0;
  if (ffi::Error e = CurrentArch(&arch); e.failure()) return e;
  if (ffi::Error e = LoadModules(arch); e.failure()) return e;  // a no-op once initialize ran
  // The Hopper kernel numbers its query tiles linearly in grid.x (ceil(max_seqlen_q / block_m) * N * B blocks),
  // which must stay below 2**31; the SM80-class kernel's 3-D grid has no such limit.
  auto grid_fits = [&](const JpsFwdVariant &c) {
    return c.family != 1 ||
           (int64_t(max_seqlen_q) + c.block_m - 1) / c.block_m * p.num_heads * p.batch < (int64_t(1) << 31) - 1;
  };
  const JpsFwdVariant *var = nullptr;
  if (ffi::Error e = jps::FindVariant(target, "forward", kJpsFwdVariants, kJpsNumFwdVariants, arch, p, grid_fits, &var);
      e.failure())
    return e;

  const jps::OutputZeroing zeroing = jps::ChooseOutputZeroing(var->family, rows_covered != 0, arch);
  if (zeroing != jps::OutputZeroing::kMemset)
    if (ffi::Error e = jps::Poison(target, stream, o->untyped_data(), o->size_bytes()); e.failure()) return e;
  if (zeroing == jps::OutputZeroing::kZeroUncoveredRows) {
    if (ffi::Error e = jps::ZeroUncoveredRows(target, arch, o->untyped_data(), nullptr, p.total_q,
                                              p.num_heads * p.head_dim * 2, cu_q.typed_data(), p.batch, max_seqlen_q, stream);
        e.failure())
      return e;
  } else if (zeroing == jps::OutputZeroing::kMemset) {
    if (ffi::Error e = jps::Zero(target, stream, o->untyped_data(), o->size_bytes()); e.failure()) return e;
  }
  // Packed calls zero the counter whichever schedule the kernel takes; the padded layout only where the compact
  // one may run (the grid limit above keeps the kernel's int32 products of that rule in range).
  if (var->family == 1 && (!rows_covered || jps::CompactScheduleMayRun(p.total_q, max_seqlen_q, var->block_m, p.batch)))
    if (ffi::Error e = jps::Zero(target, stream, tile_counter->untyped_data(), sizeof(int32_t)); e.failure()) return e;

  JpsFwdArgs a{};
  jps::FillCommonArgs(&a, p, q, k, v, cu_q, cu_k, used_q, used_k, scale, softcap, window_left, window_right, causal,
                      bottom_right, max_seqlen_q);
  a.o = o->untyped_data();
  a.lse = lse->typed_data();
  a.sinks = sinks.typed_data();
  a.num_sinks = int32_t(sinks.element_count());
  a.tile_counter = tile_counter->typed_data();
  if (aux) {
    jps::FillAuxArgs(&a, aux->operands, aux_flags, (*aux->row_max)->typed_data(), (*aux->log_sum)->typed_data());
    // The bias kind forms natural-unit scores q.k * scale + bias (aux_scores.scores); the mask kind keeps the
    // plain kernels' scores and their score_mul.
    if (p.aux == jps::kAuxKindBias) a.score_mul = scale;
  }
  if (int32_t rc = var->launch(var->module, &a, stream); rc != 0)
    return jps::CudaError(target, std::string("launch of ") + var->name, cudaError_t(rc));
  return ffi::Error::Success();
}

ffi::Error FwdExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                      ffi::Buffer<ffi::S32> used_k, ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                      float scale, float softcap, int32_t window_left, int32_t window_right, int32_t causal,
                      int32_t bottom_right, int32_t max_seqlen_q, int32_t rows_covered) {
  return Forward(kTarget, stream, q, k, v, cu_q, cu_k, used_q, used_k, sinks, o, lse, tile_counter, scale, softcap,
                 window_left, window_right, causal, bottom_right, max_seqlen_q, rows_covered, nullptr);
}

ffi::Error FwdAuxExecute(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k, ffi::Buffer<ffi::S32> used_q,
                         ffi::Buffer<ffi::S32> used_k, ffi::Buffer<ffi::F32> sinks, ffi::AnyBuffer mask,
                         ffi::AnyBuffer bias, ffi::AnyBuffer tile_map, ffi::AnyBuffer row_range,
                         ffi::AnyBuffer col_range, ffi::AnyBuffer slopes, ffi::Result<ffi::AnyBuffer> o,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::S32>> tile_counter,
                         ffi::Result<ffi::Buffer<ffi::F32>> row_max, ffi::Result<ffi::Buffer<ffi::F32>> log_sum,
                         float scale, float softcap, int32_t window_left, int32_t window_right, int32_t causal,
                         int32_t bottom_right, int32_t max_seqlen_q, int32_t rows_covered, int32_t has_mask,
                         int32_t has_bias, int32_t has_alibi) {
  const AuxForward aux{{&mask, &bias, &tile_map, &row_range, &col_range, &slopes, has_mask != 0, has_bias != 0,
                        has_alibi != 0},
                       &row_max, &log_sum};
  return Forward(kAuxTarget, stream, q, k, v, cu_q, cu_k, used_q, used_k, sinks, o, lse, tile_counter, scale, softcap,
                 window_left, window_right, causal, bottom_right, max_seqlen_q, rows_covered, &aux);
}

}  // namespace

JPS_EXPORT XLA_FFI_Error *jps_fwd_initialize(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_fwd_execute(XLA_FFI_CallFrame *call_frame);
JPS_EXPORT XLA_FFI_Error *jps_fwd_aux_execute(XLA_FFI_CallFrame *call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_fwd_initialize, FwdInitialize, ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets());

// Command-buffer compatible: execute only enqueues memsets and kernel launches on the stream (the modules are
// loaded in initialize, and the device's capability was queried there).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_fwd_execute, FwdExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // q
                                  .Arg<ffi::AnyBuffer>()             // k
                                  .Arg<ffi::AnyBuffer>()             // v
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_k
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_k
                                  .Arg<ffi::Buffer<ffi::F32>>()      // sinks [N] | [0]
                                  .Ret<ffi::AnyBuffer>()             // o
                                  .Ret<ffi::Buffer<ffi::F32>>()      // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()      // tile counter (scratch)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("max_seqlen_q")
                                  .Attr<int32_t>("rows_covered"),
                              {ffi::Traits::kCmdBufferCompatible});

// The aux target (initialize: jps_fwd_initialize, which loads every forward module of the arch).
XLA_FFI_DEFINE_HANDLER_SYMBOL(jps_fwd_aux_execute, FwdAuxExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // q
                                  .Arg<ffi::AnyBuffer>()             // k
                                  .Arg<ffi::AnyBuffer>()             // v
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // cu_seqlens_k
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_q
                                  .Arg<ffi::Buffer<ffi::S32>>()      // seqused_k
                                  .Arg<ffi::Buffer<ffi::F32>>()      // sinks [N] | [0]
                                  .Arg<ffi::AnyBuffer>()             // mask [Bx, Hx, Tx, S] bool
                                  .Arg<ffi::AnyBuffer>()             // bias [Bx, Hx, Tx, S] q's dtype | float32
                                  .Arg<ffi::AnyBuffer>()             // the mask's block map
                                  .Arg<ffi::AnyBuffer>()             // its row ranges
                                  .Arg<ffi::AnyBuffer>()             // its column ranges
                                  .Arg<ffi::AnyBuffer>()             // ALiBi slopes [Bx, N, 1, 1] float32
                                  .Ret<ffi::AnyBuffer>()             // o
                                  .Ret<ffi::Buffer<ffi::F32>>()      // lse
                                  .Ret<ffi::Buffer<ffi::S32>>()      // tile counter (scratch)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // row max [N, total_q]
                                  .Ret<ffi::Buffer<ffi::F32>>()      // ln of the row sum [N, total_q]
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("max_seqlen_q")
                                  .Attr<int32_t>("rows_covered")
                                  .Attr<int32_t>("has_mask")
                                  .Attr<int32_t>("has_bias")
                                  .Attr<int32_t>("has_alibi"),
                              {ffi::Traits::kCmdBufferCompatible});

// The built variant table, for the Python side (built_variants, unsupported_reason).
JPS_EXPORT int jps_num_fwd_variants() { return kJpsNumFwdVariants; }
JPS_EXPORT int jps_fwd_variant(int i, int *arch, int *dtype, int *head_dim, int *softcap) {
  if (i < 0 || i >= kJpsNumFwdVariants) return -1;
  const JpsFwdVariant &v = kJpsFwdVariants[i];
  *arch = v.arch;
  *dtype = v.dtype;
  *head_dim = v.head_dim;
  *softcap = v.softcap;
  return 0;
}
JPS_EXPORT int jps_fwd_variant_aux(int i) {
  if (i < 0 || i >= kJpsNumFwdVariants) return -1;
  return kJpsFwdVariants[i].aux;
}
