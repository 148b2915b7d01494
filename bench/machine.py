"""What else the machine was doing while the bench ran: other processes' CPU time skews every timing row."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float | None:
    """CPU seconds all processes spent busy since boot (/proc/stat: everything but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / HZ


def _own_s() -> float:
    t = os.times()  # children: only those already reaped, which every worker is by the time we read this
    return t.user + t.system + t.children_user + t.children_system


class CpuMeter:
    """CPU seconds used by processes other than the bench and its (reaped) children, between start and read."""

    def __init__(self) -> None:
        self.wall0, self.busy0, self.own0 = time.monotonic(), _busy_s(), _own_s()

    def read(self) -> dict[str, Any]:
        wall, busy = time.monotonic() - self.wall0, _busy_s()
        cpus = os.cpu_count() or 1
        out: dict[str, Any] = {"wall_s": round(wall, 1), "cpus": cpus, "loadavg_end": os.getloadavg()}
        if busy is not None and self.busy0 is not None:
            foreign = max(0.0, (busy - self.busy0) - (_own_s() - self.own0))
            out |= {"foreign_cpu_s": round(foreign, 1), "foreign_share": round(foreign / (wall * cpus), 3)}
        return out


def describe() -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(), "loadavg_start": os.getloadavg()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
