"""``python -m pp_worker.serve``: the same as ``pp-serve``."""

import sys

from pp_worker.serve.cli import main

sys.exit(main())
