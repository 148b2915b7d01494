/* Q8_0 (d, qs[32]): q d */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); i8x16 q0, q1; __builtin_memcpy(&q0, b + 2, 16); __builtin_memcpy(&q1, b + 18, 16);
  w[0] = __builtin_convertvector(q0, f16v) * d; w[1] = __builtin_convertvector(q1, f16v) * d; }

/* One row of x, any CPU: a block's sum of q x times its scale, once, in place of a multiply per value (1.07-1.12x);
   the scaling and the accumulation one FMA, the scales of 16 blocks converted before their sums, so that a row of up
   to 512 values unrolls whole (a further 1.1-1.3x): cache-hot, one thread (bench/NOTES.md). */
static inline const float* prep_x_generic(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  return x; }  /* read as it is */
static inline f16v q8_0_dot(const unsigned char* b, const float* x) {  /* a block's sum of q x, not yet scaled */
  i8x16 q0, q1; __builtin_memcpy(&q0, b + 2, 16); __builtin_memcpy(&q1, b + 18, 16);
  return __builtin_convertvector(q0, f16v) * f_at(x) + __builtin_convertvector(q1, f16v) * f_at(x + 16);
}
static inline float row_dot_generic(const unsigned char* restrict row, const float* restrict xp,
                                    const float* restrict xs, int nb) {
  f16v acc0 = 0, acc1 = 0;
  for (int j0 = 0; j0 < nb; j0 += 16) {  /* 16 blocks at a time: their scales first, then their sums */
    const unsigned char* b = row + BLOCK_BYTES * j0;
    const float* x = xp + 32 * j0;
    int n = nb - j0 < 16 ? nb - j0 : 16, j = 0;
    float d[16];
    for (int i = 0; i < n; i++) d[i] = half_at(b + BLOCK_BYTES * i);
    for (; j + 1 < n; j += 2) {  /* acc += d * sum in one expression: one FMA */
      acc0 += d[j] * q8_0_dot(b + BLOCK_BYTES * j, x + 32 * j);
      acc1 += d[j + 1] * q8_0_dot(b + BLOCK_BYTES * (j + 1), x + 32 * j + 32);
    }
    if (j < n) acc0 += d[j] * q8_0_dot(b + BLOCK_BYTES * j, x + 32 * j);
  }
  return hsum(acc0 + acc1);
}
#define ROW_DOT_GENERIC
#ifdef PP_INT  /* the integer path (q8.h): signed bytes as they are */
#define IQ_SIGNED 1
static inline i8x32 iq32(const unsigned char* b, int g) { return i8x32_at(b + 2); }
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = 0; }
#endif
