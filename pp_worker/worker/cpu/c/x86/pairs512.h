/* The integer path's one-row step for the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) with AVX-512 (BW,
   VL) and VNNI, one block in 256 bits without a shuffle: its 16 bytes of nibbles read into both 128-bit lanes at once
   (vbroadcasti128), the second lane shifted down a nibble (vpsrlvw) and both masked, so a block's low nibbles then
   its high ones (iq32's order) as unsigned bytes; its d read into 8 lanes (vpbroadcastw) and converted. The including
   type file defines IQ_U (what its unsigned bytes hold above the values: 8, 16 or 0) and iq32u (a block's 32
   unsigned bytes), or IQ_DOT32 (a block's products with x: IQ4_NL's); matmul_int.c's row_dot_q8 takes it from there
   (bench/NOTES.md). */
#if defined(PP_INT) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
static inline u8x32 block_nibbles(const unsigned char* q) {  /* the 16 bytes at q: low nibbles, then high */
  u8x16 v = u8_at(q);
  const u16x16 at = {S8(0), S8(4)};
  return (u8x32)((u16x16)__builtin_shufflevector(v, v, S16(0), S16(0)) >> at) & 15; }
/* Q5_0's and Q5_1's fifth bits (value i's: bit i of the 32 bits at qh) joined at bit 4, under a mask */
static inline u8x32 block_fifth(u8x32 u, const unsigned char* qh) {
  typedef char v32qi_t __attribute__((vector_size(32)));
  unsigned int h; __builtin_memcpy(&h, qh, 4);
  return (u8x32)__builtin_ia32_selectb_256(h, (v32qi_t)(u | 16), (v32qi_t)u); }
static inline f8v block_d(const unsigned char* b) {  /* the block's d (its first 2 bytes) in 8 lanes */
  unsigned short h; __builtin_memcpy(&h, b, 2);
  typedef __fp16 h16x8_t __attribute__((ext_vector_type(8)));
  return __builtin_convertvector(__builtin_bit_cast(h16x8_t, (u16x8)h), f8v); }
#endif
