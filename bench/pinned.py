"""``python -m bench.pinned``: a pp_worker stage pinned to one CPU, for the bench's pipelined-prefill rows.

Stage s of n runs on CPU ``s * cpus // n`` of the CPUs it may use: on 2 CPUs, 2 stages get one each and 3 stages get
0, 0, 1, which splits the work in halves (the last stage holds half the blocks). Pinned before tinygrad is imported:
tinygrad sizes its CPU thread pool by the affinity it sees then. The worker runs in this process (same pid).
"""

import os
import sys

cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[int(os.environ["STAGE"]) * len(cpus) // int(os.environ["NUM_STAGES"])]})

from pp_worker.worker.cli import main  # noqa: E402  (after the affinity is set)

sys.exit(main())
