/* out (B, N) = x (B, K) @ W (N, K)^T; dims = {N, B, threads}. Rows of W split over the threads (core_id), ROWS rows
   decoded at a time into wbuf (L1), each then multiplied with the B rows of x. Only K is fixed in the source (it
   sizes wbuf and unrolls), so a model needs one kernel per (type, K), whatever its row counts and call sizes. The
   type's files before this one give decode32_generic, and may give a SIMD DECODE32, and a one-row product
   (ROW_DOT and PREP_X, or row_dot_generic and prep_x_generic with ROW_DOT_GENERIC). */
#ifndef DECODE32
#define DECODE32 decode32_generic
#endif
#if !defined(ROW_DOT) && defined(ROW_DOT_GENERIC)
#define ROW_DOT row_dot_generic
#define PREP_X prep_x_generic
#endif
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  enum { K = PP_K, R = PP_ROWS, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK, V = K / 16 };
  const int N = dims[0], B = dims[1], T = dims[2];
  int per = ((N + R - 1) / R + T - 1) / T * R, n0 = core_id * per, n1 = n0 + per < N ? n0 + per : N;
  if (B == 1) {  /* one row of x: each block decoded into registers and used at once */
#ifdef ROW_DOT  /* or the type's own one-row product, x prepared once per call (into xp, or as it is) */
    float xp[K] __attribute__((aligned(64))), xs[K / 16];
    const float* xr = PREP_X(x, xp, xs, NB);
    for (int n = n0; n < n1; n++) out[n] = ROW_DOT(w + (long)n * NB * BB, xr, xs, NB);
#else
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
    return;
  }
  f16v wbuf[R][V];
  for (int n = n0; n < n1; n += R) {
    int r_n = n1 - n < R ? n1 - n : R;
    for (int r = 0; r < r_n; r++)
      for (int j = 0; j < NB; j++)
        _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++)
          DECODE32(w + (long)(n + r) * NB * BB + j * BB, g, &wbuf[r][j * (QK / 16) + 2 * g]);
    for (int bi = 0; bi < B; bi++) {
      const float* xb = x + (long)bi * K;
      f16v acc[R] = {0};
      for (int v = 0; v < V; v++) {
        f16v xv = f_at(xb + 16 * v);
        for (int r = 0; r < R; r++) acc[r] += wbuf[r][v] * xv;
      }
      for (int r = 0; r < r_n; r++) out[(long)bi * N + n + r] = hsum(acc[r]);
    }
  }
}
