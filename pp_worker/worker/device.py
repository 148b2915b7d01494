"""Devices: tinygrad's device names (`device_kind`), and its default device, remembered per boot.

Without ``DEV``, tinygrad picks a device by opening each backend in turn (METAL, AMD, NV, CUDA, QCOM, CL, then CPU):
~0.25 s of every stage's start on a machine without a GPU, a third of a 3-stage restart on 2 cores (bench/NOTES.md).
The first stage started after a boot writes down what tinygrad chose (``$PP_CACHE_DIR/device.json``); the next ones
start on it. The entry is keyed by the boot, tinygrad's version and the environment's library paths and visible
devices: a new driver, a changed path or another tinygrad makes the next stage pick again. ``DEV`` set by the
operator always wins; ``PP_CACHE=0`` turns this off with the rest of the cache. A stage that fails to load on a
remembered device forgets it, so the next one picks again. Imports no tinygrad: `recall` must
run before it is imported (tinygrad reads ``DEV`` once, at import).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

from pp_worker.worker.cachedir import kept

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def device_kind(device: str) -> str:
    """tinygrad's device name without its backend or index: ``CPU:LLVM`` -> ``CPU``, ``CUDA:1`` -> ``CUDA``."""
    return device.split(":")[0]


def key() -> str | None:
    """What the pick depends on, as a digest; None where the boot cannot be told apart (no Linux boot id)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    env = sorted((k, v) for k, v in os.environ.items() if k.endswith(("_PATH", "VISIBLE_DEVICES")))
    return hashlib.sha256(repr((boot, version("tinygrad"), env)).encode()).hexdigest()


def _path() -> Path | None:
    return kept("device.json")


def recall() -> bool:
    """Set ``DEV`` to the device remembered for this boot, before tinygrad is imported; whether it did. Nothing when
    ``DEV`` is set, tinygrad is already imported, or there is no (readable, matching) entry."""
    if os.environ.get("DEV") or "tinygrad" in sys.modules or (path := _path()) is None or (k := key()) is None:
        return False
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    device = entry.get("device") if isinstance(entry, dict) and entry.get("key") == k else None
    if not isinstance(device, str) or not device:
        return False
    os.environ["DEV"] = device
    return True


def forget() -> None:
    """Drop the remembered device: one that failed to open must not fail every start until the next boot."""
    if (path := _path()) is not None:
        path.unlink(missing_ok=True)


def remember(device: str) -> None:
    """Write down ``device``, tinygrad's own pick, for the stages started after this one (written whole, renamed)."""
    if (path := _path()) is None or (k := key()) is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": k, "device": device}))
        tmp.replace(path)
    except OSError as e:  # an unwritable cache costs the next stage the pick, nothing else
        print(f"pp_worker: cannot remember the device in {path}: {e}", file=sys.stderr, flush=True)
