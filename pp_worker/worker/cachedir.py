"""Where a stage keeps things between starts: fetched models (`gguf.fetch`), compiled forwards
(`compiled.jitcache`) and the device pick (`device`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models live: $PP_CACHE_DIR, else $XDG_CACHE_HOME/pp_worker, else ~/.cache/pp_worker."""
    if os.environ.get("PP_CACHE_DIR"):
        return Path(os.environ["PP_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pp_worker"


def kept(name: str) -> Path | None:
    """``name`` under `cache_dir`, for what a stage keeps between starts (compiled forwards, the device pick), or
    None when ``PP_CACHE=0`` turns that off (fetched models are kept either way)."""
    return None if os.environ.get("PP_CACHE", "1").strip() == "0" else cache_dir() / name
