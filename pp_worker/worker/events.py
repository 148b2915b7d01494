"""Lifecycle events: the event lines, the heartbeat thread and the exception hook.

Events carry ``event`` and ``stage_index`` and never ``request_id`` (the caller would mistake them for replies).
They go through the one protocol writer (``stdout.Out``), so they never interleave with replies.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from pp_worker.worker.stdout import Out, StdoutClosed


class Clock:
    """Uptime and request counter shared by events, heartbeats and status."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests_served = 0

    def uptime_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)


def rss_mb() -> int | None:
    """Resident set size in MB (Linux /proc); None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Events:
    """Emits lifecycle events; best effort: a closed stdout never raises from here."""

    def __init__(self, out: Out, stage_index: int | None, clock: Clock):
        self.out, self.stage_index, self.clock = out, stage_index, clock

    def emit(self, kind: str, **fields: Any) -> None:
        try:
            self.out.write(self.event(kind, **fields))
        except StdoutClosed:
            pass

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The event line as an object, for a writer other than ``emit`` (``Out.exit_between_lines``)."""
        fields.pop("request_id", None)  # an event must never look like a reply
        return {"event": kind, "stage_index": self.stage_index, **fields}

    def heartbeat(self) -> None:
        self.emit("heartbeat", uptime_ms=self.clock.uptime_ms(), rss_mb=rss_mb(),
                  requests_served=self.clock.requests_served)


def start_heartbeat(events: Events, interval_s: float, on_closed: Callable[[], None]) -> threading.Event:
    """A daemon thread emitting ``heartbeat`` every ``interval_s``; set the returned Event to stop it.
    When stdout turns out closed, ``on_closed`` wakes the main loop so the process exits promptly."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            events.heartbeat()
            if events.out.closed:
                on_closed()
                return

    threading.Thread(target=run, name="pp-worker-heartbeat", daemon=True).start()
    return stop


def install_excepthook(events: Events) -> None:
    """Report any uncaught exception as an event before the usual traceback on stderr."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        events.emit("uncaught_exception", type=exc_type.__name__, value=str(exc), traceback=text,
                    uptime_ms=events.clock.uptime_ms())
        sys.__excepthook__(exc_type, exc, tb)

    sys.excepthook = hook
