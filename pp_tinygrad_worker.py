#!/usr/bin/env python3
"""Launcher for callers that take one script path (``$WORKER_CMD $WORKER_SCRIPT``), from any directory.

Run as a script, it runs the pp_worker package that sits beside this file. When the project's virtual environment
exists and this is another interpreter, it replaces itself (exec, same pid) with the venv's Python so the
dependencies are there; the pid in the ready line is still this process's.

Imported (``import pp_tinygrad_worker as worker``, as the seed's callers do in their tests), it prints nothing,
execs nothing and imports no tinygrad; it offers the seed's module-level names, delegating to the package:
``STUB_HIDDEN_DIM``, ``STUB_VOCAB_SIZE``, ``compute_layer_range``, ``argmax_sample`` and ``_install_excepthook``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

HERE = os.path.dirname(os.path.realpath(__file__))
VENV = os.path.join(HERE, ".venv")
VENV_PYTHON = os.path.join(VENV, "bin", "python")

if __name__ == "__main__" and os.path.exists(VENV_PYTHON) and os.path.realpath(sys.prefix) != os.path.realpath(VENV):
    os.execv(VENV_PYTHON, [VENV_PYTHON, os.path.realpath(__file__), *sys.argv[1:]])  # before importing anything


def _use_checkout() -> None:
    """Make the package beside this file importable, whatever the caller's cwd and sys.path."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)


def _use_dependencies() -> None:
    """For the names that need the package's dependencies (numpy, pybase64) under another interpreter: append the
    venv's site-packages when it was built for this Python version (compiled modules are per version). Appended,
    so the interpreter's own packages still win; done on first use only, never at import."""
    site = os.path.join(VENV, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    if os.path.realpath(sys.prefix) != os.path.realpath(VENV) and os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)


_use_checkout()

# --- the seed's module-level names -------------------------------------------------------------------------------
from pp_worker.worker.engines.stub import STUB_HIDDEN_DIM, STUB_VOCAB_SIZE  # noqa: E402  (needs the path above)

__all__ = ["STUB_HIDDEN_DIM", "STUB_VOCAB_SIZE", "compute_layer_range", "argmax_sample", "_install_excepthook"]


def compute_layer_range(stage: int, num_stages: int, total_blocks: int) -> tuple[int, int]:
    """Half-open ``[start, end)`` block range of ``stage`` (the last stage takes the remainder); ValueError on an
    impossible split (``num_stages < 2``, a stage out of range, fewer blocks than stages)."""
    from pp_worker.worker.shard import compute_layer_range as layer_range

    return layer_range(stage, num_stages, total_blocks)


def argmax_sample(logits: Sequence[float]) -> int:
    """Index of the largest logit, the lowest on ties; ValueError on empty input."""
    _use_dependencies()
    from pp_worker.worker.sampling import argmax_sample as argmax

    return argmax(logits)


def _install_excepthook() -> None:
    """Report any uncaught exception as an ``uncaught_exception`` event on stdout (type, value, traceback), then
    print the usual traceback on stderr. The event's ``stage_index`` is ``STAGE`` when that is set."""
    _use_dependencies()
    from pp_worker.worker.events import Clock, Events, install_excepthook
    from pp_worker.worker.stdout import Out

    stage = os.environ.get("STAGE", "").strip()
    sys.stdout.flush()  # whatever the caller printed comes first
    install_excepthook(Events(Out(sys.stdout.buffer), int(stage) if stage.isascii() and stage.isdigit() else None,
                              Clock()))


if __name__ == "__main__":
    from pp_worker.worker.cli import main

    sys.exit(main())
