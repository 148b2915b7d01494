/* x (B, K) -> its int8 blocks for the integer path's products (q8.h): B rows of K / BLOCK_VALUES blocks of XB bytes,
   rows split over the parts. dims = {B, parts}. One kernel ahead of a product's, so that x is quantized once
   however many parts the product splits into (each part quantized all of x before: finer parts cost more than
   they balanced). */
void NAME(unsigned char* restrict xq, const float* restrict x, const int* restrict dims, int core_id) {
  enum { K = PP_K, NB = K / BLOCK_VALUES };
  const int B = dims[0], T = dims[1];
  int per = (B + T - 1) / T, b0 = core_id * per, b1 = b0 + per < B ? b0 + per : B;
  for (int b = b0; b < b1; b++)
    for (int j = 0; j < NB; j++) quantize_block(x + (long)b * K + j * BLOCK_VALUES, xq + ((long)b * NB + j) * XB);
}
