#!/usr/bin/env python3
"""Launcher for callers that take one script path (``$WORKER_CMD $WORKER_SCRIPT``), from any directory.

It runs the pp_worker package that sits beside this file. When the project's virtual environment exists and
this is another interpreter, it replaces itself (exec, same pid) with the venv's Python so the dependencies
are there; the pid in the ready line is still this process's.
"""

import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
VENV_PYTHON = os.path.join(HERE, ".venv", "bin", "python")

if __name__ == "__main__":
    if os.path.exists(VENV_PYTHON) and os.path.realpath(sys.prefix) != os.path.realpath(os.path.join(HERE, ".venv")):
        os.execv(VENV_PYTHON, [VENV_PYTHON, os.path.realpath(__file__), *sys.argv[1:]])
    sys.path.insert(0, HERE)
    from pp_worker.worker.cli import main

    sys.exit(main())
