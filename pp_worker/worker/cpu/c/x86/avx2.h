/* What the AVX2 code shares (x86 without AVX-512). Its vectors are of 8 floats, one ymm register each (clang splits
   the 16-float f16v in two). With no 16-float table lookup (vpermps reads 8), the one-row products convert the
   quantized values themselves (vcvtdq2ps), without shifting them down: a 32-byte run of a block read as 8 int32
   lanes, and each field masked where it lies (bits 4m.. of nibble m, 8k.. of byte k), converted, and multiplied by
   x scaled by 2^-(its bit offset) in PREP_X, which gives the product q x exactly (a power of two scales without
   rounding; x at 2^-24 of its size stays normal above 1e-31). A group's scale is broadcast from memory (SPILL): a
   load, where clang would shuffle it out of a register with two instructions. */
typedef int i32x8 __attribute__((ext_vector_type(8)));
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
static inline f8v f8_at(const float* p) { f8v v; __builtin_memcpy(&v, p, 32); return v; }
static inline f4v f4_at(const float* p) { f4v v; __builtin_memcpy(&v, p, 16); return v; }
static inline u32x8 u32x8_at(const unsigned char* p) { u32x8 v; __builtin_memcpy(&v, p, 32); return v; }
static inline f8v h8_splat(const unsigned char* p) {  /* the half at p in 8 lanes: vpbroadcastw, vcvtph2ps */
  unsigned short h; __builtin_memcpy(&h, p, 2);
  return __builtin_convertvector(__builtin_bit_cast(h16x8, (u16x8)h), f8v); }
static inline f8v fi32(u32x8 v) { return __builtin_convertvector((i32x8)v, f8v); }  /* vcvtdq2ps */
static inline float hsum8(f8v v) {
  f4v b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1]; }
/* The weights PF_AHEAD bytes ahead of a block asked for, a line at a time (prefetcht0). Where a matrix comes from
   memory, the one-row products of Q8_0, Q6_K, Q4_K and IQ4_XS wait on its lines though they need less than a thread
   streams: 1.04-1.35x with it (one thread, or two side by side), 0.96-0.99x cache-hot (bench/NOTES.md). Q4_0-Q5_1
   and Q5_K, bound by their instructions, gained too little to pay for it there. */
#ifndef PF_AHEAD
#define PF_AHEAD 8192
#endif
#define PREFETCH(b, bytes) _Pragma("clang loop unroll(full)") \
  for (int pf = 0; PF_AHEAD && pf < (bytes); pf += 64) __builtin_prefetch((b) + PF_AHEAD + pf)
/* lanes 0-3 v[a], lanes 4-7 v[a + 1] (a a constant) */
#define PAIR(v, a) __builtin_shufflevector(v, v, a, a, a, a, a + 1, a + 1, a + 1, a + 1)
/* an array the compiler must keep in memory from here on (its broadcasts then loads, not shuffles) */
#define SPILL(a) __asm__ volatile("" : : "r"(a) : "memory")
/* Byte lanes: 32 values of up to 7 bits as bytes in 8 int32 lanes, value 4 l + k in byte k of lane l; x put in that
   order once per call (bytes_x), each of its 32 values at 8 k + l, scaled by 2^-8k (byte 3 is shifted down instead) */
static const float BYTE_AT[4] = {1, 0x1p-8f, 0x1p-16f, 1};
static inline void bytes_x(const float* restrict x, float* restrict xp, int n32) {
  for (int c = 0; c < n32; c++)
    for (int k = 0; k < 4; k++)
      for (int l = 0; l < 8; l++) xp[32 * c + 8 * k + l] = x[32 * c + 4 * l + k] * BYTE_AT[k];
}
static inline f8v bytes_dot(u32x8 q, const float* p) {  /* the 32 values' products with x, summed to 8 lanes */
  return fi32(q & 0xFF) * f8_at(p) + fi32(q & 0xFF00) * f8_at(p + 8) + fi32(q & 0xFF0000) * f8_at(p + 16)
       + fi32(q >> 24) * f8_at(p + 24);
}
