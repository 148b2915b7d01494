/* The table runner (worker/cpu/c/runner.c: pp_run, pp_help, pp_ticks, linked with it) on N threads, against the
   same rows run one part after another: `runner_main N TABLES MEETING` prints "ok ..." or names the first
   difference.

   A table's rows: C kernels of several parts (Q8_0 and F16 products, 64 x 64, testing/cross.py builds them from
   cpu.kernels' sources) and of one part, each reading what the row before wrote, and two rows (`meet`) that, in the
   last MEETING tables, have N parts that return only when all N are running at once. Every row is called as the
   runner calls any kernel: MAX_ARGS longs whatever its parameters.

   The first TABLES run with the runner's own spin (40 us): every 16th table starts once all helpers sleep in their
   futex, every 4th after a pause of about a spin, so tables start against helpers in each state (spinning,
   yielding, asleep); which thread runs which part is up to timing there (a helper may sleep through a table whose
   caller was slow: by design, the caller then runs the parts itself). The last MEETING start once all helpers
   sleep, with a spin of 10 s: the table's start must wake them (the futex), and every helper must then take a part
   of each meet (the claims), or the meet stops the table (after 20 s, named). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_ARGS = 24, ROW = 4 + MAX_ARGS, K = 64, B = 3, ROWS = 8 };
enum { S_TABLE = 1, S_ROWS = 2, S_SLEEPING = 3, S_SPIN = 4 };  /* runner.c's state words (cpu.graph.STATE) */
void pp_run(long* s);
void pp_help(long* s);
void pp_ticks(long* out);
void q8_0_mm(float*, const unsigned char*, const float*, const int*, int);  /* K = 64 */
void f16_mm(float*, const unsigned char*, const float*, const int*, int);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void nap(double s) { struct timespec t = {0, (long)(s * 1e9)}; nanosleep(&t, 0); }

static int late;  /* a meet that waited 20 s */
void meet(long* arrived, long parts, int core_id) {  /* returns once `parts` parts are running */
  __atomic_add_fetch(arrived, 1, __ATOMIC_SEQ_CST);
  for (double t0 = now(); __atomic_load_n(arrived, __ATOMIC_SEQ_CST) < parts; sched_yield())
    if (now() - t0 > 20) { late = 1; return; }
}

static unsigned rng = 12345;
static unsigned next(void) { return rng = rng * 1664525u + 1013904223u; }
static float uniform(void) { return (float)(next() >> 8) / (1 << 24) * 2 - 1; }

static unsigned char wq[K * (K / 32) * 34], wf[K * K * 2];
static float y[2][6][B * K];  /* the runner's (0) and the serial run's (1) buffers; y[.][0] is x */
/* N, B, parts, and F16's: whether x comes as panels (never here) */
static int dims[6][4] = {{K, B, 4, 0}, {K, B, 1, 0}, {K, B, 3, 0}, {K, 1, 1, 0}, {K, 1, 5, 0}, {K, 1, 2, 0}};
static long tbl[2][ROWS * ROW], arrived[2][2], state[16];

static void set_row(long* row, void* fn, long parts, long core, int n, const long* a) {
  memset(row, 0, ROW * sizeof(long));
  row[0] = (long)fn, row[1] = parts, row[2] = n, row[3] = core;
  memcpy(row + 4, a, n * sizeof(long));
}
static void fill(long* t, float (*v)[B * K], long* met, long meeting) {  /* one table; meets of `meeting` parts */
  /* matmul's parameters (out, w, x, dims, core_id): core_id is argument 4; meet's is argument 2 */
#define MM(r, fn, w, in, out, d) set_row(t + (r) * ROW, fn, dims[d][2], 4, 5, \
    (long[]){(long)v[out], (long)(w), (long)v[in], (long)dims[d], 0})
