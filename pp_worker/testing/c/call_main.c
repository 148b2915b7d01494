/* Runs any kernels linked with it (testing/cross.py builds them, for any CPU) on the buffers of files and writes
   their first buffer back, so that a kernel of its own signature (attention, the expert products) built for another
   CPU can be held against a reference.

   `call_main IN OUT`. calls.h (written by cross.py) lists the kernels as CALLS(X): X(name) for each. IN/<name>.in
   holds int32 {NB, NS, T}, then NB buffers (each an int64 byte count and its bytes) and NS int64 scalars; the kernel
   is called with the NB buffers' addresses, its core_id, then the scalars, every argument passed as a long as the
   runner passes them (runner.c), once per core_id 0..T-1, one after another. OUT/<name>.out gets buffer 0 after. */
#include <stdio.h>
#include <stdlib.h>
#include "calls.h"

enum { MAX_ARGS = 8 };
typedef void (*kernel_fn)(long, long, long, long, long, long, long, long);
#define DECLARE(name) void name(void);
CALLS(DECLARE)
struct kernel { const char* name; void (*fn)(void); };
#define ENTRY(name) {#name, name},
static const struct kernel kernels[] = {CALLS(ENTRY)};

#include "harness.h"

static void run(const char* in, const char* dir, const struct kernel* kn) {
  FILE* f = open_input(in, kn->name);
  int* head = slurp(f, 12), nb = head[0], ns = head[1], t = head[2];
  if (nb < 1 || nb + 1 + ns > MAX_ARGS) { fprintf(stderr, "%s: %d buffers, %d scalars\n", kn->name, nb, ns); exit(1); }
  long args[MAX_ARGS] = {0}, size0 = 0;
  void* bufs[MAX_ARGS];
  for (int i = 0; i < nb; i++) {
    long* bytes = slurp(f, 8);
    if (i == 0) size0 = *bytes;
    bufs[i] = slurp(f, *bytes), args[i] = (long)bufs[i];
    free(bytes);
  }
  long* scalars = slurp(f, 8 * (size_t)ns);
  for (int i = 0; i < ns; i++) args[nb + 1 + i] = scalars[i];
  fclose(f);
  for (int c = 0; c < t; c++) {
    args[nb] = c;
    ((kernel_fn)kn->fn)(args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7]);
  }
  write_output(dir, kn->name, bufs[0], (size_t)size0);
  for (int i = 0; i < nb; i++) free(bufs[i]);
  free(head), free(scalars);
}
