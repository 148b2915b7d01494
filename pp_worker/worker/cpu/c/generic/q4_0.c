/* Q4_0 (d, qs[16]): (q - 8) d, the low nibbles the first 16 values, the high nibbles the next 16 */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); u8x16 q = u8_at(b + 2);
  w[0] = (fu8(q & 15) - 8.0f) * d; w[1] = (fu8(q >> 4) - 8.0f) * d; }
#ifdef PP_INT  /* the integer path (q8.h): q - 8 as signed bytes */
#define IQ_SIGNED 1
static inline i8x32 iq32(const unsigned char* b, int g) {
  u8x16 q = u8_at(b + 2), lo = q & 15, hi = q >> 4;
  return (i8x32)__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) - 8; }
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = 0; }
#endif
