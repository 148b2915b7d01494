/* Q4_1 (d, m, qs[16]): q d + m */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b), m = half_at(b + 2); u8x16 q = u8_at(b + 4);
  w[0] = fu8(q & 15) * d + m; w[1] = fu8(q >> 4) * d + m; }
