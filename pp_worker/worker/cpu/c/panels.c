/* x (B, K) -> its panels for F16's matrix product (matmul.c's gemm): panel p holds rows 32p..32p+31 of x, value k of
   its 32 rows side by side (32 floats a k; rows past B 0), so that a step of the product loads a value of 32 rows
   at once. dims = {B, parts}, panels split over the parts. A kernel ahead of the product's, as quantize.c is: x is
   arranged once however many parts the product splits into (each part arranging its own cost ~6% of its time at
   13-16 parts, more with more threads), and once for the products that share an x (q, k and v). */
__attribute__((min_vector_width(512))) void NAME(float* restrict xp, const float* restrict x, const int* restrict dims,
                                                  int core_id) {
  enum { K = PP_K };
  const int B = dims[0], T = dims[1];
  int p0, p1; rows_part((B + 31) / 32, 1, T, core_id, &p0, &p1);  /* this part's panels */
  for (int p = p0; p < p1; p++)
    for (int half = 0; half < 2; half++)
      for (int k = 0; k < K; k += 16) {  /* 16 rows' 16 values at a time, transposed */
        f16v m[16];
        _Pragma("clang loop unroll(full)") for (int j = 0; j < 16; j++) {
          const int b = 32 * p + 16 * half + j;
          m[j] = b < B ? f_at(x + (long)b * K + k) : 0;
        }
        transpose16(m);
        _Pragma("clang loop unroll(full)") for (int j = 0; j < 16; j++)
          __builtin_memcpy(xp + ((long)p * K + k + j) * 32 + 16 * half, &m[j], sizeof m[j]);
      }
}
