/* out (B, N) = x (B, K) @ W (N, K)^T; dims = {N, B, threads} (F16's: and whether x comes as panels, `gemm`). Rows
   of W split over the threads (core_id), ROWS rows at a time, a chunk of K at a time (the whole K with AVX-512),
   multiplied with a block of XB rows of x, XT at a time (a tile). fp16 rows (ROWS_F16) are read as they are, each
   vector converted as the tile loads it; other types' rows are decoded a chunk at a time into wbuf (L1) first. Only
   K is fixed in the source (it sizes wbuf and unrolls), so a model needs one kernel per (type, K), whatever its row
   counts and call sizes. One row of x takes row.h's products (the type's one-row product where it has one). */
#include "row.h"
/* weight rows a step of a tile: PP_ROWS (4), and 6 in F16's AVX-512 tile (rows converted as they load): 24 sums in
   registers, each x vector loaded serving 6 products instead of 4, the conversions as many a multiply-add. On an
   Intel Xeon (two 512-bit FMA pipes) its x from the L2 was the limit: one thread 1.1-1.37x at 8-256 rows of x
   (bench/NOTES.md, "Prefill on an Intel Xeon") */
#if defined(__AVX512F__) && defined(ROWS_F16)
#define TILE_ROWS 6
#else
#define TILE_ROWS PP_ROWS
#endif
enum { K = PP_K, R = TILE_ROWS, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK, V = K / 16 };
#if defined(__AVX512F__)
/* rows of x per tile: R x XT accumulators (16 or 24 of the 32 registers), so each weight vector loaded serves XT
   products and each x vector R (one row of x at a time, 5 loads fed 4 multiply-adds: the loads were the limit) */
enum { XT = 4, H = 1 };  /* H: the passes over K a tile makes, each on 16 / H lanes of every 16 values */
typedef f16v lanes;
typedef h16x16 hlanes;
#else
/* 16 registers of 8 floats: a pass takes the low 8 lanes of every 16 values, a second the high 8, each with R x XT
   accumulators of 8 (a lane's sums are the same operations either way): 12 accumulators, 3 x vectors and one weight
   vector, 7 loads for 12 multiply-adds */
enum { XT = 3, H = 2 };
typedef f8v lanes;
typedef h16x8 hlanes;
#define SPLIT_X  /* a block of x copied as the passes read it (`split_rows`) */
#endif
/* rows of x per block: a block is read again for every R weight rows, so it is held to 512 KiB (half an L2 of 1 MiB;
   the whole of a 256-token chunk of K 2048 is 2 MiB: read from L3 every time, it made a chunk of 256 slower than
   one of 128), and each weight row is read once a block; whole tiles, and a call's blocks about even (256 rows of
   x in 4 blocks of 64 took 4 rows one at a time, with XT 3) */
enum { XB_MAX = (64 + XT - 1) / XT * XT, XB_FIT = (512 << 10) / (4 * K) / XT * XT,
       XB = XB_FIT < XT ? XT : XB_FIT > XB_MAX ? XB_MAX : XB_FIT };
static inline lanes lanes_at(const float* p) { lanes v; __builtin_memcpy(&v, p, sizeof v); return v; }
/* v steps of K a chunk (without AVX-512): the chunk's R rows stay in the L1 while every tile of the block passes
   them. The decoded weights of a whole K (R rows of 8 KiB at K 2048) did not fit the L1 beside the x rows, so every
   tile read both from the L2: more bytes than the L2 gives a core at 2 FMAs a cycle of 8 lanes; fp16 rows read as
   they are, whole, still lost 0.85x at K 5632. AVX-512's tile gained nothing from chunks (0.97-1.0x). */
enum { QV = QK / 16, NC = H == 1 || V < 48 ? 1 : (V + 16) / 32,  /* chunks of ~24-47 steps, about even, whole blocks */
       VC = ((V + NC - 1) / NC + QV - 1) / QV * QV, XS = 16 / H };  /* XS: floats of x a pass takes a step */
