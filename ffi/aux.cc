#include "aux.h"

namespace jps {

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool Rank4(const ffi::AnyBuffer &x) { return x.dimensions().size() == 4; }

bool Dims4(const ffi::AnyBuffer &x, int64_t a, int64_t b, int64_t c, int64_t d) {
  auto s = x.dimensions();
  return s[0] == a && s[1] == b && s[2] == c && s[3] == d;
}

// [Bx, Hx, Tx, S] broadcasting over the call: Bx in {1, B}, Hx in {1, K, N}, Tx in {1, T}, S exact.
bool Broadcasts(const ffi::AnyBuffer &x, const Problem &p, int64_t T, int64_t S) {
  auto d = x.dimensions();
  return (d[0] == 1 || d[0] == p.batch) && (d[1] == 1 || d[1] == p.num_kv_heads || d[1] == p.num_heads) &&
         (d[2] == 1 || d[2] == T) && d[3] == S;
}

}  // namespace

ffi::Error CheckAux(const char *target, const Problem &p, ffi::DataType q_dtype, const AuxOperands &aux,
                    int32_t bottom_right, int32_t *flags) {
  for (const ffi::AnyBuffer *x : {aux.mask, aux.bias, aux.tile_map, aux.row_range, aux.col_range, aux.slopes})
    if (!Rank4(*x)) return InvalidArgument(target, "the mask, bias, block-map and slope operands must be rank 4");
  if (p.batch <= 0 || p.total_q % p.batch || p.total_k % p.batch)
    return InvalidArgument(target, "masks and biases need the padded layout (total_q and total_k multiples of B)");
  const int64_t T = p.total_q / p.batch, S = p.total_k / p.batch;
  int32_t f = 0;
  if (aux.has_mask) {
    const ffi::DataType mt = aux.mask->element_type();
    if (mt != ffi::DataType::PRED && mt != ffi::DataType::U8)
      return InvalidArgument(target, "the mask must be bool (or uint8)");
    if (!Broadcasts(*aux.mask, p, T, S))
      return InvalidArgument(target, "the mask must be [1|B, 1|K|N, 1|T, S] for q [B*T, N, H], k [B*S, K, H]");
    auto d = aux.mask->dimensions();
    const int64_t mx = CeilDiv(d[2], 32), nx = CeilDiv(d[3], 16);
    if (aux.tile_map->element_type() != ffi::DataType::U8 || !Dims4(*aux.tile_map, d[0], d[1], mx, nx))
      return InvalidArgument(target, "the mask's block map must be uint8 [Bx, Hx, ceil(Tx/32), ceil(S/16)]");
    if (aux.row_range->element_type() != ffi::DataType::S32 || !Dims4(*aux.row_range, d[0], d[1], mx, 2))
      return InvalidArgument(target, "the mask's row ranges must be int32 [Bx, Hx, ceil(Tx/32), 2]");
    if (aux.col_range->element_type() != ffi::DataType::S32 || !Dims4(*aux.col_range, d[0], d[1], nx, 2))
      return InvalidArgument(target, "the mask's column ranges must be int32 [Bx, Hx, ceil(S/16), 2]");
    f |= kAuxMask;
  }
  if (aux.has_bias) {
    const ffi::DataType bt = aux.bias->element_type();
    if (bt != q_dtype && bt != ffi::DataType::F32)
      return InvalidArgument(target, "the bias must have q's dtype or float32");
    if (!Broadcasts(*aux.bias, p, T, S))
      return InvalidArgument(target, "the bias must be [1|B, 1|K|N, 1|T, S] for q [B*T, N, H], k [B*S, K, H]");
    f |= bt == ffi::DataType::F32 ? kAuxBias32 : kAuxBias;
  }
  if (aux.has_alibi) {
    auto d = aux.slopes->dimensions();
    if (aux.slopes->element_type() != ffi::DataType::F32 || (d[0] != 1 && d[0] != p.batch) ||
        d[1] != p.num_heads || d[2] != 1 || d[3] != 1)
      return InvalidArgument(target, "the ALiBi slopes must be float32 [1|B, N, 1, 1]");
    f |= kAuxAlibi | (bottom_right ? kAuxAlibiBottomRight : 0);
  }
  *flags = f;
  return ffi::Error::Success();
}

}  // namespace jps
