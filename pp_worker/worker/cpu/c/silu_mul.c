/* out = silu(g) u = g u / (1 + e^-g), n float32 values (dims = {n, parts}; n a multiple of 16), the parts splitting
   n in whole vectors: a feed-forward's activation. tinygrad renders exp per value in scalar code (12 us a decode
   call at ffn 5632, one thread); here 16 values at a time. e^-g as tinygrad computes it: 2^t, t = -g log2 e, split
   into k = nearest integer and f = t - k in [-0.5, 0.5], 2^f by the same polynomial, 2^k put in the exponent bits;
   t clamped to [-126, 126] (beyond it silu is g or 0 to float32 precision). */
static const float EXP2_POLY[7] = {0.0001535920892f, 0.001339262701f, 0.009618384764f, 0.05550347269f,
                                   0.2402264476f, 0.6931471825f, 1.0f};
static inline f16v exp2_16(f16v t) {
  t = t < -126.0f ? -126.0f : t; t = t > 126.0f ? 126.0f : t;
  f16v r = t + (f16v)((t < 0.0f) ? -0.5f : 0.5f);
  i32x16 k = __builtin_convertvector(r, i32x16);  /* truncation of t +- 0.5: nearest, ties away from zero */
  f16v f = t - __builtin_convertvector(k, f16v), p = EXP2_POLY[0];
  _Pragma("clang loop unroll(full)") for (int i = 1; i < 7; i++) p = p * f + EXP2_POLY[i];
  return p * __builtin_bit_cast(f16v, (k + 127) << 23);
}
void NAME(float* restrict out, const float* restrict g, const float* restrict u, const int* restrict dims,
          int core_id) {
  const int n = dims[0], T = dims[1];
  int per = (n / 16 + T - 1) / T * 16, i0 = core_id * per, i1 = i0 + per < n ? i0 + per : n;
  for (int i = i0; i < i1; i += 16) {
    f16v gv = f_at(g + i), r = gv / (1.0f + exp2_16(gv * -1.4426950408889634f)) * f_at(u + i);
    __builtin_memcpy(out + i, &r, 64);
  }
}