/* F16's rows are read as they are (`ROWS_F16`) or, from F16_DECODE_FROM rows of x a call on (PP_F16_DECODE_FROM,
   kernels.py: 0 never; only without AVX-512), decoded a chunk at a time into wbuf as the other types': where
   converting fp16 takes an FMA slot (Intel's cores) a conversion every 3 multiply-adds cost more than the decode,
   once for the whole block of x (an Intel Xeon, one thread: 1.1-1.4x at 12-64 rows of x, 0.56-0.98x at 2-8;
   bench/NOTES.md, "Prefill on an Intel Xeon") */
#if defined(ROWS_F16) && defined(PP_F16_DECODE_FROM) && !defined(__AVX512F__)
enum { F16_DECODE_FROM = PP_F16_DECODE_FROM };
#else
enum { F16_DECODE_FROM = 0 };
#endif
typedef const unsigned char* wsrc;  /* a row's bytes, or its floats decoded into wbuf */
/* row r's vector of step v, pass h: decoded, floats from wbuf; else its fp16 values converted as they are loaded
   (vcvtph2ps from memory). Against rows decoded into wbuf first, one thread 1.2-1.5x with either build on Zen 4: no
   decoded copy to write and read back, and half the bytes in the L1 (bench/NOTES.md, "AVX2 F16 tile") */
static inline lanes w_at(wsrc row, int v, int h, int decoded) {
#ifdef ROWS_F16
  if (!decoded) {
    hlanes q; __builtin_memcpy(&q, row + 2 * (16 * v + XS * h), sizeof q); return __builtin_convertvector(q, lanes); }
#endif
  return lanes_at((const float*)row + 16 * v + XS * h);
}
#ifdef ROWS_F16
/* The first tile of a call's first block reads the rows from memory; it asks for the line at the same place of the
   rows AHEAD groups of R rows on (~48 KiB ahead) into the L2, a line a row every other step (32 bytes a step).
   Without it a few rows of x waited on memory: R rows read side by side are streams the hardware's prefetch did
   not keep ahead of (one thread from DRAM at K 576 and 4 rows of x: 3.6 G weights/s against 12.5 from the L2, now
   11.3; K 2048 6.8 -> 10.9). Into the L1 (prefetcht0) the lines pushed out the tile's own rows and x: 1.25x at
   best, a loss at K 2048 (bench/NOTES.md, "A few rows of x from memory"). */
enum { AHEAD = (48 << 10) / (R * 2 * K) > 1 ? (48 << 10) / (R * 2 * K) : 1 };
static inline void ask_ahead(const wsrc* restrict wr, int v) {
  if (!(v & 1))
    _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++)
      __builtin_prefetch(wr[r] + 32 * v + (long)AHEAD * R * 2 * K, 0, 2);
}
#else
static inline void ask_ahead(const wsrc* restrict wr, int v) { (void)wr, (void)v; }  /* rows decoded: L1-hot */
#endif
/* steps [v0, v1) of R weight rows' products with nx rows of x (nx a constant where it is inlined), each (row, x)
   summed in 16 lanes over K in order (sums: the lanes so far, carried from chunk to chunk), then hsum: whatever the
   tile or the chunk, the floats of one row of x at a time. x: the tile's first row at the chunk's first step, xr
   floats a row; with H passes each row's chunk holds its pass 0 lanes of every step, then pass 1's (`split_rows`).
   ahead: the tile that reads the rows from memory (`ask_ahead`); decoded: wr are rows decoded into wbuf. */
