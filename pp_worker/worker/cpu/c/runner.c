/* The table runner (`cpu.graph`): a captured JIT's kernels as rows (kernel address, parts, argument count, index of
   core_id or -1, then MAX_ARGS argument slots), run in order by the calling thread with a pool of helper threads.

   A row of one part runs on the caller. A row of several parts (core_id 0..parts-1) is a job: the caller publishes it
   in the job word (job number << 16 | next part), and every thread, the caller included, claims the next part with a
   compare-and-swap until none is left; the caller then waits until all its parts are done before the next row (a row
   reads what the rows before it wrote). Nobody waits for a helper that is asleep or not scheduled: the parts it would
   have run are claimed by the others, so a stage whose helpers share the cores with another stage's work loses
   nothing to them. Which thread runs a part does not change its result: replays are bit-identical to tinygrad's graph.

   Waiting spins for a few microseconds, then yields the CPU between looks (the stages of a pipeline share the cores);
   a helper that finds no part for a while sleeps in a futex, and the caller wakes it when a table or a job starts
   (without the job's wake, a helper that slept in one gap of a table, such as another thread's longer part, left
   the rest of the table to the caller). A job's row pointer and part count are kept in one of two slots (by the
   job number's parity): a helper reads them before it claims, and its claim succeeds only while that job is the
   current one, so what it read was that job's. Waits are Linux syscalls by each arch's numbers and instruction
   (x86-64, aarch64); elsewhere `cpu.graph` keeps tinygrad's graph.
   The including unit defines MAX_ARGS, ROW (words per row), PARAMS/ARGS (the kernels' parameter and argument lists,
   MAX_ARGS longs) and which entry point it is: ENTRY_RUN, ENTRY_HELP or ENTRY_TICKS (tinygrad's CPU runtime calls a
   program at the start of its code, so each is a unit of its own, every helper before it always inlined). */
#define INLINE inline __attribute__((always_inline))
typedef void (*kernel)(PARAMS);
enum { S_GEN, S_TABLE, S_ROWS, S_SLEEPING, S_SPIN, S_JOB, S_JOBS, S_SLOT };  /* state words, int64 */
enum { SLOT_ROW, SLOT_PARTS, SLOT_DONE, SLOT_WORDS };  /* a job's slot: S_SLOT + SLOT_WORDS * (job & 1) */

#if defined(__x86_64__)
enum { SYS_SCHED_YIELD = 24, SYS_FUTEX = 202 };
static INLINE long syscall4(long nr, long a, long b, long c) {  /* a fourth argument (r10) of 0: futex's timeout */
  long ret; register long d __asm__("r10") = 0;
  __asm__ volatile("syscall" : "=a"(ret) : "0"(nr), "D"(a), "S"(b), "d"(c), "r"(d) : "rcx", "r11", "memory");
  return ret;
}
static INLINE long ticks(void) { return (long)__builtin_ia32_rdtsc(); }
static INLINE void relax(void) { __builtin_ia32_pause(); }
#elif defined(__aarch64__)
enum { SYS_SCHED_YIELD = 124, SYS_FUTEX = 98 };
static INLINE long syscall4(long nr, long a, long b, long c) {
  register long x8 __asm__("x8") = nr, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = 0;
  __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3) : "memory");
  return x0;
}
static INLINE long ticks(void) { long t; __asm__ volatile("mrs %0, cntvct_el0" : "=r"(t)); return t; }
static INLINE void relax(void) { __asm__ volatile("yield"); }
#else
#error "the table runner needs Linux on x86-64 or aarch64"
#endif
enum { FUTEX_WAIT_PRIVATE = 128, FUTEX_WAKE_PRIVATE = 129 };

