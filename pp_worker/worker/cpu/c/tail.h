/* What every unit ends with (`kernels.unit` appends it). */
#if defined(__x86_64__) && !defined(__F16C__)
/* x86-64 without F16C (before 2012, and Atom-class Celerons and Pentiums since): clang 14 converts each fp16 by
   calling the runtime's __gnu_h2f_ieee, which tinygrad's loader cannot link (it links no library): given here, weak
   (one per unit, the tests link several). Last in every unit (`kernels.unit`): tinygrad calls a program at its first
   byte, so the kernel must be the first function the unit defines. */
__attribute__((weak)) float __gnu_h2f_ieee(unsigned short h) {
  unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) { float f = (float)m * 0x1p-24f; return sign ? -f : f; }  /* zero and subnormals: m 2^-24, exact */
  if (e == 31) return __builtin_bit_cast(float, sign | 0x7F800000u | (m ? 0x400000u : 0) | m << 13);  /* quiet */
  return __builtin_bit_cast(float, sign | (e + 112) << 23 | m << 13); }
#endif