static inline __attribute__((always_inline)) void tile(float (*restrict sums)[R][16], const wsrc* restrict wr,
                                                       const float* restrict x, long xr, int v0, int v1, int nx,
                                                       int ahead, int decoded) {
  _Pragma("clang loop unroll(full)") for (int h = 0; h < H; h++) {
    lanes acc[XT][R];
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
      _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++)
        acc[i][r] = v0 == 0 ? 0 : lanes_at(&sums[i][r][XS * h]);
    const float* xh = x + (long)h * XS * (v1 - v0);
    for (int v = v0; v < v1; v++) {  /* the tile's x vectors held, each weight vector loaded once */
      if (ahead && h == 0 && !decoded) ask_ahead(wr, v);
      lanes xv[XT];
      _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
        if (i < nx) xv[i] = lanes_at(xh + i * xr + XS * (v - v0));
      _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++) {
        lanes wv = w_at(wr[r], v, h, decoded);
        _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++) if (i < nx) acc[i][r] += wv * xv[i];
      }
    }
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XT; i++)
      _Pragma("clang loop unroll(full)") for (int r = 0; r < R; r++)
        if (i < nx) __builtin_memcpy(&sums[i][r][XS * h], &acc[i][r], sizeof(lanes));
  }
}
/* One tile of nx <= XT rows of x, nx a constant in each call of `tile` (ahead: a constant where this is inlined). */
static inline __attribute__((always_inline)) void tiles(float (*restrict sums)[R][16], const wsrc* restrict wr,
                                                        const float* restrict x, long xr, int v0, int v1, int nx,
                                                        int ahead, int decoded) {
  switch (nx) {
    case 1: tile(sums, wr, x, xr, v0, v1, 1, ahead, decoded); break;
    case 2: tile(sums, wr, x, xr, v0, v1, 2, ahead, decoded); break;
    case 3: tile(sums, wr, x, xr, v0, v1, 3, ahead, decoded); break;
    default: tile(sums, wr, x, xr, v0, v1, XT, ahead, decoded);
  }
}
/* A chunk of the rows against every row of a block of nb rows of x (decoded: a constant where this is inlined) */
static inline __attribute__((always_inline)) void chunk_pass(float (*restrict sums)[R][16], const wsrc* restrict wr,
                                                             const float* restrict xc, long xr, int v0, int v1,
                                                             int nb, int first, int decoded) {
  int i = 0;
  if (first)  /* the first tile reads the rows from memory, and asks for those ahead */
    i = nb < XT ? nb : XT, tiles(sums, wr, xc, xr, v0, v1, i, 1, decoded);
  for (; i + XT <= nb; i += XT) tile(sums + i, wr, xc + i * xr, xr, v0, v1, XT, 0, decoded);
  if (i < nb) tiles(sums + i, wr, xc + i * xr, xr, v0, v1, nb - i, 0, decoded);  /* the last rows, fewer than XT */
}
/* With H passes: a block's rows of x copied chunk after chunk, each row's chunk as its pass 0 lanes of every step,
   then its pass 1 lanes. In place, pass 0 read the low half of every line of x and pass 1 the high half from the L1,
   so pass 0 asked the L2 for all of a tile's x lines, twice what it gives a core in that time; split, each pass
   streams half (one thread 1.1-1.2x, bench/NOTES.md, "AVX2 F16 tile"). A block is copied once for all of W's
   rows. */
static void split_rows(float* restrict xs, const float* restrict x, int rows) {
  for (int v0 = 0; v0 < V; v0 += VC) {
    const int n = v0 + VC < V ? VC : V - v0;
    for (int j = 0; j < rows; j++)
      for (int h = 0; h < H; h++)
        for (int v = 0; v < n; v++)
          __builtin_memcpy(xs + 16L * v0 * rows + 16L * j * n + XS * (h * n + v),
                           x + (long)j * K + 16 * (v0 + v) + XS * h, XS * sizeof(float));
  }
}
#if defined(ROWS_F16) && defined(PP_F16_GEMM_FROM) && defined(__AVX512F__)
/* Where the caller asks for it (dims[3]: kernels.py's `f16_panels`, from F16_GEMM_FROM rows of x on Intel's cores),
   x comes as panels of 32 rows (panels.c: a value of 32 rows side by side) and F16's product is a matrix product
   with no conversion in its inner loop: GR weight rows converted once into wc (floats), then a tile of GR weight rows
   against a panel keeps GR x 2 vectors of sums in registers, each step of k loading a panel's 2 vectors and
   broadcasting GR weights, each to 2 multiply-adds. The tile above converts a weight vector every 4 multiply-adds (on
   Intel's cores on the ports of the multiply-adds) and loads its x vectors from the L2. Each output sums its products
   in order of k, GS steps at a time, whatever the call's rows. 512-bit vectors throughout (min_vector_width: clang's
   default for Intel's CPUs halves those of a function that takes none).
   K in GC chunks of KC values (whole vectors, about even, at most 2048: at K 5632 a panel's whole rows (704 KiB)
   and the converted rows (264 KiB) did not stay in the L2 together).
   GS: steps a tile sums in registers before adding them to its running sums, so that an output's rounding is the
   tile's above (whose 16 lanes each sum K / 16 steps): the rms error against float64 at K 64 / 256 / 576 / 2048,
   relative to the largest output, 2.1 / 2.8 / 3.6 / 4.6e-8 (16, 16, 32, 32) against the tile's 1.7 / 2.5 / 3.3 /
   5.4e-8; one sum over the whole chunk of K made 3.6 / 7.5 / 11.5 / 20.6e-8. 32 steps cost ~5%, 16 ~10%. */
