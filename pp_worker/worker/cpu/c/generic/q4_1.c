/* Q4_1 (d, m, qs[16]): q d + m */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b), m = half_at(b + 2); u8x16 q = u8_at(b + 4);
  w[0] = fu8(q & 15) * d + m; w[1] = fu8(q >> 4) * d + m; }
#ifdef PP_INT  /* the integer path (q8.h): unsigned nibbles; the block's min m through the offsets (d u - (-m) 1) */
#define IQ_SIGNED 0
static inline u8x32 iq32(const unsigned char* b, int g) { return nibbles32(b + 4); }
#define IQ_MIN 1  /* the min: M times the sum of x's block */
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = -half_at(b + 2); }
#endif
