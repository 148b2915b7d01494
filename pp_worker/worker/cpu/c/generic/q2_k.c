/* Q2_K (scales[16], qs[64], d, dmin): group g is bit pair g % 4 of qs[32 (g / 4) ..]; each half of it a sub-block of
   16 with a 4-bit scale (low nibble of scales[2g + half]) and a 4-bit min (its high nibble) */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b + 80), dmin = half_at(b + 82); const unsigned char* q = b + 16 + 32 * (g >> 2);
  for (int h = 0; h < 2; h++) { int sc = b[2 * g + h];
    w[h] = fu8((u8_at(q + 16 * h) >> (2 * (g & 3))) & 3) * (d * (sc & 15)) - dmin * (sc >> 4); } }
