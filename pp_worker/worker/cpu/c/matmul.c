/* out (B, N) = x (B, K) @ W (N, K)^T; dims = {N, B, threads}. Rows of W split over the threads (core_id), ROWS rows
   decoded at a time into wbuf (L1), then multiplied with a block of XB rows of x, XT at a time (a tile). Only K is
   fixed in the source (it sizes wbuf and unrolls), so a model needs one kernel per (type, K), whatever its row counts
   and call sizes. One row of x takes row.h's products (the type's one-row product where it has one). */
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
   one of 128), and each weight row is decoded once a block */
enum { XB_FIT = (512 << 10) / (4 * K) / XT * XT, XB = XB_FIT < XT ? XT : XB_FIT > 64 ? 64 : XB_FIT };
static inline lanes lanes_at(const float* p) { lanes v; __builtin_memcpy(&v, p, sizeof v); return v; }
/* v steps a tile takes per pass before the next pass: with H passes each reads half of every cache line of its
   weight and x rows, so a pass over the whole K (R + XT rows of 8 KiB at K 2048, past the L1) fetched every line
   from the L2 twice; a chunk of 32 steps of the R + XT rows (14 KiB) stays in the L1 for the next pass */
enum { VC = H == 1 ? V : 32 };
/* the R decoded rows' products with nx rows of x (nx a constant where it is inlined), each (row, x) summed in 16
   lanes over K in order, then hsum: whatever the tile, the floats of one row of x at a time */
static inline __attribute__((always_inline)) void tile(float* restrict out, int N, const f16v (*restrict wbuf)[V],
                                                       const float* restrict x, int r_n, int nx) {
  float sums[XT][R][16] __attribute__((aligned(64)));
  for (int v0 = 0; v0 < V; v0 += VC)
    _Pragma("clang loop unroll(full)") for (int h = 0; h < H; h++) {
      lanes acc[XT][R];  /* a lane's sum so far (the chunks before), carried through sums */
      _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
        _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++)
          acc[i][r] = v0 == 0 ? 0 : lanes_at(&sums[i][r][16 / H * h]);
      for (int v = v0; v < V && v < v0 + VC; v++) {  /* the tile's x vectors held, each weight vector loaded once */
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
          __builtin_memcpy(&sums[i][r][16 / H * h], &acc[i][r], sizeof(lanes));
    }
  for (int i = 0; i < nx; i++)
    for (int r = 0; r < r_n; r++) out[(long)i * N + r] = hsum(f_at(sums[i][r]));
}
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  const int N = dims[0], B = dims[1], T = dims[2];
  int per = ((N + R - 1) / R + T - 1) / T * R, n0 = core_id * per, n1 = n0 + per < N ? n0 + per : N;
  if (B == 1) {  /* one row of x (row.h) */
    row_products(out, w, x, n0, n1);
    return;
  }
  f16v wbuf[R][V];
  for (int b0 = 0; b0 < B; b0 += XB) {  /* a block of x that stays in L2 while the part's weight rows pass it */
    int b1 = b0 + XB < B ? b0 + XB : B;
    for (int n = n0; n < n1; n += R) {
      int r_n = n1 - n < R ? n1 - n : R;
      decode_rows(wbuf, w, n, r_n);
      int bi = b0;
      for (; bi + XT <= b1; bi += XT) tile(out + (long)bi * N + n, N, wbuf, x + (long)bi * K, r_n, XT);
      for (; bi < b1; bi++) tile(out + (long)bi * N + n, N, wbuf, x + (long)bi * K, r_n, 1);  /* the last rows */
    }
  }
}