enum { GEMM = 1, GR = 12, PW = 32, GS = K <= 256 ? 16 : 32, GC = (K + 2047) / 2048, KC = (K / 16 + GC - 1) / GC * 16,
       PB0 = (512 << 10) / (KC * PW * 4), PB = PB0 > 1 ? PB0 & ~1 : 1 };  /* panels a block: <= 512 KiB, paired */
/* what kernels.py's `f16_panels` looks for in this kernel's machine code: whether to send x as panels */
static const char gemm_mark[] __attribute__((used)) = "pp-f16-gemm";
/* out[b][c] (+)= the sum over k < kn of wc[c][k] xp[k][b], for weight rows c < cols of the tile's h and the rows b
   of x its gv vectors hold: 1 or 2 of panel xa's (h = GR), or both of xa's and 1 or 2 of xb's (h = GR / 2: two panels
   at once, each step 4 vector loads and 6 broadcasts for 24 multiply-adds, where one panel's 12 rows take 2 and 12:
   1.17x on this Xeon, bench/NOTES.md). first: out written, else added to. h and gv are constants where inlined. The
   sums of an output are the same operations whichever tile computes it, so its floats are too. ahead: the next
   weight rows (GR of them) at this chunk, asked for a line a row every GS steps (GS halves: a line or half of one) */
