/* Q5_1 (d, m, qh[4], qs[16]): q d + m, value i's fifth bit bit i of qh */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b), m = half_at(b + 2); unsigned int qh; __builtin_memcpy(&qh, b + 4, 4); u8x16 q = u8_at(b + 8);
  u32x16 lo = __builtin_convertvector(q & 15, u32x16) | (((qh >> IOTA) & 1) << 4);
  u32x16 hi = __builtin_convertvector(q >> 4, u32x16) | (((qh >> (IOTA + 16)) & 1) << 4);
  w[0] = __builtin_convertvector(lo, f16v) * d + m; w[1] = __builtin_convertvector(hi, f16v) * d + m; }
#ifdef PP_INT  /* the integer path (q8.h): unsigned 5-bit values; the block's min m through the offsets */
#define IQ_SIGNED 0
static inline u8x32 iq32(const unsigned char* b, int g) {  /* value i's fifth bit: bit i of qh */
  return nibbles32(b + 8) | (bit_bytes(b + 4) & 16); }
#define IQ_MIN 1  /* the min: M times the sum of x's block */
#define GROUP_FIFTH 1  /* rows in groups (matmul_groups.h): the fifth bits as Q5_0's */
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = -half_at(b + 2); }
#endif
