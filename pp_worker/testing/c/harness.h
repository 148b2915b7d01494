/* What the test programs that run kernels on files (kernels_main.c, call_main.c) share: reading a kernel's input
   file IN/<name>.in in pieces, writing its output OUT/<name>.out, and the main that runs every kernel listed. Each
   program defines `struct kernel` (with a `name`), `kernels[]` and `run(in, out, kernel)` before including it. */
#include <stdio.h>
#include <stdlib.h>

static void* slurp(FILE* f, size_t bytes) {
  void* p = malloc(bytes ? bytes : 1);
  if (!p || fread(p, 1, bytes, f) != bytes) { fprintf(stderr, "short input\n"); exit(1); }
  return p;
}

static FILE* open_input(const char* in, const char* name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.in", in, name);
  FILE* f = fopen(path, "rb");
  if (!f) { perror(path); exit(1); }
  return f;
}

static void write_output(const char* dir, const char* name, const void* data, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.out", dir, name);
  FILE* f = fopen(path, "wb");
  if (!f || fwrite(data, 1, bytes, f) != bytes) { perror(path); exit(1); }
  fclose(f);
}

static void run(const char* in, const char* dir, const struct kernel* kn);

int main(int argc, char** argv) {
  if (argc != 3) { fprintf(stderr, "usage: %s IN OUT\n", argv[0]); return 2; }
  for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) run(argv[1], argv[2], &kernels[i]);
  printf("ran %d kernels\n", (int)(sizeof kernels / sizeof kernels[0]));
  return 0;
}
