"""The watchdog: a worker whose caller is gone exits within a second, even in the middle of loading, a compile or a
forward.

The loop hears about its caller's end only when it reads stdin or writes stdout, which it does between ops; the load,
the warm-up or one op can take minutes (a compile, a BEAM search). A daemon thread therefore looks, twice a second, for:

- the parent process gone (the worker was re-parented): whoever started it died, e.g. by SIGKILL;
- stdout without a reader: no reply could ever be delivered;
- with ``PP_EXIT_ON_EOF=1``, the end of stdin while the worker loads or runs an op. pp-pipeline and pp-serve set it:
  they close a worker's stdin only to stop it, and through ssh or a Ray actor the end of stdin is all that reaches a
  worker whose driver died. Without it the op in progress still finishes and its reply is written: a caller may write
  its requests and close stdin, as ``echo ... | pp-worker`` does. Between ops the loop itself reads the end of stdin
  and exits (reason ``eof``) either way.

Not ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the *thread* that started the worker exits, so a
caller that spawns its workers from a pool thread (a Rust ``spawn_blocking``, a Ray actor's threads) would see them
killed while it lives. A re-parented process is the parent process's death, whichever thread forked.
"""

from __future__ import annotations

import os
import select
import sys
import threading

from pp_worker.worker.events import Events
from pp_worker.worker.loop import LoopState

INTERVAL_S = 0.5
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def hung_up(fd: int) -> bool:
    """Whether the other end of a pipe or socket is gone: a read end whose writers all closed (POLLHUP, even with
    data left to read), a write end without readers (POLLERR). Files and terminals never are."""
    poller = select.poll()
    poller.register(fd, 0)  # no events asked for: POLLHUP and POLLERR are always reported
    return any(revents & _GONE for _, revents in poller.poll(0))


def orphaned(parent: int, out_fd: int, exit_on_eof: bool, state: LoopState) -> str | None:
    """Why the worker should exit now (the ``exiting`` event's reason), or None while its caller is there."""
    if parent > 1 and os.getppid() != parent:  # started by init (a container's PID 1): no parent to watch
        return "parent_exited"
    if hung_up(out_fd):
        return "stdout_closed"
    if exit_on_eof and (state.loading or state.busy) and hung_up(0):
        return "eof"
    return None


def start_watchdog(events: Events, state: LoopState, out_fd: int, exit_on_eof: bool, who: str = "",
                   parent: int = 0) -> threading.Event:
    """A daemon thread that exits the process (status 0, after an ``exiting`` event and one stderr line) as soon as
    ``orphaned`` says why; set the returned Event to stop it. ``who``: the process in that line (default "stage N";
    a stage's background compile names itself, so its line in the stage's stderr is not read as the stage's).
    ``parent``: the process whose end is this one's (default the parent now)."""
    parent, stop = parent or os.getppid(), threading.Event()

    def run() -> None:
        while not stop.wait(INTERVAL_S):
            if (reason := orphaned(parent, out_fd, exit_on_eof, state)) and not stop.is_set():
                _exit(events, state, reason, who or f"stage {events.stage_index}")

    threading.Thread(target=run, name="pp-worker-watchdog", daemon=True).start()
    return stop


def _exit(events: Events, state: LoopState, reason: str, who: str) -> None:
    what = {"parent_exited": "the parent process exited", "stdout_closed": "stdout has no reader",
            "eof": "stdin closed"}[reason]
    doing = " while loading" if state.loading else " in the middle of an op" if state.busy else ""
    try:
        print(f"pp_worker: {who}: {what}{doing}; exiting", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr's reader may be gone too
        pass
    clock = events.clock
    events.out.exit_between_lines(0, [events.event("exiting", reason=reason, uptime_ms=clock.uptime_ms(),
                                                   requests_served=clock.requests_served)])
