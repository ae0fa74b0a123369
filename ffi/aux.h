// The aux operands of the masked / biased kernel variants (kernels/common/aux_scores.py), shared by the forward
// and backward handlers: the checks against the call and the filling of the argument structs.
//
// The aux variants take the padded layout only (sequence b's rows b*T .. b*T+T-1, T = total_q / B): the mask
// and bias are [Bx, Hx, Tx, S] with Bx in {1, B}, Hx in {1, K, N}, Tx in {1, T}, S = total_k / B; the block
// map [Bx, Hx, ceil(Tx/32), ceil(S/16)] (uint8), row ranges [Bx, Hx, ceil(Tx/32), 2] and column ranges
// [Bx, Hx, ceil(S/16), 2] (int32) are the mask's summary (jax_padsafe/_backends/cute/aux.py computes it); the
// ALiBi slopes are float32 [Bx, N, 1, 1] (the kernels compute each score's term from the indices).
// Operands whose flag is clear may be any rank-4 placeholder: the kernels never read them.
#pragma once
#include "common.h"

namespace jps {

enum AuxFlag : int32_t { kAuxMask = 1, kAuxBias = 2, kAuxBias32 = 4, kAuxAlibi = 8, kAuxAlibiBottomRight = 16 };

// The variant kind a call takes (the registries' `aux` column): without a bias tensor (a mask and / or ALiBi)
// the mask kind (the plain kernels' raw scores and softmax, plus the mask and the ALiBi term in raw units: the
// caller divides the slopes by the softmax scale), with one the bias kind (natural-unit scores and slopes).
// jax_padsafe/_backends/cute/backend.py (_kernel_slopes) follows the same rule.
enum AuxKindCode : int { kAuxKindMask = 1, kAuxKindBias = 2 };
inline int AuxKind(int32_t flags) { return (flags & (kAuxBias | kAuxBias32)) ? kAuxKindBias : kAuxKindMask; }

struct AuxOperands {
  const ffi::AnyBuffer *mask, *bias, *tile_map, *row_range, *col_range, *slopes;
  bool has_mask, has_bias, has_alibi;
};

// Checks the aux operands of a call (p: CheckProblem's sizes, q's dtype) and returns the kernels' aux_flags
// (bottom_right: the call's causal alignment, which the ALiBi distance shares).
ffi::Error CheckAux(const char *target, const Problem &p, ffi::DataType q_dtype, const AuxOperands &aux,
                    int32_t bottom_right, int32_t *flags);

inline void AuxDims(const ffi::AnyBuffer &x, int32_t out[4]) {
  auto d = x.dimensions();
  for (int i = 0; i < 4; ++i) out[i] = int32_t(d[i]);
}

// Fills the aux fields of JpsFwdArgs / JpsBwdArgs.  The bias goes to `bias` or `bias32` by its dtype; the other
// points at it with sizes (1, 1, 1, 1) and is never read (its flag is clear).
template <typename Args>
void FillAuxArgs(Args *a, const AuxOperands &aux, int32_t flags, float *row_max, float *log_sum) {
  a->mask = aux.mask->untyped_data();
  AuxDims(*aux.mask, a->mask_dims);
  const bool f32 = (flags & kAuxBias32) != 0;
  a->bias = a->bias32 = aux.bias->untyped_data();
  int32_t bias_dims[4], one[4] = {1, 1, 1, 1};
  AuxDims(*aux.bias, bias_dims);
  for (int i = 0; i < 4; ++i) {
    a->bias_dims[i] = f32 ? one[i] : bias_dims[i];
    a->bias32_dims[i] = f32 ? bias_dims[i] : one[i];
  }
  a->tile_map = aux.tile_map->untyped_data();
  AuxDims(*aux.tile_map, a->map_dims);
  a->row_range = aux.row_range->untyped_data();
  AuxDims(*aux.row_range, a->row_range_dims);
  a->col_range = aux.col_range->untyped_data();
  AuxDims(*aux.col_range, a->col_range_dims);
  a->row_max = row_max;
  a->log_sum = log_sum;
  a->slopes = aux.slopes->untyped_data();
  AuxDims(*aux.slopes, a->slopes_dims);
  a->aux_flags = flags;
}

}  // namespace jps
