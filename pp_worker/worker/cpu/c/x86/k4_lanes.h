/* One row of x with AVX-512, Q4_K and Q5_K: a 64-byte half of a block's nibbles read as 16 int32 lanes of 8 nibbles
   each, and nibble m of all 16 lanes looked up at once (vpermps reads only an index's low 4 bits: a shift per 16
   values, no widening load). Q5_K's fifth bits are shifted out of qh (its 32 bytes in both halves of a vector) to bit
   4 per lane, joined to the nibble by one bitwise select (vpternlogd, written out: the same select in plain C gained
   1.02x) and looked up in a table of 32 (vpermi2ps): 1.18-1.27x the fifth bit looked up on its own and added.
   Lanes 0-7 hold values of one group and lanes 8-15 of another, so the lookup is of q itself, a group's scale
   multiplies its sum (d * sum(q x)) and its min x's group sum (dmin * m * sum(x)): the dequantized product
   rearranged, exact to float32 rounding. x is put in the lanes' order once per call (xp), its group sums with it
   (xs). Cache-hot, one thread, 512 rows: Q4_K 1.3-1.5x the group-by-group lookup, Q5_K 1.1-1.2x its decoder. A
   block's 8 scales and 8 mins come out as one vector (scale_min), and the mins' products are summed with the rest at
   the row's end: a further 1.14-1.25x (bench/NOTES.md). The including file defines QS (where the nibbles start),
   HIGH_BITS (what a block reads before its halves) and VALUE(h, m) (the 16 lanes' value m of half h, as floats). */
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int g = 0; g < 8 * nb; g++) xs[g] = hsum(f_at(x + 32 * g) + f_at(x + 32 * g + 16));
  /* lane l, nibble m of half c: byte 4 l + m / 2 of its 64 (lanes 8-15 a group further), low nibble if m even */
  LANES(xp, x, 2 * nb, 128, 8, 32 * (m & 1) + m / 2 + 4 * (l % 8) + 64 * (l / 8))
  return xp;
}
#define HALF(h) { \
  u32x16 q; __builtin_memcpy(&q, b + QS + 64 * h, 64); \
  const float* p = xp + 256 * j + 128 * h; \
  f16v e = 0, o = 0; \
  _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m += 2) { \
    e += VALUE(h, m) * f_at(p + 16 * m); \
    o += VALUE(h, m + 1) * f_at(p + 16 * m + 16); } \
  acc += e * SPLAT2(ds, 4 * h, 4 * h + 2) + o * SPLAT2(ds, 4 * h + 1, 4 * h + 3); }
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict xp,
                                   const float* restrict xs, int nb) {
  f16v acc = 0, mins = 0;  /* mins: lanes 8-15, with dm */
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    f16v ds = scale_min(b); f8v s; __builtin_memcpy(&s, xs + 8 * j, 32);
    mins += ds * __builtin_shufflevector((f8v)0, s, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    HIGH_BITS
    HALF(0) HALF(1)
  }
  return hsum(acc - mins);
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
