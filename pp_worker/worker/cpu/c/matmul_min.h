/* The integer path's product for the 32-value types with a min per block (IQ_MIN: Q4_1, Q5_1; weight value
   = D u - M, D = d and M = -m). A block's product with x's block is dx D (u . q) - M dx sum q: the second term's x
   side, dx sum q, is the same for every weight row, so it is computed once a call for each row of x (x_sums) instead
   of once per weight row and block (two 16-bit loads, an add, a conversion and a multiply: 9 of a block's 22
   instructions with AVX-512, bench/NOTES.md); a block's M then costs one conversion and one FMA. Rows of x pass BT at
   a time as matmul_int.c's, each weight block unpacked once for all of them; x's sums of a pass's BT rows lie side
   by side for each block, so the offsets of all its rows take one vector FMA a block. Every row of x, alone or in a
   pass, gets the same float steps: the even blocks' sums in one vector, the odd ones' in another, its offsets in
   block order (lane i of the pass's vector is row i's chain), so a row's result does not depend on its pass. */
#if defined(IQ_U)  /* AVX-512 VNNI: pairs512.h's step (a block's bytes unpacked without a shuffle, its d in 8 lanes) */
#define MIN_W(b) iq32u(b)
#define MIN_D(b) block_d(b)
#else
#define MIN_W(b) iq32(b, 0)
#define MIN_D(b) ((f8v)half_at(b))
#endif
#define MIN_DOT(b, x) dot32u(MIN_W(b), x)  /* unsigned values (IQ_SIGNED 0) */
enum { MIN_NB = PP_K / BLOCK_VALUES };
/* rows [0, rows) of x's blocks: sx[(p NB + j) BT + i] = dx sum q of row p BT + i's block j (the offsets' x side) */
static inline void x_sums(float* restrict sx, const unsigned char* restrict xq, int rows) {
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < MIN_NB; j++) {
      const unsigned char* xb = xq + ((long)r * MIN_NB + j) * XB;
      float dx; short bs[2];
      __builtin_memcpy(&dx, xb + X_D, 4); __builtin_memcpy(bs, xb + X_SUMS, 4);
      sx[((long)(r / BT) * MIN_NB + j) * BT + r % BT] = dx * (float)(bs[0] + bs[1]);
    }
}
static inline float block_m(const unsigned char* b) { float D, M; iscales(b, &D, &M); return M; }
/* one weight row against nbt (1 to BT) rows of x (their blocks at xq, NB XB bytes a row; sx their x_sums) */
static inline void rows_dot_min(float* restrict out, long stride, const unsigned char* restrict row,
                                const unsigned char* restrict xq, const float* restrict sx, int nbt) {
  enum { NB = MIN_NB };
  f8v acc[2][BT]; f8v off = 0;  /* off: lane i row i's offsets (sum of M dx sum q) */
  _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) acc[0][i] = acc[1][i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = row + j * BLOCK_BYTES;
    if (!(j & 1)) AHEAD_N(b, 2 * BLOCK_BYTES);
    f8v d = MIN_D(b);
    __auto_type w = MIN_W(b);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) if (i < nbt) {
      const unsigned char* xb = xq + ((long)i * NB + j) * XB; float dx; __builtin_memcpy(&dx, xb + X_D, 4);
      acc[j & 1][i] += __builtin_convertvector(dot32u(w, i8x32_at(xb)), f8v) * ((f8v)dx * d);
    }
    f8v s; __builtin_memcpy(&s, sx + j * BT, 32);
    off += (f8v)block_m(b) * s;
  }
  for (int i = 0; i < nbt; i++) out[i * stride] = hsum_f8(acc[0][i] + acc[1][i]) - off[i];
}
/* the same for one row of x (its sums at sx, BT apart): two blocks a step, the products' two chains as above */
static inline float row_dot_min(const unsigned char* restrict row, const unsigned char* restrict xq,
                                const float* restrict sx) {
  enum { NB = MIN_NB };
  f8v even = 0, odd = 0; float off = 0;
  int j = 0;
  for (; j + 2 <= NB; j += 2) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    AHEAD_N(b, 2 * BLOCK_BYTES);
    float dx0, dx1; __builtin_memcpy(&dx0, xb + X_D, 4); __builtin_memcpy(&dx1, xb + XB + X_D, 4);
    even += __builtin_convertvector(MIN_DOT(b, i8x32_at(xb)), f8v) * ((f8v)dx0 * MIN_D(b));
    odd += __builtin_convertvector(MIN_DOT(b + BLOCK_BYTES, i8x32_at(xb + XB)), f8v)
         * ((f8v)dx1 * MIN_D(b + BLOCK_BYTES));
    off += block_m(b) * sx[j * BT];
    off += block_m(b + BLOCK_BYTES) * sx[(j + 1) * BT];
  }
  if (j < NB) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    float dx; __builtin_memcpy(&dx, xb + X_D, 4);
    even += __builtin_convertvector(MIN_DOT(b, i8x32_at(xb)), f8v) * ((f8v)dx * MIN_D(b));
    off += block_m(b) * sx[j * BT];
  }
  return hsum_f8(even + odd) - off;
}
void NAME(float* restrict out, const unsigned char* restrict w, const unsigned char* restrict xq,
          const int* restrict dims, int core_id) {
  enum { K = PP_K, R = PP_ROWS, NB = MIN_NB };
  const int N = dims[0], B = dims[1], T = dims[2];
  int n0, n1; rows_part(N, R, T, core_id, &n0, &n1);
  float sx[XBLOCK * NB];  /* a block of x's x_sums: at most a tenth of its bytes (XB 40 a block of 32 values) */
  for (int c0 = 0; c0 < B; c0 += XBLOCK) {
    int c1 = c0 + XBLOCK < B ? c0 + XBLOCK : B;
    const unsigned char* xc = xq + (long)c0 * NB * XB;
    x_sums(sx, xc, c1 - c0);
    for (int n = n0; n < n1; n++) {
      const unsigned char* row = w + (long)n * NB * BLOCK_BYTES;
      for (int b0 = c0; b0 < c1; b0 += BT) {
        int nbt = c1 - b0 < BT ? c1 - b0 : BT;
        const unsigned char* xb = xq + (long)b0 * NB * XB; const float* s = sx + (long)(b0 - c0) * NB;
        if (nbt == 1) out[(long)b0 * N + n] = row_dot_min(row, xb, s);
        else rows_dot_min(out + (long)b0 * N + n, N, row, xb, s, nbt);
      }
    }
  }
}
