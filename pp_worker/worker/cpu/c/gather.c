/* out (B, K) float32 = rows idx[b] of W decoded; dims = {N, B}: an embedding lookup that reads only the rows it
   gathers */
#ifndef DECODE32
#define DECODE32 decode32_generic
#endif
void NAME(float* restrict out, const unsigned char* restrict w, const int* restrict idx, const int* restrict dims,
          int core_id) {
  enum { K = PP_K, QK = BLOCK_VALUES, BB = BLOCK_BYTES, NB = K / QK };
  const int N = dims[0], B = dims[1];
  f16v v[2];
  for (int t = 0; t < B; t++) {
    int r = idx[t] < 0 || idx[t] >= N ? 0 : idx[t];  /* ids are checked by the protocol layer; never read outside W */
    for (int j = 0; j < NB; j++)
      _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++) {
        DECODE32(w + (long)r * NB * BB + j * BB, g, v);
        __builtin_memcpy(out + (long)t * K + j * QK + 32 * g, &v[0], 64);
        __builtin_memcpy(out + (long)t * K + j * QK + 32 * g + 16, &v[1], 64);
      }
  }
}