#define MEET(r, i) set_row(t + (r) * ROW, meet, meeting, 2, 3, (long[]){(long)&met[i], meeting, 0})
  MEET(0, 0);
  MM(1, q8_0_mm, wq, 0, 1, 0);  /* 4 parts */
  MM(2, f16_mm, wf, 1, 2, 1);   /* one part, reads row 1's output */
  MM(3, f16_mm, wf, 2, 3, 2);   /* 3 parts */
  MEET(4, 1);
  MM(5, q8_0_mm, wq, 3, 4, 3);  /* one row of x, one part: the type's one-row product */
  MM(6, q8_0_mm, wq, 3, 5, 4);  /* one row of x, 5 parts */
  MM(7, f16_mm, wf, 5, 4, 5);   /* one row of x, 2 parts, over row 6's output, into row 5's (written twice) */
}
static void serial(const long* row) {  /* a row's parts on this thread, one after another */
  for (long p = 0; p < (row[1] > 1 ? row[1] : 1); p++) {
    long a[MAX_ARGS];
    memcpy(a, row + 4, sizeof a);
    if (row[3] >= 0) a[row[3]] = p;
    ((void (*)(long, long, long, long, long, long, long, long, long, long, long, long, long, long, long, long, long,
               long, long, long, long, long, long, long))row[0])(
      a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16],
      a[17], a[18], a[19], a[20], a[21], a[22], a[23]);
  }
}
static int all_asleep(int threads) {  /* wait (up to 20 s) until every helper sleeps in its futex: all of them
  counted asleep at 50 looks in a row, 0.1 ms apart (a futex that returned at once would let them count in and out) */
  for (double t0 = now(); now() - t0 < 20;) {
    int looks = 0;
    while (looks < 50 && __atomic_load_n(&state[S_SLEEPING], __ATOMIC_SEQ_CST) == threads - 1) looks++, nap(1e-4);
    if (looks == 50) return 1;
    nap(1e-4);
  }
  return 0;
}
static void* helper(void* s) { pp_help(s); return 0; }

int main(int argc, char** argv) {
  if (argc != 4) { fprintf(stderr, "usage: %s THREADS TABLES MEETING\n", argv[0]); return 2; }
  int threads = atoi(argv[1]), first = atoi(argv[2]), tables = first + atoi(argv[3]), asleep = 0, met = 0;
  for (int b = 0; b < K * K / 32; b++) {  /* Q8_0: d = 2^-8 (fp16 0x1C00), random q */
    wq[34 * b] = 0x00, wq[34 * b + 1] = 0x1C;
    for (int i = 0; i < 32; i++) wq[34 * b + 2 + i] = next() >> 24;
  }
  for (int i = 0; i < K * K; i++) {  /* F16: sign, exponent 8-11 (2^-7 to 2^-4), mantissa: no conversion to call */
    unsigned short h = (next() >> 31) << 15 | (8 + (next() >> 30)) << 10 | next() >> 22;
    memcpy(wf + 2 * i, &h, 2);
  }
  fill(tbl[0], y[0], arrived[0], 1), fill(tbl[1], y[1], arrived[1], 1);
  long c[2];
  pp_ticks(&c[0]);
  double t0 = now();
  nap(0.01);
  pp_ticks(&c[1]);
  double rate = (c[1] - c[0]) / (now() - t0);
  state[S_SPIN] = (long)(rate * 40e-6);  /* cpu.graph's SPIN_S */
  pthread_t pool[64];
  for (int i = 0; i < threads - 1 && i < 64; i++) pthread_create(&pool[i], 0, helper, state);
  for (int n = 0; n < tables; n++) {
    int second = n >= first;
    if (n == first) {  /* helpers asleep, then woken by the next table into a 10 s spin: meets of N parts */
      if (!all_asleep(threads)) { printf("helpers not asleep after 20 s (table %d)\n", n); return 1; }
      state[S_SPIN] = (long)(rate * 10), fill(tbl[0], y[0], arrived[0], threads);
      asleep++;
    } else if (n % 16 == 0 && !second) {
      if (!all_asleep(threads)) { printf("helpers not asleep after 20 s (table %d)\n", n); return 1; }
      asleep++;
    } else if (n % 4 == 0) nap(40e-6);
    for (int s = 0; s < 2; s++) {
      arrived[s][0] = arrived[s][1] = 0;
      memset(y[s][1], 0xFF, sizeof y[s] - sizeof y[s][0]);  /* NaNs: a row not run shows */
    }
    for (int i = 0; i < B * K; i++) y[0][0][i] = y[1][0][i] = uniform();
    state[S_TABLE] = (long)tbl[0], state[S_ROWS] = ROWS;
    pp_run(state);
    for (int r = 0; r < ROWS; r++) serial(tbl[1] + r * ROW);
    if (late) { printf("table %d: a meet of %d parts waited 20 s\n", n, threads); return 1; }
    if (memcmp(y[0], y[1], sizeof y[0])) { printf("table %d: the runner's results differ\n", n); return 1; }
    met += second && arrived[0][0] == threads && arrived[0][1] == threads;
  }
  printf("ok threads=%d tables=%d asleep=%d met=%d\n", threads, tables, asleep, met);
  return 0;
}
