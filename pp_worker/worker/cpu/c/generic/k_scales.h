/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins (ggml's get_scale_min_k4), all 16 at once as one vector
   {d * scales, dmin * mins} (the same products as one at a time), from the block's first 16 bytes read once: the
   6-bit fields put together by byte shuffles and masks, d and dmin converted together */
static inline u8x16 k4_fields(u8x16 v) {  /* the 8 scales, then the 8 mins, as bytes */
  u8x16 a = __builtin_shufflevector(v, v, 4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  u8x16 t = __builtin_shufflevector(v, v, 0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11);
  const u8x16 lo = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0};
  const u8x16 hi = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15};
  const u8x16 top = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
  return (a & lo) | ((a >> 4) & hi) | ((t >> 2) & top); }
static inline f16v scale_min(const unsigned char* b) {
  u8x16 v = u8_at(b), q = k4_fields(v);
  f8v d = __builtin_convertvector(__builtin_bit_cast(h16x8, v), f8v);  /* d, dmin (then scale bytes as halves) */
  return __builtin_convertvector(q, f16v) * __builtin_shufflevector(d, d, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                                                    1, 1); }
#ifdef PP_INT  /* the integer path's (q8.h) scale and offset of each 16 values: sub-block j / 2's scale and min */
static inline void k4_iscales(const unsigned char* b, i16x16* s, i16x16* m, float* D, float* M) {
  u8x16 q = k4_fields(u8_at(b));
  *s = __builtin_convertvector(__builtin_shufflevector(q, q, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), i16x16);
  *m = __builtin_convertvector(__builtin_shufflevector(q, q, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15,
                                                       15), i16x16);
  *D = half_at(b); *M = half_at(b + 2); }
#endif
