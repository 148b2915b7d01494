/* Runs the matmul and gather kernels linked with it (testing/cross.py builds them, for any CPU) on the inputs of
   files, and writes their outputs, so that builds for different CPUs can be compared with one another.

   `kernels_main IN OUT`. kernels.h (written by cross.py) lists the kernels as KERNELS(X): X(name, K, row bytes,
   bytes of x's int8 blocks a row) for each pair name_mm, name_gather, and name_q where the product is on the
   integer path (x quantized by name_q, then name_mm reads its blocks; a weak symbol, 0 elsewhere). For each,
   IN/<name>.in holds int32 {N, B, T, NI}, then the weight (N rows of row bytes), x (B rows of K floats) and NI int32
   row ids; OUT/<name>.out gets the float32 products of x's first row (N), of all B rows (B x N), and the gathered
   rows (NI x K). Each product runs as T parts (core_id 0..T-1), one after another, as the runner's threads would
   run them. */
#include <stdio.h>
#include <stdlib.h>
#include "kernels.h"

typedef void (*matmul_fn)(float*, const unsigned char*, const float*, const int*, int);
typedef void (*gather_fn)(float*, const unsigned char*, const int*, const int*, int);
typedef void (*quantize_fn)(unsigned char*, const float*, const int*, int);
#define DECLARE(name, k, bytes, xq_bytes) \
  void name##_mm(float*, const unsigned char*, const float*, const int*, int); \
  void name##_gather(float*, const unsigned char*, const int*, const int*, int); \
  __attribute__((weak)) void name##_q(unsigned char*, const float*, const int*, int);
KERNELS(DECLARE)
struct kernel { const char* name; matmul_fn mm; gather_fn gather; quantize_fn q; int k, row_bytes, xq_bytes; };
#define ENTRY(name, k, bytes, xq_bytes) {#name, name##_mm, name##_gather, name##_q, k, bytes, xq_bytes},
static const struct kernel kernels[] = {KERNELS(ENTRY)};

#include "harness.h"

static void run(const char* in, const char* dir, const struct kernel* kn) {
  FILE* f = open_input(in, kn->name);
  int* head = slurp(f, 16), n = head[0], b = head[1], t = head[2], ni = head[3], k = kn->k;
  unsigned char* w = slurp(f, (size_t)n * kn->row_bytes);
  float* x = slurp(f, sizeof(float) * b * k);
  int* ids = slurp(f, sizeof(int) * ni);
  fclose(f);
  size_t outs = (size_t)n + (size_t)b * n + (size_t)ni * k;
  float* out = calloc(outs, sizeof(float));
  int one[3] = {n, 1, t}, all[3] = {n, b, t}, rows[2] = {n, ni}, q[2] = {b, t};
  const float* xs = x;
  unsigned char* xq = NULL;
  if (kn->q) {  /* the integer path: x's int8 blocks, quantized in T parts, are what the product reads */
    if (!(xq = malloc((size_t)b * kn->xq_bytes))) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (int c = 0; c < t; c++) kn->q(xq, x, q, c);
    xs = (const float*)xq;
  }
  for (int c = 0; c < t; c++) kn->mm(out, w, xs, one, c);
  for (int c = 0; c < t; c++) kn->mm(out + n, w, xs, all, c);
  kn->gather(out + n + (size_t)b * n, w, ids, rows, 0);
  write_output(dir, kn->name, out, sizeof(float) * outs);
  free(head), free(w), free(x), free(ids), free(out), free(xq);
}
