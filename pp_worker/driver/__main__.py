"""``python -m pp_worker.driver``: the same as ``pp-pipeline``."""

import sys

from pp_worker.driver.cli import main

sys.exit(main())
