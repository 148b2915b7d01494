/* Q3_K (hmask[32], qs[64], scales[12], d): as Q2_K, with a third bit from bit g of hmask[16 half ..] (clear: the value
   is 4 less) and 6-bit signed scales (minus 32) per 16, their low nibbles in bytes 0-7 and high bit pairs in bytes
   8-11 (ggml's kmask shuffle in dequantize_row_q3_K) */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b + 108); const unsigned char* q = b + 32 + 32 * (g >> 2), *s = b + 96;
  for (int h = 0; h < 2; h++) { int i = 2 * g + h;
    int sc = ((i < 8 ? s[i] & 15 : s[i - 8] >> 4) | ((s[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4) - 32;
    u8x16 v = ((u8_at(q + 16 * h) >> (2 * (g & 3))) & 3) | (((u8_at(b + 16 * h) >> g) & 1) << 2);
    w[h] = (fu8(v) - 4.0f) * (d * sc); } }
