/* The integer path's shared half (PP_EXACT unset): x quantized to int8 per block as ggml's CPU backend does, and the
   integer dot products of 32 values (VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, or generic C any CPU compiles).

   A block of x matches the weight type's block (QK = BLOCK_VALUES): 256 values as ggml's Q8_K (the K-quants, IQ4_XS),
   32 as ggml's Q8_0 (Q4_0, Q5_0, Q8_0, ...). Its bytes here: int8 qs[QK], int16 bsums[QK / 16] (the sums of each 16
   qs: what a weight's per-sub-block offsets multiply), float d, XB bytes in all (a 256-value block padded to 320, so
   that every 32 qs lie in one cache line). The ints are ggml's, exactly:
   - Q8_K (quantize_row_q8_K_ref): max the value of largest |x| (the first), iscale = -127 / max, q = nearest_int(
     iscale x) (ties to even) capped at 127, d = 1 / iscale; an all-zero block has d 0 and q 0.
   - Q8_0 (quantize_row_q8_0_ref): d = max|x| / 127, q = roundf(x / d) (ties away from zero, x times 1 / d), and d
     kept as ggml keeps it, rounded to fp16.
   testing/ggml_int8.py is the numpy model of the same. */
#define X_SUMS BLOCK_VALUES  /* the offsets of bsums and d in a block of x */
#define X_D (BLOCK_VALUES + BLOCK_VALUES / 8)
#define XB (BLOCK_VALUES == 256 ? 320 : X_D + 4)
typedef int i32x8 __attribute__((ext_vector_type(8)));
typedef short i16x32 __attribute__((ext_vector_type(32)));
typedef short i16x8 __attribute__((ext_vector_type(8)));
typedef short i16x16 __attribute__((ext_vector_type(16)));

static inline int nearest_int(float v) {  /* ggml's: the float's bits after adding 1.5 2^23 (ties to even) */
  float f = v + 12582912.f; int i; __builtin_memcpy(&i, &f, 4); return (i & 0x007fffff) - 0x00400000; }
static inline int round_away(float v) {  /* roundf without libm (freestanding): |v| < 2^23, so v - trunc v exact */
  int t = (int)v; float f = v - (float)t; return t + (f >= 0.5f) - (f <= -0.5f); }

static inline float fp16_round(float f) {  /* f >= 0 rounded to fp16 and back (ties to even), without F16C's
  instruction or the runtime's __gnu_f2h_ieee (tinygrad links no library) */
  if (f < 0x1p-14f) return (float)nearest_int(f * 0x1p24f) * 0x1p-24f;  /* subnormal halves: steps of 2^-24 */
  if (f >= 65520.f) return __builtin_inff();
  unsigned int u; __builtin_memcpy(&u, &f, 4);
  u = (u + 0xFFFu + ((u >> 13) & 1)) & ~0x1FFFu;
  __builtin_memcpy(&f, &u, 4); return f; }

static inline int hsum_i8(i32x8 v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3); v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0,
  1); return v[0] + v[1]; }
