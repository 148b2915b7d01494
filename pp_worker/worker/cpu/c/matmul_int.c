/* out (B, N) = x (B, K) @ W (N, K)^T on the integer path (PP_EXACT unset; q8.h): x quantized to int8 blocks once per
   call in each thread (BT rows at a time, on the stack), then each weight row's integer products with those rows.
   dims = {N, B, threads}; rows of W split over the threads as in matmul.c. The type's generic file gives iq32 (a
   32-value group of a block as unsigned, or signed with IQ_SIGNED, bytes) and iscales (per 16 values an integer
   scale s and offset m, and the block's floats D and M): weight value = D s u - M m. So a block's product with x's
   block is dx (D sum_j s_j (u . q)_j - M sum_j m_j bsums_j), the sums in int32 as ggml's. */
enum { BT = 8 };  /* rows of x quantized per pass: each weight row read once per BT rows (prefill, batched decode) */
static inline float block_dot(const unsigned char* restrict b, const unsigned char* restrict xb) {
  enum { QK = BLOCK_VALUES };
  int s[QK / 16], m[QK / 16]; float D, M, dx;
  iscales(b, s, m, &D, &M);
  __builtin_memcpy(&dx, xb, 4);
  i32x8 acc = 0;
  _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++) {
#if IQ_SIGNED
    i32x8 p = dot32s(iq32(b, g), i8x32_at(xb + 4 + 32 * g));
#else
    i32x8 p = dot32u(iq32(b, g), i8x32_at(xb + 4 + 32 * g));
#endif
    i32x8 sv = {s[2 * g], s[2 * g], s[2 * g], s[2 * g], s[2 * g + 1], s[2 * g + 1], s[2 * g + 1], s[2 * g + 1]};
    acc += p * sv;
  }
  int isum = hsum_i8(acc), imin = 0;
  _Pragma("clang loop unroll(full)") for (int j = 0; j < QK / 16; j++) {
    short bs; __builtin_memcpy(&bs, xb + 4 + QK + 2 * j, 2); imin += m[j] * bs; }
  return dx * (D * (float)isum - M * (float)imin);
}
static inline float row_dot_q8(const unsigned char* restrict row, const unsigned char* restrict xq, int nb) {
  float acc = 0;
  for (int j = 0; j < nb; j++) acc += block_dot(row + j * BLOCK_BYTES, xq + j * XB);
  return acc;
}
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  enum { K = PP_K, R = PP_ROWS, NB = K / BLOCK_VALUES };
  const int N = dims[0], B = dims[1], T = dims[2];
  int per = ((N + R - 1) / R + T - 1) / T * R, n0 = core_id * per, n1 = n0 + per < N ? n0 + per : N;
  unsigned char xq[BT][NB * XB] __attribute__((aligned(64)));
  for (int b0 = 0; b0 < B; b0 += BT) {
    int nbt = B - b0 < BT ? B - b0 : BT;
    for (int i = 0; i < nbt; i++)
      for (int j = 0; j < NB; j++) quantize_block(x + (long)(b0 + i) * K + j * BLOCK_VALUES, xq[i] + j * XB);
    for (int n = n0; n < n1; n++) {
      const unsigned char* row = w + (long)n * NB * BLOCK_BYTES;
      for (int i = 0; i < nbt; i++) out[(long)(b0 + i) * N + n] = row_dot_q8(row, xq[i], NB);
    }
  }
}
