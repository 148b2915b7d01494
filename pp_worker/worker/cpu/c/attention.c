/* out (T * H * D) = the attention of T consecutive tokens at positions start_pos .. start_pos + T - 1: query t
   (q (T * H * D)) over the keys and values [0, start_pos + t] of one session, read through its page table: logical
   page i of the session (positions [i * PAGE, (i + 1) * PAGE)) is page table[dims[1] * MAX_PAGES + i] of the pool,
   laid out (pages, ROWS, 2, KVH, PAGE, D) in CT (float, or __fp16 with IS_HALF); this block is row dims[0].
   Query head h reads key head h / (H / KVH). Each key and value, read once as 16-wide vectors, serves every query
   head of its group, with an online softmax (running max and sum, rescaled per chunk of C keys, a chunk never
   crossing a page) so no buffer grows with the position; the (key head, token) pairs split over the threads. The
   scores, their max, exp and sum go 16 keys wide (a reduction clang would leave scalar: it does not reassociate).
   WINDOW > 0: a sliding window, query t reads only the last WINDOW of its positions.
   MIX: rows of any sessions instead (`CompiledStage`'s mixed calls): token t is at position pos[t] of the session
   whose pages row t of the table holds, so one call serves the rows of several sessions, several rows each. */

/* exp(x) for x <= 0 (scores minus their running max), 16 at a time: 2^n * p(r), ggml's and Cephes' range reduction and
   polynomial (relative error ~1e-7), in plain arithmetic; one score alone takes lane 0 of the same, so a score's
   exp is the same float in a run of 16 or at a chunk's end */
static inline f16v pexp16(f16v x) {
  i32x16 low = x < -87.0f;
  x = (f16v)(((i32x16)x & ~low) | ((i32x16)(f16v)-87.0f & low));
  f16v n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
  f16v r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f16v p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
            + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * (f16v)((__builtin_convertvector(n, i32x16) + 127) << 23);
}
static inline float pexp(float x) { return pexp16((f16v)x)[0]; }
static inline f16v max16(f16v a, f16v b) { i32x16 m = a > b; return (f16v)(((i32x16)a & m) | ((i32x16)b & ~m)); }
static inline float hmax(f16v v) {
  f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12,
                                                                                               13, 14, 15);
  float m = a[0];
  for (int i = 0; i < 8; i++) { m = a[i] > m ? a[i] : m; m = b[i] > m ? b[i] : m; }
  return m;
}
/* lane u = hsum(p[u]), each added in hsum's order (so the same float): 16 keys' scores summed across their lanes in
   15 vector adds (and their shuffles) where 16 hsums take 64 */
static inline f16v hsum16(const f16v p[16]) {
  f16v q[8], r[4], s[2];
  for (int i = 0; i < 8; i++)  /* [8 lanes of p[2i] | of p[2i + 1]]: lane j + lane j + 8 */
    q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++)  /* 4 lanes each of p[4i] .. p[4i + 3] */
    r[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + __builtin_shufflevector(q[2 * i], q[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)  /* 2 lanes each of p[8i] .. p[8i + 7] */
    s[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
         + __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(s[0], s[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
       + __builtin_shufflevector(s[0], s[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
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
    f16v p[G][16];  /* the last keys' products, not summed yet */
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
      for (int t = 0; t < n; t++) {  /* scores: each key once for the G query heads, summed 16 keys at a time */
        f16v d[G];
        for (int g = 0; g < G; g++) d[g] = 0;
        for (int v = 0; v < V; v++) {
          f16v k = load16(keys + (long)t * D + 16 * v);
          for (int g = 0; g < G; g++) d[g] += qv[g][v] * k;
        }
        const int u = t % 16;
        for (int g = 0; g < G; g++) p[g][u] = d[g];
        if (u == 15)
          for (int g = 0; g < G; g++) { f16v sc = hsum16(p[g]) / scale; __builtin_memcpy(&s[g][t - 15], &sc, 64); }
        else if (t == n - 1)
          for (int g = 0; g < G; g++)
            for (int i = 0; i <= u; i++) s[g][t - u + i] = hsum(p[g][i]) / scale;
      }
      for (int g = 0; g < G; g++) {  /* the running max; what was summed before it rose is rescaled */
        int t = 0;  /* 16 scores a step, the chunk's last few one by one (scalar loops: no reduction vectorizes
                       without reassociating, so the max and the sum go 16 lanes wide here by hand) */
        f16v mv = m[g];
        for (; t + 16 <= n; t += 16) mv = max16(mv, f_at(&s[g][t]));
        float mx = hmax(mv);
        for (; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        float f = pexp(m[g] - mx);
        l[g] *= f;
        for (int v = 0; v < V; v++) acc[g][v] *= f;
        m[g] = mx;
        f16v sum = 0;
        for (t = 0; t + 16 <= n; t += 16) {
          f16v e = pexp16(f_at(&s[g][t]) - mx);
          __builtin_memcpy(&s[g][t], &e, 64);
          sum += e;
        }
        l[g] += hsum(sum);
        for (; t < n; t++) { s[g][t] = pexp(s[g][t] - mx); l[g] += s[g][t]; }
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
