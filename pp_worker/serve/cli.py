"""``pp-serve``: start N stage workers (the same flags as ``pp-pipeline``, launcher included) and serve OpenAI's
completions API in front of them.

    pp-serve --stages 3 --port 8000                       # the embedded model on http://127.0.0.1:8000/v1
    pp-serve --model my.gguf --stages 4 --host 0.0.0.0 --concurrency 8
    pp-serve --launcher ray --ray-num-gpus 1 --model /models/m.gguf --stages 4

While the stages load and compile their decode forward the port answers 503, ``/health`` saying ``warming``
(serve.warming); then the API, while each stage compiles its other forwards in the background (PP_WARMUP=background
unless set otherwise: no request waits on a compile) (progress on stderr); ``--port 0`` picks a free port.
The sampling flags and ``--max-tokens`` are the defaults for requests that leave those fields out (with neither:
argmax, 64 tokens).
A stage that dies or freezes is replaced (``--restarts``); a signal drains the requests in flight first
(``--drain-timeout``, serve.drain). ``--api-key`` (or ``PP_API_KEY``, ``--api-key-file``) makes every request but
``/health`` and the chat page's files need the key; ``--cors-origin`` lets pages from those origins call it
(serve.access); ``--alias`` names the model in the API. Exit status: 0 after a clean stop; 1 when the stages
cannot start, or cannot be restarted; 128 + the signal (130 for Ctrl-C, 143 for SIGTERM) after a signal, once the
stages are shut down; 2 for a --logit-bias token the vocabulary lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
from types import FrameType

import uvicorn

from pp_worker.driver.chat import pipeline_chat_format
from pp_worker.driver.draft_model import DraftModelError
from pp_worker.driver.flags import (
    add_pipeline_flags,
    check_pipeline_flags,
    draft_from,
    draft_problem,
    launch_from,
    logit_bias_problem,
    sampling_from,
)
from pp_worker.driver.pipeline import PipelineError
from pp_worker.driver.service import PipelineService
from pp_worker.driver.stage_proc import Launch
from pp_worker.serve.access import check_origin, parse_keys, read_key_file
from pp_worker.serve.api import Defaults
from pp_worker.serve.app import build_app
from pp_worker.serve.drain import DrainingServer
from pp_worker.serve.warming import warming

DEFAULT_CONCURRENCY = 8  # the workers' default PP_MAX_SESSIONS: every generation in flight holds one session
KEY_VARIABLE = "PP_API_KEY"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pp-serve", description="serve OpenAI's completions API in front of a "
                                 "pipeline of pp_worker stages")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="uvicorn's log level (info: one line per request)")
    ap.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                    help="on SIGTERM or Ctrl-C, seconds the requests in flight get to finish while new ones get 503 "
                    "(default 30); then the rest end with 503")
    ap.add_argument("--restarts", type=int, default=5, metavar="N",
                    help="times the stages are restarted when one dies or gives no reply within --step-timeout, before "
                    "the server gives up and exits 1 (default 5; 0: exit on the first failure)")
    ap.add_argument("--restart-backoff", type=float, default=1.0, metavar="S",
                    help="seconds before the first restart attempt, doubled for each next one up to 30 (default 1)")
    ap.add_argument("--api-key", action="append", default=[], metavar="KEY",
                    help=f"require 'Authorization: Bearer KEY' on every request but /health and the chat page's "
                    f"files (repeatable, or comma-separated; also {KEY_VARIABLE}, which keeps keys out of ps)")
    ap.add_argument("--api-key-file", metavar="FILE", help="API keys, one per line (as --api-key)")
    ap.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="let pages from ORIGIN (scheme://host[:port], or * for any) call the API from a browser: "
                    "CORS headers and OPTIONS preflight (repeatable; default: none)")
    ap.add_argument("--alias", metavar="NAME", help="the model id the API reports and accepts (/v1/models, replies, "
                    "/props), as llama-server's (default: the GGUF's general.name)")
    add_pipeline_flags(ap, concurrency=DEFAULT_CONCURRENCY,
                       max_tokens_help="max_tokens of a request that does not say (default 64)")
    args = ap.parse_args(argv)
    check_pipeline_flags(ap, args)
    if not 0 <= args.port < 65536:
        ap.error("--port must be in [0, 65535]")
    if min(args.drain_timeout, args.restarts, args.restart_backoff) < 0:
        ap.error("--drain-timeout, --restarts and --restart-backoff must be >= 0")
    if args.alias is not None and not args.alias.strip():
        ap.error("--alias: an empty name")
    if problem := next(filter(None, map(check_origin, args.cors_origin)), None):
        ap.error(problem)
    args.keys = _keys(ap, args)
    return args


def _keys(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Every key from the flags, the file and the variable. The variable is removed from this process's
    environment, which the stage workers inherit: they have no use for it."""
    keys = parse_keys([*args.api_key, os.environ.pop(KEY_VARIABLE, "")])
    if args.api_key_file:
        try:
            keys += read_key_file(args.api_key_file)
        except OSError as e:
            ap.error(f"--api-key-file: {e}")
    if (args.api_key or args.api_key_file) and not keys:
        ap.error("--api-key / --api-key-file: no key given (a blank key would let anyone in)")
    return keys


