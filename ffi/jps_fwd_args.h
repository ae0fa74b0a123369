// ABI between the forward FFI handler (jps_fwd.cc) and the generated launch adapters
// (<kernel dir>/jps_registry.h, written by `python -m jax_padsafe.kernels.build`).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

struct JpsFwdArgs {
  void *q, *k, *v, *o;        // [total_q, N, H], [total_k, K, H] x2, [total_q, N, H]
  float *lse;                 // [N, total_q]
  float *sinks;               // [num_sinks] attention sinks (natural-unit logits per query head)
  int32_t num_sinks;          // N, or 0: no sinks (the kernels then never read `sinks`)
  int32_t *cu_q, *cu_k;       // [batch + 1]
  int32_t *used_q, *used_k;   // [batch]
  int32_t total_q, total_k, num_heads, num_kv_heads, head_dim, batch;
  float score_mul;            // scale * log2(e), or scale / softcap when soft-capped
  float cap_mul;              // softcap * log2(e) when soft-capped (unused otherwise)
  int32_t window_left, window_right;  // -1: unbounded; causal is folded into window_right
  int32_t bottom_right;       // 1: offset = seqused_k - seqused_q, 0: offset 0
  int32_t max_seqlen_q;       // grid.x = ceil(max_seqlen_q / block_m)
  int32_t *tile_counter;      // [1], zero-filled: the sm90 family's compact tile queue (unused by family 0)
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
};

typedef int32_t (*JpsFwdLaunchFn)(void *module, const JpsFwdArgs *args, cudaStream_t stream);
typedef void (*JpsFwdLoadFn)(void *module);

struct JpsFwdVariant {
  int arch;      // 80 (sm_80), 90 (sm_90a), 100 (sm_100a), 120 (sm_120)
  int dtype;     // 0 bf16, 1 fp16
  int head_dim;
  int softcap;   // 0/1
  int block_m;
  void *module;  // the export's <prefix>_Kernel_Module_t
  JpsFwdLoadFn load;
  JpsFwdLaunchFn launch;
  const char *name;
  int family;    // 0: SM80-class kernel (kernels/sm80), 1: Hopper TMA + wgmma kernel (kernels/sm90, arch 90 only)
  int aux;       // 0: plain; takes the aux arguments (masks and biases as tensors): 1 the mask kind, 2 the bias kind
};

// Errors reported by the exported module loaders (CUTE_DSL_CUDA_ERROR_CHECK is redirected here; the generated
// registries include this header before the exported ones).  Keeps the calling thread's first error for
// jps::LoadChecked (common.h).
void jps_note_cuda_error(cudaError_t err);
#define CUTE_DSL_CUDA_ERROR_CHECK(err) jps_note_cuda_error(err)
