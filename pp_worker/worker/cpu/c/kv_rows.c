/* A mixed call's rows (`CompiledStage`: the rows of several sessions, several rows each, in one forward), each at a
   position of its own: row t at pos[t] of the session whose pages row t of the table (T, MAX_PAGES) holds.
   STORE: keys k and values v (KVH, T, D) float32 into block dims[0]'s row of the pool (pages, ROWS, 2, KVH, PAGE, D)
   in CT, row t at offset pos[t] % PAGE of page table[t][pos[t] / PAGE] (the conversion to __fp16 rounds to nearest
   even, as tinygrad's cast does). Else (ROPE): out (T, W) float32 = row pos[t] of a RoPE table (R, W), R = dims[0]. */
#if STORE
void NAME(CT* restrict pool, const float* restrict k, const float* restrict v, const int* restrict pos,
          const int* restrict table, const int* restrict dims, int core_id) {
  enum { KVH = PP_KV_HEADS, D = PP_HEAD_DIM, T = PP_TOKENS, ROWS = PP_ROWS, PAGE = PP_PAGE, MAX_PAGES = PP_MAX_PAGES };
  for (int t = 0; t < T; t++) {
    const long page = table[(long)t * MAX_PAGES + pos[t] / PAGE], off = pos[t] % PAGE;
    for (int kh = 0; kh < KVH; kh++) {
      CT* keys = pool + (((page * ROWS + dims[0]) * 2 * KVH + kh) * PAGE + off) * D;
      CT* vals = keys + (long)KVH * PAGE * D;
      for (int d = 0; d < D; d++) {
        keys[d] = (CT)k[((long)kh * T + t) * D + d];
        vals[d] = (CT)v[((long)kh * T + t) * D + d];
      }
    }
  }
}
#else
void NAME(float* restrict out, const float* restrict rope, const int* restrict pos, const int* restrict dims,
          int core_id) {
  enum { W = PP_W, T = PP_TOKENS };
  for (int t = 0; t < T; t++) {
    const int r = pos[t] < 0 || pos[t] >= dims[0] ? 0 : pos[t];  /* positions are checked by the session table */
    __builtin_memcpy(out + (long)t * W, rope + (long)r * W, W * sizeof(float));
  }
}
#endif
