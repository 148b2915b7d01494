"""The memory's own rate: a plain read of a buffer far bigger than the L3, split over N threads (C, pthreads).

A stage whose weights stream from memory can gain from more threads no more than such a read does, so the threads
section measures it beside the stage's calls, in the same rounds: when one thread's read already takes most of what
two get, no kernel can turn a second thread into 1.6x.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

SOURCE = r"""
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
typedef struct { const uint64_t* p; size_t n; uint64_t sum; } part_t;
static void* read_part(void* arg) {  /* one sum, which clang vectorizes and splits over several registers */
  part_t* q = arg; uint64_t s = 0;
  for (size_t i = 0; i < q->n; i++) s += q->p[i];
  q->sum = s;
  return 0;
}
uint64_t read_all(const uint64_t* p, size_t n, int threads) {  /* the caller is thread 0 */
  pthread_t th[256]; part_t parts[256]; size_t per = n / threads; uint64_t s = 0;
  for (int i = 0; i < threads; i++) {
    parts[i] = (part_t){p + i * per, per, 0};
    if (i) pthread_create(&th[i], 0, read_part, &parts[i]);
  }
  read_part(&parts[0]);
  for (int i = 1; i < threads; i++) pthread_join(th[i], 0);
  for (int i = 0; i < threads; i++) s += parts[i].sum;
  return s;
}
"""
MAX_THREADS = 256  # the C side's arrays


class BareRead:
    """A ``nbytes`` buffer (every page touched) and the compiled read; `gb_per_s` times one read by ``threads``."""

    def __init__(self, nbytes: int = 512 << 20) -> None:
        self.buf = np.ones(nbytes // 8, np.uint64)
        with tempfile.TemporaryDirectory(prefix="pp-bare-read-") as tmp:
            so = Path(tmp) / "read.so"
            subprocess.run([os.environ.get("CC", "clang"), "-O2", "-march=native", "-shared", "-fPIC", "-pthread",
                            "-x", "c", "-", "-o", str(so)], input=SOURCE.encode(), check=True)
            self.lib = ctypes.CDLL(str(so))  # mapped: the file may go
        self.lib.read_all.restype = ctypes.c_uint64
        self.lib.read_all.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def gb_per_s(self, threads: int) -> float:
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be 1..{MAX_THREADS}, not {threads}")
        n = self.buf.size - self.buf.size % threads  # equal parts: all of it read
        t0 = time.perf_counter()
        total = self.lib.read_all(self.buf.ctypes.data, n, threads)
        seconds = time.perf_counter() - t0
        assert total == n, (total, n)  # every word is 1: the read covered the buffer once
        return n * 8 / seconds / 1e9