static inline __attribute__((always_inline)) void gemm_tile(float* restrict out_a, float* restrict out_b, long N,
                                                            const float* restrict wc, const float* restrict xa,
                                                            const float* restrict xb, int kn, int nb_a, int nb_b,
                                                            int cols, int first, int h, int gv,
                                                            const unsigned char* ahead) {
  f16v acc[GR][4], part[GR][4];
  _Pragma("clang loop unroll(full)") for (int r = 0; r < h; r++)
    _Pragma("clang loop unroll(full)") for (int v = 0; v < gv; v++) acc[r][v] = 0;
  for (int k0 = 0; k0 < kn; k0 += GS) {  /* GS steps' sums in registers (part), added to acc's */
    if (ahead)
      _Pragma("clang loop unroll(full)") for (int r = 0; r < GR; r++) __builtin_prefetch(ahead + r * 2L * K + 2 * k0, 0, 2);
    _Pragma("clang loop unroll(full)") for (int r = 0; r < h; r++)
      _Pragma("clang loop unroll(full)") for (int v = 0; v < gv; v++) part[r][v] = 0;
    for (int k = k0; k < k0 + GS && k < kn; k++) {  /* panels 64-byte aligned (f_at's copy went by halves) */
      f16v x[4];
      _Pragma("clang loop unroll(full)") for (int v = 0; v < gv; v++)
        x[v] = *(const f16v*)((v < 2 ? xa : xb) + (long)k * PW + 16 * (v % 2));
      _Pragma("clang loop unroll(full)") for (int r = 0; r < h; r++) {
        const float wv = wc[(long)r * KC + k];
        _Pragma("clang loop unroll(full)") for (int v = 0; v < gv; v++) part[r][v] += x[v] * wv;
      }
    }
    _Pragma("clang loop unroll(full)") for (int r = 0; r < h; r++)
      _Pragma("clang loop unroll(full)") for (int v = 0; v < gv; v++) acc[r][v] += part[r][v];
  }
  _Pragma("clang loop unroll(full)") for (int v = 0; v < gv; v++) {  /* 16 rows of x's sums, each a row of out */
    f16v m[16];
    _Pragma("clang loop unroll(full)") for (int r = 0; r < 16; r++) m[r] = r < h ? acc[r][v] : 0;
    transpose16(m);
    const int nb = v < 2 ? nb_a : nb_b;
    for (int b = 0; b < 16 && 16 * (v % 2) + b < nb; b++) {
      float* o = (v < 2 ? out_a : out_b) + (16 * (v % 2) + b) * N;
      if (first && cols == h) __builtin_memcpy(o, &m[b], h * sizeof(float));
      else for (int c = 0; c < cols; c++) o[c] = first ? m[b][c] : o[c] + m[b][c];
    }
  }
}
/* one panel (xb 0), or two: GR rows against one, each half of them against both */
static __attribute__((noinline, min_vector_width(512))) void gemm_tiles(float* restrict out, long N,
                                                                       const float* restrict wc,
                                                                       const float* restrict xa,
                                                                       const float* restrict xb, int kn, int nb_a,
                                                                       int nb_b, int cols, int first,
                                                                       const unsigned char* ahead) {
  enum { HR = GR / 2 };
  float* out_b = out + (long)PW * N;
  if (!xb) {
    if (nb_a > 16) gemm_tile(out, 0, N, wc, xa, 0, kn, nb_a, 0, cols, first, GR, 2, ahead);
    else gemm_tile(out, 0, N, wc, xa, 0, kn, nb_a, 0, cols, first, GR, 1, ahead);
    return;
  }
  for (int c0 = 0; c0 < cols; c0 += HR) {  /* the first half asks ahead for all GR rows */
    const int hc = cols - c0 < HR ? cols - c0 : HR;
    const unsigned char* asks = c0 ? 0 : ahead;
    if (nb_b > 16) gemm_tile(out + c0, out_b + c0, N, wc + c0 * KC, xa, xb, kn, nb_a, nb_b, hc, first, HR, 4, asks);
    else gemm_tile(out + c0, out_b + c0, N, wc + c0 * KC, xa, xb, kn, nb_a, nb_b, hc, first, HR, 3, asks);
  }
}
/* rows of x in panel p of B rows' panels: PW, the last fewer */
static inline int panel_rows(int B, int p) { return B - p * PW < PW ? B - p * PW : PW; }
/* rows [n0, n1) of W against the B rows of x in panels (xp): a block of PB panels' chunk of K (it stays in the L2)
   at a time, GR weight rows' chunk converted for each block */
