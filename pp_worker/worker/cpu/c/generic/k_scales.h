/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins (ggml's get_scale_min_k4), all 16 at once as one vector
   {d * scales, dmin * mins} (the same products as one at a time), from the block's first 16 bytes read once: the
   6-bit fields put together by byte shuffles and masks, d and dmin converted together */
static inline f16v scale_min(const unsigned char* b) {
  u8x16 v = u8_at(b);
  u8x16 a = __builtin_shufflevector(v, v, 4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  u8x16 t = __builtin_shufflevector(v, v, 0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11);
  const u8x16 lo = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0};
  const u8x16 hi = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15};
  const u8x16 top = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
  u8x16 q = (a & lo) | ((a >> 4) & hi) | ((t >> 2) & top);
  f8v d = __builtin_convertvector(__builtin_bit_cast(h16x8, v), f8v);  /* d, dmin (then scale bytes as halves) */
  return __builtin_convertvector(q, f16v) * __builtin_shufflevector(d, d, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                                                    1, 1); }
