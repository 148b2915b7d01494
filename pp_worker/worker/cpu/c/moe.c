/* Mixture-of-experts products: out (M, N), row m = x[m / XDIV] (K) @ W[ids[m]]^T, W the (E, N, K) experts of one
   GGUF tensor, expert e's N rows after expert e-1's; dims = {N, M, XDIV, E, threads}. A slot m is one (token, routed
   expert) pair: XDIV = k when every routed expert of a token reads the token's one input row (gate, up), 1 when each
   slot has its own (down). Slots are grouped by expert, so an expert routed to by several tokens (sessions of a batch,
   tokens of a prefill chunk) has its rows decoded once for all of them, and an expert no slot names is never read.
   The ids come from a buffer written by the forward itself: the compiled graph is the same whatever the routing.
   Rows split over the threads (core_id) as in matmul.c; the type's files give DECODE32 and the one-row product. */
#include "row.h"
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict ids,
          const int* restrict dims, int core_id) {
  enum { K = PP_K, R = PP_ROWS, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK, V = K / 16 };
  const int N = dims[0], M = dims[1], XDIV = dims[2], E = dims[3], T = dims[4];
  int n0, n1; rows_part(N, R, T, core_id, &n0, &n1);
  if (n0 >= n1) return;
  int slots[M > 0 ? M : 1];
  for (int e = 0; e < E; e++) {
    int c = 0;
    for (int m = 0; m < M; m++)
      if (ids[m] == e) slots[c++] = m;
    if (c == 0) continue;  /* not routed to: its bytes are not touched */
    const unsigned char* we = w + (long)e * N * NB * BB;
    if (c == 1) {  /* one slot: one row of x (row.h), as matmul.c's B = 1 */
      row_products(out + (long)slots[0] * N, we, x + (long)(slots[0] / XDIV) * K, n0, n1);
      continue;
    }
    f16v wbuf[R][V];  /* several slots: R rows decoded once, each multiplied with every slot's input */
    for (int n = n0; n < n1; n += R) {
      int r_n = n1 - n < R ? n1 - n : R;
      decode_rows(wbuf, we, n, r_n);
      for (int s = 0; s < c; s++) {
        const float* xb = x + (long)(slots[s] / XDIV) * K;
        f16v acc[R] = {0};
        for (int v = 0; v < V; v++) {
          f16v xv = f_at(xb + 16 * v);
          for (int r = 0; r < R; r++) acc[r] += wbuf[r][v] * xv;
        }
        for (int r = 0; r < r_n; r++) out[(long)slots[s] * N + n + r] = hsum(acc[r]);
      }
    }
  }
}
