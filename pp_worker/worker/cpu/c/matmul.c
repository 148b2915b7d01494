/* out (B, N) = x (B, K) @ W (N, K)^T; dims = {N, B, threads}. Rows of W split over the threads (core_id), ROWS rows
   decoded at a time into wbuf (L1), a chunk of K at a time (the whole K with AVX-512), then multiplied with a block
   of XB rows of x, XT at a time (a tile). Only K is fixed in the source (it sizes wbuf and unrolls), so a model needs
   one kernel per (type, K), whatever its row counts and call sizes. One row of x takes row.h's products (the type's
   one-row product where it has one). */
#include "row.h"
enum { K = PP_K, R = PP_ROWS, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK, V = K / 16 };
#if defined(__AVX512F__)
/* rows of x per tile: R x XT accumulators (16 of the 32 registers), so each weight vector loaded serves XT products
   and each x vector R (one row of x at a time, 5 loads fed 4 multiply-adds: the loads were the limit) */
enum { XT = 4, H = 1 };  /* H: the passes over K a tile makes, each on 16 / H lanes of every 16 values */
typedef f16v lanes;
#else
/* 16 registers of 8 floats: a pass takes the low 8 lanes of every 16 values, a second the high 8, each with R x XT
   accumulators of 8 (a lane's sums are the same operations either way): 12 accumulators, 3 x vectors and one weight
   vector, 7 loads for 12 multiply-adds */
enum { XT = 3, H = 2 };
typedef f8v lanes;
#endif
/* rows of x per block: a block is read again for every R weight rows, so it is held to 512 KiB (half an L2 of 1 MiB;
   the whole of a 256-token chunk of K 2048 is 2 MiB: read from L3 every time, it made a chunk of 256 slower than
   one of 128), and each weight row is decoded once a block; whole tiles, and a call's blocks about even (256 rows of
   x in 4 blocks of 64 took 4 rows one at a time, with XT 3) */
enum { XB_MAX = (64 + XT - 1) / XT * XT, XB_FIT = (512 << 10) / (4 * K) / XT * XT,
       XB = XB_FIT < XT ? XT : XB_FIT > XB_MAX ? XB_MAX : XB_FIT };
static inline lanes lanes_at(const float* p) { lanes v; __builtin_memcpy(&v, p, sizeof v); return v; }
/* v steps of K a chunk: the chunk's R decoded rows stay in the L1 while every tile of the block passes them, each
   tile's x rows read from the L2 once a chunk (with H passes, the second pass reads them from the L1). The weights
   of a whole K (R rows of 8 KiB at K 2048) did not fit the L1 beside the x rows, so every tile read both from the L2:
   more bytes than the L2 gives a core at 2 FMAs a cycle of 8 lanes */
enum { QV = QK / 16, NC = H == 1 || V < 48 ? 1 : (V + 16) / 32,  /* chunks of ~24-47 steps, about even, whole blocks */
       VC = ((V + NC - 1) / NC + QV - 1) / QV * QV };
/* steps [v0, v1) of the R decoded rows' products with nx rows of x (nx a constant where it is inlined), each (row, x)
   summed in 16 lanes over K in order (sums: the lanes so far, carried from chunk to chunk), then hsum: whatever the
   tile or the chunk, the floats of one row of x at a time */
static inline __attribute__((always_inline)) void tile(float (*restrict sums)[R][16], const f16v (*restrict wbuf)[V],
                                                       const float* restrict x, int v0, int v1, int nx) {
  _Pragma("clang loop unroll(full)") for (int h = 0; h < H; h++) {
    lanes acc[XT][R];
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
      _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++)
        acc[i][r] = v0 == 0 ? 0 : lanes_at(&sums[i][r][16 / H * h]);
    for (int v = v0; v < v1; v++) {  /* the tile's x vectors held, each weight vector loaded once */
      lanes xv[XT];
      _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
        if (i < nx) xv[i] = lanes_at(x + (long)i * K + 16 * v + 16 / H * h);
      _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++) {
        lanes wv = lanes_at((const float*)&wbuf[r][v] + 16 / H * h);
        _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++) if (i < nx) acc[i][r] += wv * xv[i];
      }
    }
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
      _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++)
        if (i < nx) __builtin_memcpy(&sums[i][r][16 / H * h], &acc[i][r], sizeof(lanes));
  }
}
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  const int N = dims[0], B = dims[1], T = dims[2];
  int n0, n1; rows_part(N, R, T, core_id, &n0, &n1);
  if (B == 1) {  /* one row of x (row.h) */
    row_products(out, w, x, n0, n1);
    return;
  }
  f16v wbuf[R][V];
  float sums[XB][R][16] __attribute__((aligned(64)));  /* each (row of x, weight row)'s lanes */
  const int blocks = B > XB ? (B + XB - 1) / XB : 1, bs = ((B + blocks - 1) / blocks + XT - 1) / XT * XT;  /* <= XB */
  for (int b0 = 0; b0 < B; b0 += bs) {  /* a block of x that stays in L2 while the part's weight rows pass it */
    int b1 = b0 + bs < B ? b0 + bs : B;
    for (int n = n0; n < n1; n += R) {
      int r_n = n1 - n < R ? n1 - n : R;
      for (int v0 = 0; v0 < V; v0 += VC) {  /* a chunk of the rows against every row of x of the block */
        int v1 = v0 + VC < V ? v0 + VC : V, bi = b0;
        decode_blocks(wbuf, w, n, r_n, v0 / QV, v1 / QV);  /* just before its use: L1-hot */
        for (; bi + XT <= b1; bi += XT) tile(sums + (bi - b0), wbuf, x + (long)bi * K, v0, v1, XT);
        switch (b1 - bi) {  /* the last rows, fewer than XT, in one tile */
          case 1: tile(sums + (bi - b0), wbuf, x + (long)bi * K, v0, v1, 1); break;
          case 2: tile(sums + (bi - b0), wbuf, x + (long)bi * K, v0, v1, 2); break;
          case 3: if (XT > 3) tile(sums + (bi - b0), wbuf, x + (long)bi * K, v0, v1, 3); break;
        }
      }
      for (int bi = b0; bi < b1; bi++)
        for (int r = 0; r < r_n; r++) out[(long)bi * N + n + r] = hsum(f_at(sums[bi - b0][r]));
    }
  }
}
