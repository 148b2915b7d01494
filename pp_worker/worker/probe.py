"""``PP_PROBE=1``: what a driver needs to split a model unevenly over its hosts (``--split auto``), before any load.

The worker prints one line, ``{"status": "probe", ...}``, and exits 0 without loading a tensor or reading stdin:
this host's free memory, the model's block count and the bytes of each block, and what the first stage (the
embedding) and the last (the output norm and head) hold on top of their blocks. Reading a model's header costs a
few KiB (a URL's header is fetched into the cache as a stage's load would fetch it).
"""

from __future__ import annotations

import os
from typing import Any

from pp_worker.worker.engines.pool import mem_available, parse_bytes
from pp_worker.worker.shard import Shard

STUB_BLOCK_BYTES = 1 << 20  # the stub's blocks hold nothing; it reports 1 MiB each, so a split can be planned


def free_bytes(env: dict[str, str]) -> int | None:
    """This host's free memory: ``PP_FREE_BYTES`` where set (for tests: a host with less memory than it has), else
    the kernel's MemAvailable (host memory; a GPU's own memory is not measured). Raises ValueError."""
    raw = env.get("PP_FREE_BYTES")
    return parse_bytes(raw) if raw is not None else mem_available()


def model_sizes(model: str, stub: bool) -> dict[str, Any]:
    """``total_blocks``, ``block_bytes`` (one per block, as the file holds them), ``first_bytes`` and
    ``last_bytes`` (the tensors stage 0 and the last stage read besides their blocks)."""
    if stub:
        from pp_worker.worker.engines.stub import STUB_BLOCKS

        return {"total_blocks": STUB_BLOCKS, "block_bytes": [STUB_BLOCK_BYTES] * STUB_BLOCKS, "first_bytes": 0,
                "last_bytes": 0}
    from pp_worker.worker.gguf.tensors import open_header, stage_tensors

    header = open_header(model, lambda kind, **fields: None)
    total = int(header.kv[f"{header.kv['general.architecture']}.block_count"])
    sizes = [0] * total
    for name, t in header.tensors.items():
        if name.startswith("blk."):
            sizes[int(name.split(".")[1])] += t.nbytes or 0

    def extra(shard: Shard) -> int:  # a stage of no blocks: what its role reads on top of them
        return sum(t.nbytes or 0 for t in stage_tensors(header, shard))

    return {"total_blocks": total, "block_bytes": sizes, "first_bytes": extra(Shard(0, 2, 0, 0, total)),
            "last_bytes": extra(Shard(1, 2, total, total, total))}


def probe_line(stage: int, model: str, stub: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    return {"status": "probe", "pid": os.getpid(), "stage": stage, "free_bytes": free_bytes(env or dict(os.environ)),
            **model_sizes(model, stub)}
