/* Q4_0 (d, qs[16]): (q - 8) d, the low nibbles the first 16 values, the high nibbles the next 16 */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); u8x16 q = u8_at(b + 2);
  w[0] = (fu8(q & 15) - 8.0f) * d; w[1] = (fu8(q >> 4) - 8.0f) * d; }
#ifdef PP_INT  /* the integer path (q8.h): q - 8 as signed bytes */
#define IQ_SIGNED 1
#define GROUP_OFF 8  /* rows in groups (matmul_groups.h): q unsigned, less 8 */
static inline i8x32 iq32(const unsigned char* b, int g) { return (i8x32)nibbles32(b + 2) - 8; }
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = 0; }
#endif
