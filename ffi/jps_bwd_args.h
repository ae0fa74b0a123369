// ABI between the backward FFI handler (jps_bwd.cc) and the generated launch adapters
// (<kernel dir>/jps_bwd_registry.h, written by `python -m jax_padsafe.kernels.build`).
#pragma once
#include "jps_fwd_args.h"  // cuda_runtime.h, jps_note_cuda_error / CUTE_DSL_CUDA_ERROR_CHECK

struct JpsBwdArgs {
  void *q, *k, *v, *o, *dout;   // [total_q, N, H], [total_k, K, H] x2, [total_q, N, H] x2
  float *lse, *dlse, *delta;    // [N, total_q]; delta: zero-filled workspace
  void *dq, *dk, *dv;           // outputs, zeroed where no kernel writes (common.h: OutputZeroing)
  int32_t *cu_q, *cu_k;         // [batch + 1]
  int32_t *used_q, *used_k;     // [batch]
  int32_t total_q, total_k, num_heads, num_kv_heads, head_dim, batch;
  float score_mul;              // scale * log2(e), or scale / softcap when soft-capped
  float cap_mul;                // softcap * log2(e) when soft-capped (unused otherwise)
  float dscale;                 // scale: dQ = dscale * dS K, dK = dscale * dS^T Q
  int32_t window_left, window_right;  // -1: unbounded; causal is folded into window_right
  int32_t bottom_right;
  int32_t max_seqlen_q, max_seqlen_k;
  // 1: the call's keys are only part of each row's softmax (a ring attention step): the dQ kernel then neither
  // shifts dQ to a reference key nor leaves rowsum(P dP) in `delta` (kernels/common/dq_shift.py).
  int32_t partial_keys;
  // [2], zeroed by the handler where a compact schedule may run: the Hopper family's tile queues ([0] the
  // dK/dV kernel's, [1] the dQ kernel's); unused by the SM80-class family.
  int32_t *tile_counters;
  // The aux variants only (masks and biases as tensors, kernels/common/aux_scores.py; ffi/aux.h fills these):
  // the mask, the bias in the input dtype or float32, the mask's block map and its row / column ranges, each
  // with its 4 sizes (compact row-major), the forward's exact row statistics, and which of them are live.
  void *mask, *bias, *bias32, *tile_map, *row_range, *col_range;
  int32_t mask_dims[4], bias_dims[4], bias32_dims[4], map_dims[4], row_range_dims[4], col_range_dims[4];
  float *row_max, *log_sum;  // [N, total_q]: the forward writes them, the backward reads them
  void *slopes;              // ALiBi slopes [Bx, N, 1, 1] float32
  int32_t slopes_dims[4];
  int32_t aux_flags;         // aux_scores.FLAG_*: 1 mask, 2 bias (input dtype), 4 bias (float32), 8 ALiBi,
                             // 16 ALiBi with the bottom-right offset
  // The bias gradient kernel only: dbias with the bias's shape [Bx, Hx, T, S], in the input dtype (dbias) or in
  // float32 (dbias32), as the bias; the other points at it with sizes (1, 1, 1, 1) and is never written.
  void *dbias, *dbias32;
  int32_t dbias_dims[4], dbias32_dims[4];
};

typedef int32_t (*JpsBwdLaunchFn)(void *module, const JpsBwdArgs *args, cudaStream_t stream);

struct JpsBwdVariant {
  int arch, dtype, head_dim, softcap;
  void (*load)(void);  // loads every module of the entry
  void *pre_module;
  JpsBwdLaunchFn pre;
  void *dkdv_module;
  JpsBwdLaunchFn dkdv;
  void *dq_module;
  JpsBwdLaunchFn dq;
  const char *name;
  int family;  // 0: SM80-class (kernels/sm80), 1: Hopper TMA + wgmma (kernels/sm90, sm_90a only)
  // Second dK/dV launch, or null.  Non-null for the SM80-class variants with head_dim > 128: `dkdv` is then
  // the dV-only pass and `dk` the dK-only pass of the same kernel (outputs "dv" / "dk"), launched one after
  // the other with the same arguments; each writes only its own output.
  void *dk_module;
  JpsBwdLaunchFn dk;
  // Family 1: the dK/dV kernel's key tile (block_n) and the dQ kernel's query tile (block_m), which decide
  // whether a call may take the compact schedules (and so needs zeroed tile counters); 0 otherwise.
  int dkdv_block_n, dq_block_m;
  // Family 1: the kernels that take their queued schedule on every layout, dense ones too (bit 0: dK/dV,
  // bit 1: dQ; read off the compiled kernels by the build): then every call needs zeroed tile counters.
  int queue_all;
  int aux;  // 0: plain; the dK/dV and dQ kernels take the aux arguments: 1 the mask kind, 2 the bias kind
  // The bias kind: the bias gradient kernel (sm80/bwd_dbias.py, in both families), launched by its own target
  // after the backward (its Delta); null otherwise.
  void *dbias_module;
  JpsBwdLaunchFn dbias;
};
