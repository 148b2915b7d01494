/* out (B, N) = x (B, K) @ W (N, K)^T; dims = {N, B, threads}. Rows of W split over the threads (core_id), ROWS rows
   decoded at a time into wbuf (L1), each then multiplied with the B rows of x. Only K is fixed in the source (it
   sizes wbuf and unrolls), so a model needs one kernel per (type, K), whatever its row counts and call sizes. One
   row of x takes row.h's products (the type's one-row product where it has one). */
#include "row.h"
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  enum { K = PP_K, R = PP_ROWS, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK, V = K / 16 };
  const int N = dims[0], B = dims[1], T = dims[2];
  int per = ((N + R - 1) / R + T - 1) / T * R, n0 = core_id * per, n1 = n0 + per < N ? n0 + per : N;
  if (B == 1) {  /* one row of x (row.h) */
    row_products(out, w, x, n0, n1);
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
