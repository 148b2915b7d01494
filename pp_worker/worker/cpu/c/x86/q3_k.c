#if defined(__AVX512F__)
#define QS 32
#define MINS 0
static const f16v TABLE = {-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3};
/* hmask's int32s in lanes 0-7 and again in 8-15, those of 0-7 shifted left by 2 (their bits reach 27 at most), so
   one right shift per lane brings value m's third bit to bit 2: the pair in bits 0-1, bit 3 whatever */
#define HIGH_BITS u32x8 h8; __builtin_memcpy(&h8, b, 32); \
  u32x16 hb = __builtin_shufflevector(h8 << 2, h8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#define INDEX (((q >> (2 * m)) & 3) | ((hb >> ((u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} \
  + (8 * (m / 4) + m % 4))) & ~3u))
#define SCALES u8x16 sv = 0; __builtin_memcpy(&sv, b + 96, 12); \
  u32x16 lo = __builtin_convertvector(__builtin_shufflevector(sv & 15, sv >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, \
                                                              19, 20, 21, 22, 23), u32x16); \
  u32x16 hi = __builtin_convertvector(__builtin_shufflevector(sv, sv, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, \
                                                              9, 10, 11), u32x16); \
  sd = (__builtin_convertvector((i32x16)(lo | ((hi >> (2 * (IOTA >> 2))) & 3) << 4), f16v) - 32.0f) \
       * half_at(b + 108);
#include "k23_lanes.h"
#endif
#if defined(PP_INT) && defined(__AVX512BW__)  /* the integer path's 512-bit step (matmul_int.c): as Q2_K's, the bit
   pairs of groups 2c and 2c + 1 from their 32 bytes read once, and hmask's bits 2c and 2c + 1 brought to bit 2 by one
   rotate of 32-bit lanes (vprorvd: right by g - 2, left where g < 2; a byte's bit stays in its byte, the bits that
   wrap fall outside the mask) */
#define IQ64
static inline u8x64 iq64(const unsigned char* b, int c) {
  u8x32 q = u8x32_at(b + 32 + 32 * (c >> 1)), h = u8x32_at(b);
  const int a = 4 * (c & 1);
  const u16x32 at = {S8(a), S8(a), S8(a + 2), S8(a + 2)};
  const u32x16 r = {S8((2 * c + 30) % 32), S8((2 * c + 31) % 32)};  /* g - 2, mod 32 */
  u32x16 hv = (u32x16)CAT64(h, h);
  return ((u8x64)((u16x32)CAT64(q, q) >> at) & 3) | ((u8x64)((hv >> r) | (hv << ((32 - r) & 31))) & 4); }
#endif
