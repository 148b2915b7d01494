"""``python -m pp_worker``: run one stage worker."""

import sys

from pp_worker.worker.cli import main

sys.exit(main())
