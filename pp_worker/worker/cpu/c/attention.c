/* out (T * H * D) = the attention of T consecutive tokens at positions start_pos .. start_pos + T - 1: query t
   (q (T * H * D)) over the keys and values [0, start_pos + t] of one session, read through its page table: logical
   page i of the session (positions [i * PAGE, (i + 1) * PAGE)) is page table[dims[1] * MAX_PAGES + i] of the pool,
   laid out (pages, ROWS, 2, KVH, PAGE, D) in CT (float, or __fp16 with IS_HALF); this block is row dims[0].
   Query head h reads key head h / (H / KVH). Each key and value, read once as 16-wide vectors, serves every query
   head of its group, with an online softmax (running max and sum, rescaled per chunk of C keys, a chunk never
   crossing a page) so no buffer grows with the position; the (key head, token) pairs split over the threads.
   WINDOW > 0: a sliding window, query t reads only the last WINDOW of its positions.
   MIX: rows of any sessions instead (`CompiledStage`'s mixed calls): token t is at position pos[t] of the session
   whose pages row t of the table holds, so one call serves the rows of several sessions, several rows each. */

/* exp(x) for x <= 0 (scores minus their running max): 2^n * p(r), ggml's and Cephes' range reduction and polynomial
   (relative error ~1e-7), written with plain arithmetic so the loops over a chunk vectorize */
static inline float pexp(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
             + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, ((int)n + 127) << 23);
}
static inline f16v load16(const CT* p) {
#if IS_HALF
  h16x16 v; __builtin_memcpy(&v, p, 32); return __builtin_convertvector(v, f16v);
#else
  return f_at(p);
#endif
}
#if PP_MIX
#define LEN(tok) (pos[tok] + 1)
#define PAGES(tok) (table + (long)(tok) * MAX_PAGES)
void NAME(float* restrict out, const CT* restrict pool, const float* restrict q, const int* restrict table,
          const int* restrict pos, const int* restrict dims, int core_id) {
#else
#define LEN(tok) (start_pos + (tok) + 1)
#define PAGES(tok) (table + (long)dims[1] * MAX_PAGES)
void NAME(float* restrict out, const CT* restrict pool, const float* restrict q, const int* restrict table,
          const int* restrict dims, int core_id, int start_pos) {
#endif
  enum { H = PP_HEADS, KVH = PP_KV_HEADS, D = PP_HEAD_DIM, T = PP_TOKENS, ROWS = PP_ROWS, PAGE = PP_PAGE,
         MAX_PAGES = PP_MAX_PAGES, G = H / KVH, V = D / 16, C = PP_CHUNK, THREADS = PP_THREADS,
         WINDOW = PP_WINDOW };
  _Static_assert(PAGE % C == 0, "a chunk of keys never crosses a page");
  const float scale = PP_SCALE;
  for (int item = core_id; item < KVH * T; item += THREADS) {
    const int kh = item % KVH, tok = item / KVH, len = LEN(tok);
    const int* pages = PAGES(tok);
    f16v qv[G][V], acc[G][V];
    float m[G], l[G], s[G][C];
    for (int g = 0; g < G; g++) {
      for (int v = 0; v < V; v++) { qv[g][v] = f_at(q + ((long)tok * H + kh * G + g) * D + 16 * v); acc[g][v] = 0; }
      m[g] = -__builtin_inff(); l[g] = 0;
    }
    /* a sliding window (WINDOW > 0) starts at the oldest key it holds; the first chunk then ends at the next
       multiple of C, so that no chunk crosses a page */
    const int lo = WINDOW > 0 && len > WINDOW ? len - WINDOW : 0;
    for (int t0 = lo, n; t0 < len; t0 += n) {
      n = C - t0 % C < len - t0 ? C - t0 % C : len - t0;
      const CT* keys = pool + ((((long)pages[t0 / PAGE] * ROWS + dims[0]) * 2 * KVH + kh) * PAGE + t0 % PAGE) * D;
      const CT* vals = keys + (long)KVH * PAGE * D;
      for (int t = 0; t < n; t++) {  /* scores: each key once for the G query heads */
        f16v d[G];
        for (int g = 0; g < G; g++) d[g] = 0;
        for (int v = 0; v < V; v++) {
          f16v k = load16(keys + (long)t * D + 16 * v);
          for (int g = 0; g < G; g++) d[g] += qv[g][v] * k;
        }
        for (int g = 0; g < G; g++) s[g][t] = hsum(d[g]) / scale;
      }
      for (int g = 0; g < G; g++) {  /* the running max; what was summed before it rose is rescaled */
        float mx = m[g];
        for (int t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        float f = pexp(m[g] - mx);
        l[g] *= f;
        for (int v = 0; v < V; v++) acc[g][v] *= f;
        m[g] = mx;
        for (int t = 0; t < n; t++) { s[g][t] = pexp(s[g][t] - mx); l[g] += s[g][t]; }
      }
      for (int t = 0; t < n; t++)  /* weighted values: each value once for the G query heads */
        for (int v = 0; v < V; v++) {
          f16v x = load16(vals + (long)t * D + 16 * v);
          for (int g = 0; g < G; g++) acc[g][v] += s[g][t] * x;
        }
    }
    for (int g = 0; g < G; g++)
      for (int v = 0; v < V; v++) {
        f16v o = acc[g][v] / l[g];
        __builtin_memcpy(out + ((long)tok * H + kh * G + g) * D + 16 * v, &o, 64);
      }
  }
}
