#if defined(__AVX512F__)
#define QS 16
#define MINS 1
static const f16v TABLE = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
#define INDEX (q >> (2 * m))
#define HIGH_BITS
#define SCALES u8x16 sb = u8_at(b); sd = fu8(sb & 15) * half_at(b + 80); \
  mins += fu8(sb >> 4) * half_at(b + 82) * f_at(xs + 16 * j);
#include "k23_lanes.h"
#endif
#if defined(PP_INT) && defined(__AVX512BW__)  /* the integer path's 512-bit step (matmul_int.c): groups 2c and 2c + 1
   share their 32 bytes of qs (bit pairs 2 (c % 2) and the next), read into both halves once and shifted apart by one
   vpsrlvw (the generic iq32 read, shifted and masked each, then joined them) */
#define IQ64
static inline u8x64 iq64(const unsigned char* b, int c) {
  u8x32 q = u8x32_at(b + 16 + 32 * (c >> 1));
  const int a = 4 * (c & 1);
  const u16x32 at = {S8(a), S8(a), S8(a + 2), S8(a + 2)};
  return (u8x64)((u16x32)CAT64(q, q) >> at) & 3; }
#endif
