/* What matmul.c and moe.c share: the type's decoder and one-row product picked (the type's files before give
   decode32_generic, and may give a SIMD DECODE32, and ROW_DOT and PREP_X, or row_dot_generic and prep_x_generic with
   ROW_DOT_GENERIC), the products of one row of x with rows [n0, n1) of W, and the decoding of a few rows of W into
   fp16 lanes for products with several rows of x. */
#ifndef DECODE32
#define DECODE32 decode32_generic
#endif
#if !defined(ROW_DOT) && defined(ROW_DOT_GENERIC)
#define ROW_DOT row_dot_generic
#define PREP_X prep_x_generic
#endif
static inline __attribute__((always_inline)) void row_products(float* restrict out, const unsigned char* restrict w,
                                                               const float* restrict x, int n0, int n1) {
  enum { K = PP_K, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK };
#ifdef ROW_DOT  /* the type's own one-row product, x prepared once per call (into xp, or as it is) */
  float xp[K] __attribute__((aligned(64))), xs[K / 16];
  const float* xr = PREP_X(x, xp, xs, NB);
  for (int n = n0; n < n1; n++) out[n] = ROW_DOT(w + (long)n * NB * BB, xr, xs, NB);
#else  /* each block decoded into registers and used at once */
  for (int n = n0; n < n1; n++) {
    const unsigned char* row = w + (long)n * NB * BB;
    f16v acc0 = 0, acc1 = 0;
    for (int j = 0; j < NB; j++)
      _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++) {
        f16v v[2];
        DECODE32(row + j * BB, g, v);
        acc0 += v[0] * f_at(x + j * QK + 32 * g);
        acc1 += v[1] * f_at(x + j * QK + 32 * g + 16);
      }
    out[n] = hsum(acc0 + acc1);
  }
#endif
}

/* Blocks [j0, j1) of rows [n, n + r_n) of W decoded into wbuf (r_n <= the caller's R rows of PP_K / 16 vectors), at
   their places in the rows: done once, then used with every row of x the caller has. */
static inline __attribute__((always_inline)) void decode_blocks(f16v (*restrict wbuf)[PP_K / 16],
                                                                const unsigned char* restrict w, int n, int r_n,
                                                                int j0, int j1) {
  enum { QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = PP_K / QK };
  for (int r = 0; r < r_n; r++)
    for (int j = j0; j < j1; j++)
      _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++)
        DECODE32(w + (long)(n + r) * NB * BB + j * BB, g, &wbuf[r][j * (QK / 16) + 2 * g]);
}
/* Rows [n, n + r_n) of W decoded whole. */
static inline __attribute__((always_inline)) void decode_rows(f16v (*restrict wbuf)[PP_K / 16],
                                                              const unsigned char* restrict w, int n, int r_n) {
  decode_blocks(wbuf, w, n, r_n, 0, PP_K / BLOCK_VALUES);
}
