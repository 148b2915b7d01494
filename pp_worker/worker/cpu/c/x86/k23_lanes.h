/* One row of x with AVX-512, Q2_K and Q3_K: a block's 64 bytes of 2-bit pairs read as 16 int32 lanes of 16 pairs
   (lane l: bytes 4 l to 4 l + 3), and pair m of all 16 lanes looked up at once as floats in a table of 16 (vpermps
   reads an index's low 4 bits: the pairs above need no mask where the table repeats). Value m of lane l is weight
   128 (l / 8) + 32 (m % 4) + 4 (l % 8) + m / 4 of the block, of sub-block 8 (l / 8) + 2 (m % 4) + (l % 8) / 4: the
   four m of one m % 4 share their lanes' scales, applied once to their sum. Q3_K's third bits (hmask: bit
   8 (m / 4) + 4 (l / 8) + m % 4 of its int32 l % 8) join the pair by one shift per lane and one bitwise select, its
   table holding q - 4 itself; Q2_K's mins multiply x's sums per 16, taken once per call. x is put in the lanes' order
   once per call (xp): the dequantized product rearranged, exact to float32 rounding. Cache-hot, one thread, 1536x512:
   Q2_K 1.38-1.59x and Q3_K 1.24-1.25x their products over 16-value groups (bench/NOTES.md). The including file
   defines QS, MINS, TABLE, INDEX (value m's index into TABLE), HIGH_BITS and SCALES (sd: the 16 sub-blocks'). */
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
#if MINS  /* x's sums per 16, for Q2_K's mins */
  for (int s = 0; s < 16 * nb; s++) xs[s] = hsum(f_at(x + 16 * s));
#endif
  LANES(xp, x, nb, 256, 16, 128 * (l / 8) + 32 * (m % 4) + 4 * (l % 8) + m / 4)
  return xp;
}
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict xp,
                                   const float* restrict xs, int nb) {
  f16v acc = 0, mins = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    f16v sd;  /* the 16 sub-blocks' scales */
    SCALES
    u32x16 q; __builtin_memcpy(&q, b + QS, 64);
    HIGH_BITS
    const float* p = xp + 256 * j;
    f16v e[4] = {0};
    _Pragma("clang loop unroll(full)") for (int m = 0; m < 16; m++)
      e[m % 4] += LOOK(TABLE, (i32x16)(INDEX)) * f_at(p + 16 * m);
    acc += e[0] * SPLAT4(sd, 0, 1, 8, 9) + e[1] * SPLAT4(sd, 2, 3, 10, 11) + e[2] * SPLAT4(sd, 4, 5, 12, 13)
         + e[3] * SPLAT4(sd, 6, 7, 14, 15);
  }
  return hsum(acc - mins);
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
