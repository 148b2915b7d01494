/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins (ggml's get_scale_min_k4), all 16 at once as one vector
   {d * scales, dmin * mins} (the same products as one at a time), from the block's first 16 bytes read once: the
   6-bit fields put together by byte shuffles and masks, d and dmin converted together */
static inline u8x16 k4_fields(u8x16 v) {  /* the 8 scales, then the 8 mins, as bytes */
  u8x16 a = __builtin_shufflevector(v, v, 4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  u8x16 t = __builtin_shufflevector(v, v, 0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11);
  const u8x16 lo = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0};
  const u8x16 hi = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15};
  const u8x16 top = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
  /* the shifts in 16-bit lanes (x86 has no byte shift): the bits a lane's neighbour shifts in are masked off */
  return (a & lo) | ((u8x16)((u16x8)a >> 4) & hi) | ((u8x16)((u16x8)t >> 2) & top); }
static inline f16v scale_min(const unsigned char* b) {
  u8x16 v = u8_at(b), q = k4_fields(v);
  f8v d = __builtin_convertvector(__builtin_bit_cast(h16x8, v), f8v);  /* d, dmin (then scale bytes as halves) */
  return __builtin_convertvector(q, f16v) * __builtin_shufflevector(d, d, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                                                    1, 1); }
#ifdef PP_INT  /* the integer path's (q8.h) scales in its groups' order, and the offset of each 16 values: sub-block
   g's scale is both halves' of group g, its min both its 16s' (each byte put beside a zero byte by one shuffle) */
static inline void k4_iscales(const unsigned char* b, i16x16* sl, i16x16* m, float* D, float* M) {
  u8x16 v = u8_at(b), q = k4_fields(v), z = 0;
  *sl = (i16x16)__builtin_shufflevector(q, z, 0, 16, 1, 16, 2, 16, 3, 16, 4, 16, 5, 16, 6, 16, 7, 16, 0, 16, 1, 16, 2,
                                        16, 3, 16, 4, 16, 5, 16, 6, 16, 7, 16);
  *m = (i16x16)__builtin_shufflevector(q, z, 8, 16, 8, 16, 9, 16, 9, 16, 10, 16, 10, 16, 11, 16, 11, 16, 12, 16, 12,
                                       16, 13, 16, 13, 16, 14, 16, 14, 16, 15, 16, 15, 16);
  f8v d = __builtin_convertvector(__builtin_bit_cast(h16x8, v), f8v);  /* d and dmin converted together */
  *D = d[0]; *M = d[1]; }
#endif