static INLINE long get(long* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static INLINE void put(long* p, long v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static INLINE void pause_after(long t0, long spin) {  /* one look's wait: a spin at first, then the CPU given up */
  if (ticks() - t0 < spin) relax(); else syscall4(SYS_SCHED_YIELD, 0, 0, 0);
}

static INLINE void run_part(long* row, long part) {
  long a[MAX_ARGS];
  for (int i = 0; i < MAX_ARGS; i++) a[i] = row[4 + i];
  if (row[3] >= 0) a[row[3]] = part;
  ((kernel)row[0])(ARGS);
}
/* Claim and run one part of the current job; 0 when it has none left to claim. */
static INLINE int work(long* s) {
  long w = get(&s[S_JOB]);
  for (;;) {
    long* slot = s + S_SLOT + SLOT_WORDS * ((w >> 16) & 1);
    long* row = (long*)get(&slot[SLOT_ROW]);
    if ((w & 0xFFFF) >= get(&slot[SLOT_PARTS])) return 0;
    if (__atomic_compare_exchange_n(&s[S_JOB], &w, w + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      run_part(row, w & 0xFFFF);
      __atomic_add_fetch(&slot[SLOT_DONE], 1, __ATOMIC_SEQ_CST);
      return 1;
    }  /* another thread claimed first: w now holds the word it left */
  }
}

#if defined(ENTRY_RUN)
static INLINE void wake(long* s) {  /* a new generation: helpers asleep in the futex on it get up */
  put(&s[S_GEN], get(&s[S_GEN]) + 1);
  syscall4(SYS_FUTEX, (long)&s[S_GEN], FUTEX_WAKE_PRIVATE, 1 << 30);
}

void pp_run(long* s) {  /* run the table in s[S_TABLE] (s[S_ROWS] rows) on this thread and the helpers */
  put(&s[S_GEN], get(&s[S_GEN]) + 1);
  if (get(&s[S_SLEEPING])) wake(s);
  long* table = (long*)get(&s[S_TABLE]);
  long rows = get(&s[S_ROWS]), spin = get(&s[S_SPIN]) / 10;
  for (long r = 0; r < rows; r++) {
    long* row = table + r * ROW;
    long parts = row[1];
    if (parts < 2) { run_part(row, 0); continue; }
    long job = get(&s[S_JOBS]) + 1;
    long* slot = s + S_SLOT + SLOT_WORDS * (job & 1);
    put(&slot[SLOT_ROW], (long)row), put(&slot[SLOT_PARTS], parts), put(&slot[SLOT_DONE], 0);
    put(&s[S_JOBS], job);
    put(&s[S_JOB], job << 16);
    if (get(&s[S_SLEEPING])) wake(s);  /* a helper fell asleep in a gap of this table (a part that ran long) */
    while (work(s)) {}
    for (long t0 = ticks(); get(&slot[SLOT_DONE]) != parts;) pause_after(t0, spin);
  }
}

#elif defined(ENTRY_HELP)
void pp_help(long* s) {  /* a helper, for ever: parts of the jobs it finds, asleep between tables */
  for (;;) {
    long gen = get(&s[S_GEN]), spin = get(&s[S_SPIN]);
    for (long idle = ticks(); ticks() - idle < spin;) {  /* ~spin ticks without a part or a table: sleep */
      if (work(s)) idle = ticks();
      else if (get(&s[S_GEN]) != gen) gen = get(&s[S_GEN]), idle = ticks();
      else pause_after(idle, spin / 10);
    }
    __atomic_add_fetch(&s[S_SLEEPING], 1, __ATOMIC_SEQ_CST);
    if (get(&s[S_GEN]) == gen) syscall4(SYS_FUTEX, (long)&s[S_GEN], FUTEX_WAIT_PRIVATE, gen & 0xFFFFFFFF);
    __atomic_sub_fetch(&s[S_SLEEPING], 1, __ATOMIC_SEQ_CST);
  }
}

#elif defined(ENTRY_TICKS)
void pp_ticks(long* out) { *out = ticks(); }  /* for the caller to measure the tick rate, which sizes spins */
#endif
