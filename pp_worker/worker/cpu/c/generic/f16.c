/* F16: 32 values a kernel block, 64 bytes of fp16 */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  for (int i = 0; i < 2; i++) { u16x16 h; __builtin_memcpy(&h, b + 32 * i, 32);
    w[i] = __builtin_convertvector(__builtin_bit_cast(h16x16, h), f16v); } }
#if defined(__F16C__) || defined(__aarch64__)
/* matmul.c's tiles read the rows as they are: the CPU converts fp16 as it loads (x86-64 without F16C converts each
   value by a call, so there the rows are decoded once a chunk instead) */
#define ROWS_F16
#endif
