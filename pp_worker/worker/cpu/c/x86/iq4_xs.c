#include "iq4.h"
/* One row of x with AVX-512: the way of k4_lanes.h over IQ4_XS's layout. 64 bytes (4 sub-blocks of 32) read as 16
   int32 lanes of 8 nibbles, each lane within one sub-block; nibble m of all lanes looked up at once in the 16 levels;
   x put in the lanes' order once per call; the 4 sub-blocks' scales applied once to their lanes' sums. */
#if defined(__AVX512F__)
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  /* lane l, nibble m of half c: byte 4 (l % 4) + m / 2 of sub-block l / 4 */
  LANES(xp, x, 2 * nb, 128, 8, 32 * (l / 4) + 4 * (l % 4) + m / 2 + 16 * (m & 1))
  return xp;
}
#define IQ4_HALF(h) { \
  u32x16 q; __builtin_memcpy(&q, b + 8 + 64 * h, 64); \
  const float* p = xp + 256 * j + 128 * h; \
  f16v e = 0, o = 0; \
  _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m += 2) { \
    e += LOOK(KV4, (i32x16)(q >> (4 * m))) * f_at(p + 16 * m); \
    o += LOOK(KV4, (i32x16)(q >> (4 * m + 4))) * f_at(p + 16 * m + 16); } \
  acc += (e + o) * SPLAT4(sc, 4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3); }
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict xp,
                                   const float* restrict xs, int nb) {
  f16v acc = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    f8v sc;
    _Pragma("clang loop unroll(full)") for (int g = 0; g < 8; g++) sc[g] = iq4_scale(b, g);
    IQ4_HALF(0) IQ4_HALF(1)
  }
  return hsum(acc);
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
#elif defined(__AVX2__)
#include "avx2.h"
/* One row of x with AVX2: 32 bytes of qs (sub-blocks 2c and 2c + 1, one per 16-byte half) split into nibbles, each
   looked up as a byte, the level + 128 (vpshufb; 1-241, so the byte lanes' masks need no sign), and summed as byte
   lanes (avx2.h): lanes 0-3 of sub-block 2c, 4-7 of 2c + 1, scaled by a vector of their two scales; the 128 taken
   off once per block, by x's sums per sub-block. */
typedef char v32qi __attribute__((vector_size(32)));
static const u8x32 KV4_U8 = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241,
                             1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int s = 0; s < 8 * nb; s++) xs[s] = hsum(f_at(x + 32 * s) + f_at(x + 32 * s + 16));
  /* a pair of sub-blocks: low nibbles, then high; lane l byte k is value 4 (l % 4) + k (+ 16 for the high ones) of
     sub-block l / 4 */
  for (int c = 0; c < 4 * nb; c++)
    for (int h = 0; h < 2; h++)
      for (int k = 0; k < 4; k++)
        for (int l = 0; l < 8; l++)
          xp[64 * c + 32 * h + 8 * k + l] = x[64 * c + 32 * (l / 4) + 16 * h + 4 * (l % 4) + k] * BYTE_AT[k];
  return xp;
}
static inline u32x8 levels(u32x8 nibbles) {
  return (u32x8)__builtin_ia32_pshufb256((v32qi)KV4_U8, (v32qi)nibbles); }
#define IQ4_PAIR(c) { \
  u32x8 q = u32x8_at(b + 8 + 32 * c); \
  acc += (bytes_dot(levels(q & 0x0F0F0F0F), p + 64 * c) + bytes_dot(levels((q >> 4) & 0x0F0F0F0F), p + 64 * c + 32)) \
         * PAIR(sc, 2 * c); }
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict xp,
                                 const float* restrict xs, int nb) {
  f8v acc = 0, offs = 0;
  const u32x8 at_l = {0, 4, 8, 12, 16, 20, 24, 28}, at_h = {0, 2, 4, 6, 8, 10, 12, 14};
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    PREFETCH(b, BLOCK_BYTES);
    unsigned int sl, sh = b[2] | b[3] << 8; __builtin_memcpy(&sl, b + 4, 4);
    u32x8 ls = (((u32x8)sl >> at_l) & 15) | (((u32x8)sh >> at_h) & 3) << 4;
    f8v sc = (__builtin_convertvector((i32x8)ls, f8v) - 32.0f) * half_at(b);  /* the 8 sub-blocks' */
    offs += sc * f8_at(xs + 8 * j);
    const float* p = xp + 256 * j;
    IQ4_PAIR(0) IQ4_PAIR(1) IQ4_PAIR(2) IQ4_PAIR(3)
  }
  return hsum8(acc - 128.0f * offs);
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
#endif
#if defined(PP_INT) && defined(__AVX512BW__)  /* the integer path's 512-bit step (matmul_int.c): groups 2c and 2c + 1
   from their 32 bytes, each 16 put in two 128-bit lanes, the second shifted down a nibble (vpsrlvw), and all 64
   levels looked up at once (vpshufb in each lane) */
#define IQ64
static inline i8x64 iq64(const unsigned char* b, int c) {
  u8x32 q = u8x32_at(b + 8 + 32 * c);
  u8x64 t = __builtin_shufflevector(q, q, S16(0), S16(0), S16(16), S16(16));
  const u16x32 at = {S8(0), S8(4), S8(0), S8(4)};
  u8x64 n = (u8x64)((u16x32)t >> at) & 15;
  i8x64 levels = __builtin_shufflevector(KV4_INT, KV4_INT, S16(0), S16(0), S16(0), S16(0));
  return (i8x64)__builtin_ia32_pshufb512((v64qi_t)levels, (v64qi_t)n); }
#endif
#if defined(PP_INT) && defined(__AVX512BW__)  /* the one-row step's pair products: each value's |level| looked up
   (vpshufb), x negated where the level is negative (its index below 8: one vptestnmb), in place of the levels' abs
   and their sign bits taken apart afterwards; the same 16-bit sums */
#define IQ_PAIRS64 iq_pairs64
static inline i16x32 iq_pairs64(const unsigned char* b, int c, i8x64 x) {
  u8x32 q = u8x32_at(b + 8 + 32 * c);
  u8x64 t = __builtin_shufflevector(q, q, S16(0), S16(0), S16(16), S16(16));
  const u16x32 at = {S8(0), S8(4), S8(0), S8(4)};
  u8x64 n = (u8x64)((u16x32)t >> at) & 15;
  i8x16 mag16 = __builtin_elementwise_abs(KV4_INT);
  u8x64 mag = (u8x64)__builtin_shufflevector(mag16, mag16, S16(0), S16(0), S16(0), S16(0));
  return pairs64_u((u8x64)__builtin_ia32_pshufb512((v64qi_t)mag, (v64qi_t)n), (n & 8) == 0 ? -x : x); }
#endif
