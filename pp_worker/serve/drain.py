"""Stopping pp-serve without cutting a request: SIGTERM (or Ctrl-C) drains; a second one ends what is left now.

On a signal uvicorn stops accepting at once and gives the requests in flight a few seconds before it cancels them:
streams cut without ``[DONE]``, tracebacks in the log. ``DrainingServer`` instead keeps serving while the pipeline
service drains: new requests get a 503 in OpenAI's error shape and ``/health`` says ``draining``, while the requests
already accepted run to their end, for up to ``drain_timeout`` seconds. Then what is left ends with a 503 (a stream:
an ``error`` event, then ``[DONE]``), and only then does uvicorn shut down, with nothing left to cut. The exit status
is still 128 + the signal: uvicorn raises the signals it caught again once it has stopped.
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

import uvicorn

from pp_worker.driver.service import PipelineService


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain before its shutdown and an exit status of its own (``stop``)."""

    def __init__(self, config: uvicorn.Config, service: PipelineService, drain_timeout: float):
        super().__init__(config)
        self.service, self.drain_timeout = service, drain_timeout
        self.exit_code = 0
        self._drain_until: float | None = None  # set by the first signal; 0: a second one came
        self._signal = ""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: plain assignments only, since it may interrupt the event loop anywhere (in a
        holder of the service's lock, say); ``on_tick`` does the work a tenth of a second later."""
        self._captured_signals.append(sig)  # raised again once uvicorn has stopped: exit status 128 + sig
        self._signal = self._signal or signal.Signals(sig).name
        self._drain_until = 0.0 if self._drain_until is not None else time.monotonic() + self.drain_timeout

    def stop(self, exit_code: int) -> None:
        """Shut down now (from any thread), exiting with ``exit_code``: the service is down for good."""
        self.exit_code = exit_code
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and not self.should_exit:
            self._drain(self._drain_until)
        return await super().on_tick(counter)

    def _drain(self, until: float) -> None:
        service = self.service
        if not service.draining:
            service.drain()
            running, waiting = service.load
            if running + waiting:
                _say(f"{self._signal}: draining {running} running and {waiting} waiting requests for up to "
                     f"{self.drain_timeout:g} s (a second signal ends them now); new requests get 503")
        if service.idle():
            self.should_exit = True
        elif service.status == "recovering":  # no stages to finish on; none are started for a server that stops
            _say(f"{service.load[1]} requests waiting for the restarted stages end with 503 (the server is "
                 f"shutting down)")
            service.expire("the server is shutting down")
            self.should_exit = True
        elif time.monotonic() >= until:
            running, waiting = service.load
            _say(f"{running + waiting} requests still in flight end with 503 (the server is shutting down)")
            service.expire("the server is shutting down")
            self.should_exit = True


def _say(text: str) -> None:
    print(f"pp-serve: {text}", file=sys.stderr, flush=True)
