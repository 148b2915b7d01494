/* One row of x with AVX-512, Q6_K: the lanes of k4_lanes.h over a half-block's 64 bytes of low 4 bits; each lane's 2
   high bits from qh (its 32 bytes in both halves of a vector) by a shift per lane, looked up in a table of 16
   (h & 3) - 32; the 4 lanes of a quarter share a scale. Cache-hot, one thread: 1.13-1.23x the group-by-group
   decoder. */
#if defined(__AVX512F__)
static const f16v THI = {-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16};
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  /* lane l, nibble m of half c: byte 4 l + m / 2 of ql's 64 */
  LANES(xp, x, 2 * nb, 128, 8, 64 * (m & 1) + m / 2 + 4 * l)
  return xp;
}
#define HALF(h) { \
  u32x16 q; __builtin_memcpy(&q, b + 64 * h, 64); \
  u32x8 h8; __builtin_memcpy(&h8, b + 128 + 32 * h, 32); \
  u32x16 hb = __builtin_shufflevector(h8, h8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7); \
  const float* p = xp + 256 * j + 128 * h; \
  f16v e = 0, o = 0; \
  _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m += 2) { \
    u32x16 at = (u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} + 4 * m; \
    e += (LOOK(FIOTA, (i32x16)(q >> (4 * m))) + LOOK(THI, (i32x16)(hb >> at))) * f_at(p + 16 * m); \
    o += (LOOK(FIOTA, (i32x16)(q >> (4 * m + 4))) + LOOK(THI, (i32x16)(hb >> (at + 4)))) * f_at(p + 16 * m + 16); } \
  acc += e * SPLAT4(sf, 8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3) \
       + o * SPLAT4(sf, 8 * h + 4, 8 * h + 5, 8 * h + 6, 8 * h + 7); }
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict xp,
                                   const float* restrict xs, int nb) {
  f16v acc = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
    f16v sf = __builtin_convertvector(sc, f16v) * half_at(b + 208);
    HALF(0) HALF(1)
  }
  return hsum(acc);
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
#endif
