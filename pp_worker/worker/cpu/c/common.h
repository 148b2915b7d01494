/* What every kernel source starts with: vector types and small helpers, and the SIMD building blocks that per-arch
   files share. A kernel's source is this file, its type's generic file, the type's per-arch files (each guarded by
   the instruction sets it needs), then the kernel (matmul.c, gather.c, attention.c); `cpu.kernels` puts them
   together, with the type's block size and bytes as BLOCK_VALUES and BLOCK_BYTES (from `gguf.types`). */
/* 16-float vectors passed between static functions of one unit: clang warns, on a CPU without AVX-512, that such an
   argument's ABI differs from AVX-512's; nothing here crosses a unit, so the warning only fills a stage's stderr */
#pragma clang diagnostic ignored "-Wpsabi"
typedef float f16v __attribute__((ext_vector_type(16)));
typedef float f8v __attribute__((ext_vector_type(8)));
typedef float f4v __attribute__((ext_vector_type(4)));
typedef unsigned char u8x32 __attribute__((ext_vector_type(32)));
typedef signed char i8x32 __attribute__((ext_vector_type(32)));
typedef unsigned char u8x16 __attribute__((ext_vector_type(16)));
typedef signed char i8x16 __attribute__((ext_vector_type(16)));
typedef unsigned int u32x16 __attribute__((ext_vector_type(16)));
typedef unsigned int u32x8 __attribute__((ext_vector_type(8)));
typedef int i32x16 __attribute__((ext_vector_type(16)));
typedef unsigned short u16x16 __attribute__((ext_vector_type(16)));
typedef unsigned short u16x8 __attribute__((ext_vector_type(8)));
typedef __fp16 h16x16 __attribute__((ext_vector_type(16)));
typedef __fp16 h16x8 __attribute__((ext_vector_type(8)));
/* thread core_id's rows [*n0, *n1) of N split over T threads in whole runs of R rows (empty past the last) */
static inline void rows_part(int N, int R, int T, int core_id, int* n0, int* n1) {
  int per = ((N + R - 1) / R + T - 1) / T * R;
  *n0 = core_id * per; *n1 = *n0 + per < N ? *n0 + per : N; }
static inline float half_at(const unsigned char* p) { unsigned short h; __builtin_memcpy(&h, p, 2);
  return (float)__builtin_bit_cast(__fp16, h); }
static inline u8x16 u8_at(const unsigned char* p) { u8x16 v; __builtin_memcpy(&v, p, 16); return v; }
static inline f16v f_at(const float* p) { f16v v; __builtin_memcpy(&v, p, 64); return v; }
static inline f16v fu8(u8x16 v) { return __builtin_convertvector(v, f16v); }
static inline f16v lo16(i8x32 v) { return __builtin_convertvector(
  __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), f16v); }
static inline f16v hi16(i8x32 v) { return __builtin_convertvector(
  __builtin_shufflevector(v, v, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31), f16v); }
static inline float hsum(f16v v) {  /* halves added pairwise: 4 adds deep (a row's last step; 9 one by one) */
  f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
        + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1]; }
/* bits [from, from + n) of each byte moved to [to, to + n), the rest 0: one shift of 16-bit lanes and a mask (x86 has
   no byte shift; the bits a lane's other byte shifts in fall outside the mask). from, to and n are constants. */
static inline u8x32 field8(u8x32 v, int from, int to, int n) {
  u16x16 w = (u16x16)v;
  w = to >= from ? w << (to - from) : w >> (from - to);
  return (u8x32)w & (u8x32)(unsigned char)(((1 << n) - 1) << to); }
/* the 16 bytes at p as 32 nibbles, one a byte: the low nibbles, then the high (the shift in 16-bit lanes, masked) */
static inline u8x32 nibbles32(const unsigned char* p) {
  u8x16 q = u8_at(p);
  return __builtin_shufflevector(q & 15, (u8x16)((u16x8)q >> 4) & 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31); }
/* the 32 bits at p as bytes, 0xFF where bit i is set (ggml's bytes_from_bits_32): the word in every lane, byte i / 8
   of it put in byte i by one shuffle within each 128-bit half, then compared with its bit */
static inline u8x32 bit_bytes(const unsigned char* p) {
  unsigned int h; __builtin_memcpy(&h, p, 4);
  u8x32 v = (u8x32)(u32x8)h;
  v = __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 18, 18, 18, 18, 18, 18, 18, 18, 19,
                              19, 19, 19, 19, 19, 19, 19);
  const u8x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8,
                     16, 32, 64, 128};
  return (u8x32)((v & bit) == bit); }
/* 16 vectors as the rows of a 16 x 16 matrix, transposed: 4 rounds of row r zipped with row r + 8 into rows 2r and
   2r + 1 (each round rotates an element's 8-bit (row, column) index by one bit; 64 two-source permutes) */
static inline void transpose16(f16v m[16]) {
  _Pragma("clang loop unroll(full)") for (int s = 0; s < 4; s++) {
    f16v t[16];
    _Pragma("clang loop unroll(full)") for (int r = 0; r < 8; r++) {
      t[2 * r] = __builtin_shufflevector(m[r], m[r + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      t[2 * r + 1] = __builtin_shufflevector(m[r], m[r + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                             15, 31);
    }
    _Pragma("clang loop unroll(full)") for (int r = 0; r < 16; r++) m[r] = t[r];
  }
}
static inline i32x16 i32_at(const unsigned char* p) { return __builtin_convertvector(u8_at(p), i32x16); }
static const f16v FIOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const u32x16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define SPLAT2(v, a, c) __builtin_shufflevector(v, v, a, a, a, a, a, a, a, a, c, c, c, c, c, c, c, c)
#define SPLAT4(v, a, b, c, d) __builtin_shufflevector(v, v, a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d)
/* x put in the order of a one-row product's lanes, once per call: chunk c of SIZE values, value m of lane l (m < M,
   l < 16) at 16 m + l, read from x at the chunk's offset AT (an expression of m and l) */
#define LANES(xp, x, chunks, SIZE, M, AT) \
  for (int c = 0; c < (chunks); c++) \
    _Pragma("clang loop unroll(full)") for (int m = 0; m < (M); m++) \
      _Pragma("clang loop unroll(full)") for (int l = 0; l < 16; l++) \
        (xp)[(SIZE) * c + 16 * m + l] = (x)[(SIZE) * c + (AT)];
#if defined(__AVX512F__)
#define LOOK __builtin_ia32_permvarsf512  /* 16 floats: out[i] = t[idx[i] & 15] (vpermps) */
static const i32x16 LOW4 = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
/* 32 floats (lo, hi) at a 5-bit index: bits 0-3 from nib, the rest from five (one vpternlogd: (c & a) | (~c & b),
   0xE4; vpermi2ps reads bits 0-4). The same select written in plain C became three instructions. */
#define LOOK5(lo, hi, nib, five) __builtin_ia32_vpermi2varps512( \
  lo, __builtin_ia32_pternlogd512_mask((i32x16)(nib), (i32x16)(five), LOW4, 0xE4, 0xFFFF), hi)
#endif
