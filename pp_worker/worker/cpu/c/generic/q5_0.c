/* Q5_0 (d, qh[4], qs[16]): (q - 16) d, value i's fifth bit bit i of qh */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); unsigned int qh; __builtin_memcpy(&qh, b + 2, 4); u8x16 q = u8_at(b + 6);
  u32x16 lo = __builtin_convertvector(q & 15, u32x16) | (((qh >> IOTA) & 1) << 4);
  u32x16 hi = __builtin_convertvector(q >> 4, u32x16) | (((qh >> (IOTA + 16)) & 1) << 4);
  w[0] = (__builtin_convertvector(lo, f16v) - 16.0f) * d; w[1] = (__builtin_convertvector(hi, f16v) - 16.0f) * d; }
#ifdef PP_INT  /* the integer path (q8.h): q - 16 as signed bytes */
#define IQ_SIGNED 1
#define GROUP_OFF 16  /* rows in groups (matmul_groups.h): q with its fifth bit unsigned, less 16 */
#define GROUP_FIFTH 1
static inline i8x32 iq32(const unsigned char* b, int g) {  /* value i's fifth bit: bit i of qh */
  return (i8x32)(nibbles32(b + 6) | (bit_bytes(b + 2) & 16)) - 16; }
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = 0; }
#endif