def listen(host: str, port: int) -> socket.socket:
    """Bound before the stages load, so a port in use fails at once rather than after minutes of loading."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def _launch(args: argparse.Namespace) -> Launch:
    """As pp-pipeline's, with room for every generation in flight (each holds a KV session on every stage, and a
    worker evicting one that is still running would fail its next step, and with it the pipeline), and with the
    forwards other than decode compiled in the background (PP_WARMUP=background: the server says ok once the decode
    forwards are ready, and meanwhile runs prefills and batches in the sizes already compiled; from the second start
    on, every forward comes from the cache). The operator's own settings win."""
    launch = launch_from(args)
    env = {"PP_MAX_SESSIONS": str(args.concurrency), **_warmup()}
    return dataclasses.replace(launch, env={**{k: v for k, v in env.items() if k not in os.environ}, **launch.env})


def _warmup() -> dict[str, str]:
    """PP_WARMUP=background for the stages and the draft model's (`_launch`), unless the operator set PP_WARMUP."""
    return {} if "PP_WARMUP" in os.environ else {"PP_WARMUP": "background"}


def _exit_on(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"pp-serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    # uvicorn handles SIGTERM while serving, then raises it again: this makes that (or one while loading) an exit
    # through the finally below, which shuts the stages down
    signal.signal(signal.SIGTERM, _exit_on)
    host, port = sock.getsockname()[:2]
    print(f"pp-serve: warming up on http://{host}:{port} (503 until the stages are loaded and compiled)",
          file=sys.stderr, flush=True)
    try:
        with warming(sock):
            service = PipelineService(_launch(args), concurrency=args.concurrency, load_timeout=args.load_timeout,
                                      step_timeout=args.step_timeout, echo_stderr=args.verbose,
                                      prefill_chunk=args.prefill_chunk, schedule=args.schedule,
                                      restarts=args.restarts, backoff_s=args.restart_backoff,
                                      draft=draft_from(args, _warmup()))
    except PipelineError as e:
        print(f"pp-serve: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except DraftModelError as e:  # --draft-model did not load
        print(f"pp-serve: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    service.model = args.alias or service.model
    try:
        fmt = pipeline_chat_format(service.pipeline, log=lambda msg: print(f"pp-serve: {msg}", file=sys.stderr))
        sampling, vocab_size = sampling_from(args), service.pipeline.vocab_size
        if problem := logit_bias_problem(sampling, vocab_size) or draft_problem(service.pipeline.draft, vocab_size):
            print(f"pp-serve: {problem}", file=sys.stderr, flush=True)
            return 2
        app = build_app(service, fmt, Defaults(args.max_tokens, sampling, vocab_size), keys=args.keys,
                        cors_origins=args.cors_origin)
        access = f"; API key required ({len(args.keys)} accepted)" if args.keys else ""
        print(f"pp-serve: listening on http://{host}:{port} (model {service.model}, {args.stages} stages, up to "
              f"{service.concurrency} generations at once{access})", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="off")
        server = DrainingServer(config, service, args.drain_timeout)
        service.on_down = lambda: server.stop(1)  # a supervisor can then start a fresh server
        server.run(sockets=[sock])
        return server.exit_code
    except KeyboardInterrupt:
        return 130
    finally:
        service.close()
