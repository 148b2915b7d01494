"""``import pp_tinygrad_worker as worker``, as the seed's callers do in their tests: the seed's module-level names,
from the venv's interpreter and from plain ones outside it (which may lack numpy and pybase64)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCHER, VENV_BIN, clean_env

SEED_NAMES = """
import inspect, json, os, sys
sys.path.insert(0, {here!r})
pid = os.getpid()
import pp_tinygrad_worker as worker
def raises(f, *args):
    try:
        f(*args)
    except ValueError:
        return True
    return False
print(json.dumps({{
    "same_process": os.getpid() == pid,
    "tinygrad_imported": "tinygrad" in sys.modules,
    "stub_sizes": [worker.STUB_HIDDEN_DIM, worker.STUB_VOCAB_SIZE],
    "layer_ranges": [worker.compute_layer_range(s, 4, 17) for s in range(4)],
    "layer_range_refuses": [raises(worker.compute_layer_range, 0, 1, 16), raises(worker.compute_layer_range, 4, 4, 16)],
    "argmax": [worker.argmax_sample([0.1, 0.4, 0.2, 0.3]), worker.argmax_sample([1.0, 1.0, 1.0, 9.0]),
               worker.argmax_sample([2.0, 2.0])],
    "argmax_refuses_empty": raises(worker.argmax_sample, []),
    "signatures": {{name: list(inspect.signature(getattr(worker, name)).parameters)
                    for name in ("compute_layer_range", "argmax_sample", "_install_excepthook")}},
}}))
"""

CRASH = """
import sys
sys.path.insert(0, {here!r})
import pp_tinygrad_worker as worker
worker._install_excepthook()
raise RuntimeError("boom-for-test")
"""


def interpreters() -> list[pytest.param]:
    """The venv's Python, and each python3 outside the venv of the venv's Python version (the package needs 3.11+;
    the venv's compiled dependencies are per version)."""
    outside = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                              if p and Path(p).resolve() != VENV_BIN.resolve())
    found = {"venv": sys.executable}
    for name, path in (("python3-on-path", shutil.which("python3", path=outside)), ("usr-bin", "/usr/bin/python3")):
        if path and os.path.exists(path):
            found[name] = path
    return [pytest.param(path, id=name) for name, path in found.items()]


def run(python: str, code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"{python} is Python {version}, the venv's is {sys.version_info[:2]}")
    return subprocess.run([python, "-c", code.format(here=str(LAUNCHER.parent))], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**clean_env(), **env})


@pytest.mark.parametrize("python", interpreters())
def test_the_seed_names_are_importable_and_work(python: str, tmp_path: Path) -> None:
    result = run(python, SEED_NAMES, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, lines  # importing printed nothing
    got = json.loads(lines[0])
    assert got["same_process"] and not got["tinygrad_imported"]  # no exec into the venv, no tinygrad
    assert got["stub_sizes"] == [16, 32]  # the contract's stub sizes
    assert got["layer_ranges"] == [[0, 4], [4, 8], [8, 12], [12, 17]]
    assert got["layer_range_refuses"] == [True, True]
    assert got["argmax"] == [1, 3, 0] and got["argmax_refuses_empty"]
    assert got["signatures"] == {"compute_layer_range": ["stage", "num_stages", "total_blocks"],
                                 "argmax_sample": ["logits"], "_install_excepthook": []}


@pytest.mark.parametrize("python", interpreters())
def test_the_seed_excepthook_reports_on_stdout(python: str, tmp_path: Path) -> None:
    result = run(python, CRASH, tmp_path, STAGE="3")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 1, lines
    event = json.loads(lines[0])
    assert (event["event"], event["type"], event["value"]) == ("uncaught_exception", "RuntimeError", "boom-for-test")
    assert "boom-for-test" in event["traceback"] and "line 6" in event["traceback"]
    assert event["stage_index"] == 3 and "request_id" not in event
    assert "RuntimeError: boom-for-test" in result.stderr  # the usual traceback still goes to stderr