/* one block of x (always inlined: quantize.c's kernel must be the first function of its unit) */
static inline __attribute__((always_inline)) void quantize_block(const float* restrict v,
                                                                 unsigned char* restrict out) {
  enum { QK = BLOCK_VALUES };
  signed char* q = (signed char*)out; float d;  /* written in place: a copy of 256 bytes is a memcpy call */
#if BLOCK_VALUES == 256
  f16v top = 0;  /* the largest |x| in 16 lanes (NaN ignored, as ggml's a > amax ignores it), then its first x */
  for (int c = 0; c < QK / 16; c++) top = __builtin_elementwise_max(top, __builtin_elementwise_abs(f_at(v + 16 * c)));
  float amax = __builtin_reduce_max(top);
  int at = 0;
  while (amax != 0 && __builtin_fabsf(v[at]) != amax) at++;
  float iscale = amax != 0 ? -127.f / v[at] : 0;  /* an all-zero block: d 0 and q 0 */
  short sums[QK / 16];
  for (int c = 0; c < QK / 16; c++) {  /* nearest_int 16 at a time (the same bits as one at a time), and their sum */
    i32x16 n = __builtin_elementwise_min(((i32x16)(f_at(v + 16 * c) * iscale + 12582912.f) & 0x007fffff) - 0x00400000,
                                         (i32x16)127);
    i8x16 b = __builtin_convertvector(n, i8x16);
    __builtin_memcpy(q + 16 * c, &b, 16);
    i32x8 h = __builtin_shufflevector(n, n, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(n, n, 8, 9, 10, 11, 12,
                                                                                        13, 14, 15);
    sums[c] = (short)hsum_i8(h);
  }
  __builtin_memcpy(out + X_SUMS, sums, sizeof sums);
  d = amax != 0 ? 1 / iscale : 0;
#else
  float amax = 0;
  for (int i = 0; i < QK; i++) { float a = __builtin_fabsf(v[i]); amax = a > amax ? a : amax; }
  float dd = amax / 127, id = dd != 0 ? 1 / dd : 0;
  for (int i = 0; i < QK; i++) q[i] = (signed char)round_away(v[i] * id);
  d = fp16_round(dd);
  for (int j = 0; j < QK / 16; j++) {
    short s = 0;
    for (int i = 0; i < 16; i++) s += q[16 * j + i];
    __builtin_memcpy(out + X_SUMS + 2 * j, &s, 2);
  }
#endif
  __builtin_memcpy(out + X_D, &d, 4);
}

static inline i8x32 abs_i8(i8x32 w) { return __builtin_elementwise_abs(w); }  /* vpabsb (-128 stays, 128 unsigned) */
static inline i8x32 sign_i8(i8x32 x, i8x32 w) {  /* x with w's sign, 0 where w is */
#if defined(__AVX2__)  /* vpsignb: clang writes the select below as five instructions */
  typedef char v32qi_t __attribute__((vector_size(32)));
  return (i8x32)__builtin_ia32_psignb256((v32qi_t)x, (v32qi_t)w);
#else
  return w < 0 ? -x : (w == 0 ? (i8x32)0 : x);
#endif
}
/* 32 products summed in 8 lanes, lane l holding values 4l..4l+3: u unsigned (at most 127 where AVX2 adds pairs in
   16 bits), w signed; x in [-127, 127] */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
static inline i32x8 dot32u(u8x32 u, i8x32 x) {
  return (i32x8)__builtin_ia32_vpdpbusd256((i32x8)0, (i32x8)u, (i32x8)x); }
static inline i32x8 dot32s(i8x32 w, i8x32 x) {  /* |w| times x with w's sign (ggml's): vpdpbusd's first operand
  is unsigned (|-128| read as 128) */
  return (i32x8)__builtin_ia32_vpdpbusd256((i32x8)0, (i32x8)abs_i8(w), (i32x8)sign_i8(x, w)); }
#define INT_DOT "vnni"
#elif defined(__AVX2__)
static inline i32x8 madd_pairs(i16x16 p) {  /* adjacent 16-bit sums added into 32 bits (vpmaddwd with ones) */
  return (i32x8)__builtin_ia32_pmaddwd256((i16x16)p, (i16x16)(short)1); }
static inline i32x8 dot32u(u8x32 u, i8x32 x) {  /* vpmaddubsw: u x in pairs, 16-bit (127 127 2 fits) */
  return madd_pairs(__builtin_ia32_pmaddubsw256((i8x32)u, x)); }
static inline i32x8 dot32s(i8x32 w, i8x32 x) {  /* |w| times x with w's sign (ggml's trick): |w| <= 128 fits */
  return madd_pairs(__builtin_ia32_pmaddubsw256(abs_i8(w), sign_i8(x, w))); }
#define INT_DOT "avx2"
#else
static inline i32x8 dot32_generic(i16x32 p) {  /* 32 16-bit products summed in 8 lanes of 4 */
  i16x8 a = __builtin_shufflevector(p, p, 0, 4, 8, 12, 16, 20, 24, 28), b = __builtin_shufflevector(p, p, 1, 5, 9, 13,
            17, 21, 25, 29), c = __builtin_shufflevector(p, p, 2, 6, 10, 14, 18, 22, 26, 30), e =
            __builtin_shufflevector(p, p, 3, 7, 11, 15, 19, 23, 27, 31);
  return __builtin_convertvector(a, i32x8) + __builtin_convertvector(b, i32x8) + __builtin_convertvector(c, i32x8)
       + __builtin_convertvector(e, i32x8); }
static inline i32x8 dot32u(u8x32 u, i8x32 x) {  /* 255 x 127 fits 16 bits */
  return dot32_generic(__builtin_convertvector(u, i16x32) * __builtin_convertvector(x, i16x32)); }
static inline i32x8 dot32s(i8x32 w, i8x32 x) {
  return dot32_generic(__builtin_convertvector(w, i16x32) * __builtin_convertvector(x, i16x32)); }
#define INT_DOT "generic"
#endif
/* For the 256-value blocks, whose scales are per 16 values: the products summed in pairs, 16 lanes of 16 bits (lane
   l: values 2l, 2l + 1; u at most 63, |w| at most 127, so a pair's sum fits 16 bits and vpmaddubsw never saturates),
   which a vector of 16-bit scales then multiplies and sums in pairs into 32 bits (madd16): ggml's AVX2 K-quant dot */
#if defined(__AVX2__)
static inline i32x8 madd16(i16x16 a, i16x16 b) {  /* vpmaddwd: a b in adjacent pairs, summed into 32 bits */
  return (i32x8)__builtin_ia32_pmaddwd256(a, b); }
static inline i16x16 pairs_u(u8x32 u, i8x32 x) {  /* vpmaddubsw: u x in adjacent pairs, 16-bit */
  return (i16x16)__builtin_ia32_pmaddubsw256((i8x32)u, x); }
#else
static inline i32x8 madd16(i16x16 a, i16x16 b) {
  i32x16 p = __builtin_convertvector(a, i32x16) * __builtin_convertvector(b, i32x16);
  return __builtin_shufflevector(p, p, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(p, p, 1, 3, 5, 7, 9, 11,
                                                                                              13, 15); }
static inline i16x16 pairs_u(u8x32 u, i8x32 x) {  /* each product fits 16 bits; a pair's sum does for u <= 128 */
  i16x32 p = __builtin_convertvector(u, i16x32) * __builtin_convertvector(x, i16x32);
  return __builtin_shufflevector(p, p, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
       + __builtin_shufflevector(p, p, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31); }
#endif
/* acc + madd16(a, b): one vpdpwssd where the CPU has it (the same int32 sums, one instruction fewer) */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
static inline i32x8 madd16_acc(i32x8 acc, i16x16 a, i16x16 b) {
  return (i32x8)__builtin_ia32_vpdpwssd256((i32x8)acc, (i32x8)a, (i32x8)b); }
#else
static inline i32x8 madd16_acc(i32x8 acc, i16x16 a, i16x16 b) { return acc + madd16(a, b); }
#endif
static inline i16x16 pairs_s(i8x32 w, i8x32 x) { return pairs_u((u8x32)abs_i8(w), sign_i8(x, w)); }  /* |w| <= 127 */
/* shuffle indices: i 8 times; i to i + 15 */
#define S8(i) i, i, i, i, i, i, i, i
#define S16(i) i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7, i + 8, i + 9, i + 10, i + 11, i + 12, i + 13, i + 14, \
  i + 15
/* 64 bytes: two groups or two 32-value blocks a step (512-bit vectors with AVX-512, a pair of 256-bit ones else) */
typedef unsigned char u8x64 __attribute__((ext_vector_type(64)));
typedef signed char i8x64 __attribute__((ext_vector_type(64)));
typedef unsigned short u16x32 __attribute__((ext_vector_type(32)));
#define CAT64(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, \
  20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, \
  49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
#define LO32(v) __builtin_shufflevector(v, v, S16(0), S16(16))
#define HI32(v) __builtin_shufflevector(v, v, S16(32), S16(48))
#define CAT16(a, b) __builtin_shufflevector(a, b, S16(0))
#define LO8(v) __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
#define HI8(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
/* ggml's sign trick on 64 bytes: |w|, and x with w's sign (a mask where 512 bits have no vpsignb; x where w is 0
   goes with |w| = 0) */
static inline u8x64 abs64(i8x64 w) { return (u8x64)__builtin_elementwise_abs(w); }
static inline i8x64 sign64(i8x64 x, i8x64 w) { return w < 0 ? -x : x; }
#if defined(__AVX512BW__)
typedef char v64qi_t __attribute__((vector_size(64)));
static inline i16x32 pairs64_u(u8x64 u, i8x64 x) { return (i16x32)__builtin_ia32_pmaddubsw512((v64qi_t)u, (v64qi_t)x); }
static inline i16x32 pairs64_s(i8x64 w, i8x64 x) { return pairs64_u(abs64(w), sign64(x, w)); }  /* |w| <= 127 */
static inline i32x16 madd32_acc(i32x16 acc, i16x32 a, i16x32 b) {
#if defined(__AVX512VNNI__)
  return (i32x16)__builtin_ia32_vpdpwssd512((i32x16)acc, (i32x16)a, (i32x16)b);
#else
  return acc + (i32x16)__builtin_ia32_pmaddwd512(a, b);
#endif
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)  /* dot32's 32-value sums, two at once: lanes 0-7 and 8-15 */
static inline i32x16 dot64u(u8x64 u, i8x64 x) { return (i32x16)__builtin_ia32_vpdpbusd512((i32x16)0, (i32x16)u, (i32x16)x); }
static inline i32x16 dot64s(i8x64 w, i8x64 x) { return dot64u(abs64(w), sign64(x, w)); }
#else
static inline i32x16 dot64u(u8x64 u, i8x64 x) { return CAT16(dot32u(LO32(u), LO32(x)), dot32u(HI32(u), HI32(x))); }
static inline i32x16 dot64s(i8x64 w, i8x64 x) { return CAT16(dot32s(LO32(w), LO32(x)), dot32s(HI32(w), HI32(x))); }
#endif
static inline i8x64 i8x64_at(const unsigned char* p) { i8x64 v; __builtin_memcpy(&v, p, 64); return v; }
static inline float hsum_f8(f8v v) {
  f4v b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1); return b[0] + b[1]; }
static inline i8x32 i8x32_at(const unsigned char* p) { i8x32 v; __builtin_memcpy(&v, p, 32); return v; }
static inline u8x32 u8x32_at(const unsigned char* p) { u8x32 v; __builtin_memcpy(&v, p, 32); return v; }
