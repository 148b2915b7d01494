/* One row of x with AVX2 for the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): two blocks a vector, the
   16 bytes of nibbles of block j in the low half and of block j + 1 in the high half, so the low nibbles are the
   blocks' values 0-15 and the high ones 16-31 as byte lanes (avx2.h). Q5's fifth bits join each byte at bit 4 (qh's
   bytes spread to the 16 bytes of a half by vpshufb, each byte's bit picked by a mask and a compare); IQ4_NL looks
   its levels up as bytes, + 128. Each half's sum is scaled by its block's d (a vector of the two), and what each
   value adds besides q d (-OFF d, or Q4_1 and Q5_1's m) multiplies x's block sums once per row (xs: each block's
   sum twice, beside its pair's). A row's last block, where the blocks are odd, is decoded by the generic C and
   multiplied with x left in order. The including file defines P_QS (where the nibbles start), P_QH (where the fifth
   bits are, 0: none), P_MIN (whether m follows d), P_OFF (what the values lose: 8, 16, 128) and P_LEVELS (IQ4_NL). */
#include "avx2.h"
typedef char v32qi __attribute__((vector_size(32)));
typedef __fp16 h16x4 __attribute__((ext_vector_type(4)));
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int j = 0; j < nb; j++) xs[2 * j] = xs[2 * j + 1] = hsum(f_at(x + 32 * j) + f_at(x + 32 * j + 16));
  /* a pair: low nibbles then high, lane l byte k is value 4 (l % 4) + k (+ 16 for high) of block l / 4 */
  for (int c = 0; c < nb / 2; c++)
    for (int h = 0; h < 2; h++)
      for (int k = 0; k < 4; k++)
        for (int l = 0; l < 8; l++)
          xp[64 * c + 32 * h + 8 * k + l] = x[64 * c + 32 * (l / 4) + 16 * h + 4 * (l % 4) + k] * BYTE_AT[k];
  if (nb & 1) __builtin_memcpy(xp + 32 * (nb - 1), x + 32 * (nb - 1), 128);
  return xp;
}
#if P_QH
/* bit 4 of byte i of each half: bit i (+ 16 for the high nibbles) of its block's qh (in the half's first 4 bytes) */
static inline u32x8 fifth(u32x8 qh, int high) {
  const u8x32 spread = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  const u8x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                     1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  u8x32 s = (u8x32)__builtin_ia32_pshufb256((v32qi)qh, (v32qi)(spread + 2 * high)) & bit;
  return (u32x8)((s == bit) & 16);
}
#endif
#if P_LEVELS
static const u8x32 KV4_U8 = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241,
                             1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
#define LEVELS(v) (u32x8)__builtin_ia32_pshufb256((v32qi)KV4_U8, (v32qi)(v))
#else
#define LEVELS(v) (v)
#endif
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict xp,
                                 const float* restrict xs, int nb) {
  f8v acc = 0; f4v offs = 0;  /* offs: sum of d S, of m S, of d S, of m S (S: x's block sums) */
  for (int j = 0; j + 1 < nb; j += 2) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    unsigned int h0, h1; __builtin_memcpy(&h0, b, 4); __builtin_memcpy(&h1, b + BLOCK_BYTES, 4);
    f4v dm = __builtin_convertvector(__builtin_bit_cast(h16x4, (u32x2){h0, h1}), f4v);  /* d, m, d', m' */
    offs += dm * f4_at(xs + 2 * j);
    u32x8 q = __builtin_bit_cast(u32x8, __builtin_shufflevector(u8_at(b + P_QS), u8_at(b + BLOCK_BYTES + P_QS), 0, 1,
      2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31));
    u32x8 lo = q & 0x0F0F0F0F, hi = (q >> 4) & 0x0F0F0F0F;
#if P_QH
    unsigned int qh0, qh1; __builtin_memcpy(&qh0, b + P_QH, 4); __builtin_memcpy(&qh1, b + BLOCK_BYTES + P_QH, 4);
    u32x8 qh = {qh0, 0, 0, 0, qh1, 0, 0, 0};
    lo |= fifth(qh, 0); hi |= fifth(qh, 1);
#endif
    const float* p = xp + 32 * j;
    acc += (bytes_dot(LEVELS(lo), p) + bytes_dot(LEVELS(hi), p + 32)) * __builtin_shufflevector(dm, dm, 0, 0, 0, 0,
                                                                                                  2, 2, 2, 2);
  }
  float last = 0;
  if (nb & 1) {
    const unsigned char* b = row + BLOCK_BYTES * (nb - 1); const float* p = xp + 32 * (nb - 1);
    f16v w[2]; decode32_generic(b, 0, w);
    last = hsum(w[0] * f_at(p) + w[1] * f_at(p + 16));
  }
  return hsum8(acc) - P_OFF * (offs[0] + offs[2]) + (P_MIN ? offs[1] + offs[3] : 0.0f) + last;
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
