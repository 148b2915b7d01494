/* One row of x with AVX-512, Q5_0 and Q5_1 (the fallbacks llama.cpp writes in K-quant files for rows that are not
   whole 256-value blocks, as in models 896 wide): a block's 16 bytes widened once to 16 int32 lanes, the low nibbles
   and (shifted) the high ones each joined to their fifth bits (qh shifted per lane to bit 4) by one bitwise select
   (vpternlogd) and looked up as floats in a table of 32 (vpermi2ps), q - 16 for Q5_0; the block's d scales the sum of
   its 32 products, and Q5_1's m multiplies x's sum per block, taken once per call. Cache-hot, one thread, 1536x512:
   Q5_0 1.36x and Q5_1 1.13x their decoders (bench/NOTES.md). The including file defines Q5_QH (qh's offset), Q5_MIN
   (whether blocks have a min) and Q5_OFF (what the table adds to q). */
#if defined(__AVX512F__)
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
#if Q5_MIN
  for (int j = 0; j < nb; j++) xs[j] = hsum(f_at(x + 32 * j) + f_at(x + 32 * j + 16));
#endif
  return x;
}
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict x,
                                   const float* restrict xs, int nb) {
  f16v acc = 0; float mins = 0;
  const f16v lo32 = FIOTA + Q5_OFF, hi32 = FIOTA + (16 + Q5_OFF);
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    unsigned int qh; __builtin_memcpy(&qh, b + Q5_QH, 4);
    i32x16 q = i32_at(b + Q5_QH + 4);
    u32x16 h = (u32x16)qh;
    f16v s = LOOK5(lo32, hi32, q, (h << 4) >> IOTA) * f_at(x + 32 * j)
           + LOOK5(lo32, hi32, q >> 4, h >> (IOTA + 12)) * f_at(x + 32 * j + 16);
    acc += half_at(b) * s;
#if Q5_MIN
    mins += half_at(b + 2) * xs[j];
#endif
  }
  return hsum(acc) + mins;
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
#endif