static void gemm(float* restrict out, const unsigned char* restrict w, const float* restrict xp, int N, int B, int n0,
                 int n1) {
  float wc[GR * KC] __attribute__((aligned(64)));
  const int P = (B + PW - 1) / PW;
  for (int p0 = 0; p0 < P; p0 += PB)
    for (int k0 = 0; k0 < K; k0 += KC) {
      const int kn = K - k0 < KC ? K - k0 : KC;
      for (int n = n0; n < n1; n += GR) {
        const int cols = n1 - n < GR ? n1 - n : GR;
        for (int r = 0; r < GR; r++)  /* rows past n1 are row n0's again: their sums unused */
          for (int k = 0; k < kn; k += 16) {
            h16x16 q; __builtin_memcpy(&q, w + (long)(r < cols ? n + r : n0) * 2 * K + 2 * (k0 + k), sizeof q);
            const f16v f = __builtin_convertvector(q, f16v);
            __builtin_memcpy(wc + (long)r * KC + k, &f, sizeof f);
          }
        /* the first panel's tile asks for the next weight rows' chunk, converted next (from memory: a stage's
           weights are bigger than the L3) */
        const unsigned char* ahead = n + GR < n1 ? w + (long)(n + GR) * 2 * K + 2 * k0 : 0;
        const int pe = P < p0 + PB ? P : p0 + PB;
        for (int p = p0; p < pe; p += 2) {  /* panels two at a time, the last alone if odd */
          const int pair = p + 1 < pe;
          gemm_tiles(out + (long)p * PW * N + n, N, wc, xp + ((long)p * K + k0) * PW,
                     pair ? xp + ((long)(p + 1) * K + k0) * PW : 0, kn, panel_rows(B, p),
                     pair ? panel_rows(B, p + 1) : 0, cols, k0 == 0, p == p0 ? ahead : 0);
        }
      }
    }
}
#else
enum { GEMM = 0, GR = 1 };
static void gemm(float* restrict out, const unsigned char* restrict w, const float* restrict x, int N, int B, int n0,
                 int n1) { (void)out, (void)w, (void)x, (void)N, (void)B, (void)n0, (void)n1; }
#endif
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  const int N = dims[0], B = dims[1], T = dims[2];
  int n0, n1; rows_part(N, R, T, core_id, &n0, &n1);
  if (B == 1) {  /* one row of x (row.h) */
    row_products(out, w, x, n0, n1);
    return;
  }
  if (GEMM && dims[3]) {  /* x in panels (F16's kernels get a fourth dim: whether) */
    rows_part(N, GR, T, core_id, &n0, &n1);
    if (n0 < n1) gemm(out, w, x, N, B, n0, n1);
    return;
  }
#ifdef ROWS_F16
  const int decoded = F16_DECODE_FROM && B >= F16_DECODE_FROM;
#else
  const int decoded = 1;
#endif
  f16v wbuf[R][V];  /* the rows' chunk, decoded */
  float sums[XB][R][16] __attribute__((aligned(64)));  /* each (row of x, weight row)'s lanes */
  const int blocks = B > XB ? (B + XB - 1) / XB : 1, bs = ((B + blocks - 1) / blocks + XT - 1) / XT * XT;  /* <= XB */
  for (int b0 = 0; b0 < B; b0 += bs) {  /* a block of x that stays in L2 while the part's weight rows pass it */
    const int b1 = b0 + bs < B ? b0 + bs : B, nb = b1 - b0;
#ifdef SPLIT_X
    float xs[XB * K] __attribute__((aligned(64)));
    split_rows(xs, x + (long)b0 * K, nb);
#endif
    for (int n = n0; n < n1; n += R) {
      const int r_n = n1 - n < R ? n1 - n : R;
      wsrc wr[R];
      for (int r = 0; r < R; r++)  /* rows past the part's last (r_n < R) read its first again: their sums unused */
        wr[r] = decoded ? (wsrc)wbuf[r] : w + (long)(n + (r < r_n ? r : 0)) * NB * BB;
      for (int v0 = 0; v0 < V; v0 += VC) {  /* a chunk of the rows against every row of x of the block */
        const int v1 = v0 + VC < V ? v0 + VC : V;
        if (decoded) decode_blocks(wbuf, w, n, r_n, v0 / QV, v1 / QV);  /* just before its use: L1-hot */
#ifdef SPLIT_X
        const float* xc = xs + 16L * v0 * nb; const long xr = 16L * (v1 - v0);  /* the chunk's rows of x */
#else
        const float* xc = x + (long)b0 * K + 16 * v0; const long xr = K;
#endif
        if (decoded) chunk_pass(sums, wr, xc, xr, v0, v1, nb, b0 == 0, 1);
        else chunk_pass(sums, wr, xc, xr, v0, v1, nb, b0 == 0, 0);
      }
      for (int i = 0; i < nb; i++)
        for (int r = 0; r < r_n; r++) out[(long)(b0 + i) * N + n + r] = hsum(f_at(sums[i][r]));
    }
  }
}
