"""Start-up: configuration from the environment and flags, stdout protection, events, then the loop.

Bad configuration exits with status 2 and one line on stderr naming the variable and its value, before any
ready line and without reading stdin.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import FrameType

from pp_worker import DEFAULT_MODEL
from pp_worker.wire import b64_len
from pp_worker.worker.dispatch import Worker, model_fields
from pp_worker.worker.engines.base import Engine
from pp_worker.worker.engines.pool import PoolError, parse_bytes
from pp_worker.worker.events import Clock, Events, install_excepthook, rss_mb, start_heartbeat
from pp_worker.worker.loop import LineReader, LoopState, serve
from pp_worker.worker.q8 import DEFAULT_WIRE, SCALE_BYTES, WIRE_DTYPES
from pp_worker.worker.shard import SplitError, parse_layers
from pp_worker.worker.stdout import Out, protect_stdout
from pp_worker.worker.watchdog import start_watchdog

_ASCII_INT = re.compile(r"[0-9]{1,9}")
KV_DTYPE_NAMES = ("float32", "float16")  # engines.kvcache.KV_DTYPES, named here so stub mode never imports tinygrad
KERNEL_NAMES = ("c", "tinygrad")
WARMUPS = ("0", "1", "background")  # engines.weights.KERNELS, named here so stub mode never imports tinygrad
_LINE_HEADROOM = 1 << 20  # JSON envelope, token lists and sampling fields around the largest payload


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Config:
    stage: int
    num_stages: int
    stub: bool
    model: str
    max_context: int | None
    max_sessions: int
    heartbeat_s: float
    max_line_bytes: int | None
    warmup: str  # PP_WARMUP: "1" every JIT before ready, "0" decode only, "background" (see `start_background`)
    stub_delay_ms: int = 0
    stub_busy_file: str | None = None  # PP_STUB_BUSY_FILE (engines.stub)
    max_batch: int = 8  # sessions one batched decode step advances at most
    prefill_chunk: int | None = None  # None: the device's default (engines.tinygrad_engine)
    kv_dtype: str | None = None  # None: the device's default (engines.kvcache)
    wire_dtype: str = DEFAULT_WIRE  # of the hidden states this stage emits (worker.q8); it accepts any
    strict_finite: bool = False  # PP_STRICT_FINITE: a hidden state with inf or NaN is an error, not computed on
    beam: int = 0  # PP_BEAM: tinygrad BEAM search width for the decode JIT; 0: off
    exit_on_eof: bool = False  # PP_EXIT_ON_EOF: the end of stdin ends an op or a load in progress (worker.watchdog)
    # None: the device's default, as for prefill_chunk and kv_dtype (engines.weights, .hostio)
    kernels: str | None = None  # PP_KERNELS: "c" (the CPU's C kernels and native replays) or "tinygrad"
    pinned_host: bool | None = None  # PP_PINNED_HOST: outputs copied into host memory from the device's allocator
    threads: int = 1  # PP_THREADS: the CPU threads every kernel splits over (default_threads)
    kv_bytes: int | None = None  # PP_KV_BYTES: the KV pool's cap; None: sized from the free memory (engines.pool)
    host_stages: int = 1  # PP_HOST_STAGES: stages started on this host (they share its cores and memory)
    precompile: bool = False  # PP_PRECOMPILE: compile every JIT into the cache, then exit (the background child)
    parent_pid: int = 0  # PP_PARENT_PID: the process the watchdog watches (the background child's stage), 0: getppid
    exact: bool = False  # PP_EXACT: the C products' float path (cpu.kernels.numerics reads it from the environment)
    layers: tuple[int, int] | None = None  # PP_LAYERS: this stage's blocks (an uneven split); None: the even split
    probe: bool = False  # PP_PROBE: report this host's free memory and the model's block sizes, then exit (probe)


def _env_int(env: dict[str, str], name: str, default: int | None = None, low: int = 0) -> int | None:
    raw = env.get(name, "")
    if not raw.strip():
        return default
    if not _ASCII_INT.fullmatch(raw.strip()) or int(raw) < low:
        raise ConfigError(f"{name}={raw!r} is invalid: expected an integer >= {low} in ASCII digits")
    return int(raw)


def _env_switch(env: dict[str, str], name: str) -> bool | None:
    """A 1/0 switch; None when unset (its default applies)."""
    raw = env.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{name}={env[name]!r} is invalid: expected 1 or 0")
    return raw == "1" if raw else None


def _env_bytes(env: dict[str, str], name: str) -> int | None:
    raw = env.get(name, "")
    if not raw.strip():
        return None
    try:
        return parse_bytes(raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r} is invalid: {e}") from None


def _env_flag(env: dict[str, str], name: str) -> bool:
    return bool(_env_switch(env, name))


def _env_choice(env: dict[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    raw = env.get(name, "").strip()
    if raw and raw not in choices:
        raise ConfigError(f"{name}={env[name]!r} is invalid: expected one of {', '.join(choices)}")
    return raw or None


def _env_seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise ConfigError(f"{name}={env[name]!r} is invalid: expected a positive number of seconds")
    return value


def parse_config(argv: list[str] | None, env: dict[str, str]) -> Config:
    parser = argparse.ArgumentParser(prog="pp-worker", description="one stage of a pipeline-parallel LLM")
    parser.add_argument("--stub", action="store_true", help="deterministic fake engine, no model (PP_WORKER_STUB=1)")
    parser.add_argument("--model", help="a .gguf path, an http(s) URL of one or a tinygrad model name (MODEL); "
                        "default: the embedded model")
    parser.add_argument("--max-context", type=int, help="KV cache length per session (MAX_CONTEXT)")
    args = parser.parse_args(argv)
    stage, num_stages = _env_int(env, "STAGE"), _env_int(env, "NUM_STAGES")
    if stage is None or num_stages is None:
        raise ConfigError(f"{'STAGE' if stage is None else 'NUM_STAGES'} is required (set STAGE and NUM_STAGES)")
    if num_stages < 2:
        raise ConfigError(f"NUM_STAGES={env['NUM_STAGES']!r} is invalid: a pipeline needs at least 2 stages")
    if stage >= num_stages:
        raise ConfigError(f"STAGE={env['STAGE']!r} is invalid: must be in [0, {num_stages}) "
                          f"for NUM_STAGES={num_stages}")
    max_context = args.max_context if args.max_context is not None else _env_int(env, "MAX_CONTEXT", low=1)
    layers = _env_layers(env, stage)
    if max_context is not None and max_context < 1:
        raise ConfigError(f"--max-context={max_context} is invalid: expected an integer >= 1")
    return Config(stage=stage, num_stages=num_stages, stub=args.stub or _env_flag(env, "PP_WORKER_STUB"),
                  model=(args.model or env.get("MODEL", "")).strip() or str(DEFAULT_MODEL),
                  max_context=max_context, max_sessions=_env_int(env, "PP_MAX_SESSIONS", 8, low=1) or 8,
                  heartbeat_s=_env_seconds(env, "PP_HEARTBEAT_S", 30.0),
                  max_line_bytes=_env_int(env, "PP_MAX_LINE_BYTES", low=1024),
                  warmup=_env_choice(env, "PP_WARMUP", WARMUPS) or "0",
                  stub_delay_ms=_env_int(env, "PP_STUB_DELAY_MS", 0) or 0,
                  stub_busy_file=env.get("PP_STUB_BUSY_FILE") or None,
                  max_batch=_env_int(env, "PP_MAX_BATCH", 8, low=1) or 8,
                  prefill_chunk=_env_int(env, "PP_PREFILL_CHUNK", low=1),
                  kv_dtype=_env_choice(env, "PP_KV_DTYPE", KV_DTYPE_NAMES),
                  wire_dtype=_env_choice(env, "PP_WIRE_DTYPE", WIRE_DTYPES) or DEFAULT_WIRE,
                  strict_finite=_env_flag(env, "PP_STRICT_FINITE"),
                  beam=_env_int(env, "PP_BEAM", 0) or 0, exit_on_eof=_env_flag(env, "PP_EXIT_ON_EOF"),
                  kernels=_env_choice(env, "PP_KERNELS", KERNEL_NAMES), pinned_host=_env_switch(env, "PP_PINNED_HOST"),
                  threads=default_threads(env), kv_bytes=_env_bytes(env, "PP_KV_BYTES"),
                  host_stages=_env_int(env, "PP_HOST_STAGES", 1, low=1) or 1,
                  precompile=_env_flag(env, "PP_PRECOMPILE"), exact=_env_flag(env, "PP_EXACT"), layers=layers,
                  probe=_env_flag(env, "PP_PROBE"), parent_pid=_env_int(env, "PP_PARENT_PID", 0, low=1) or 0)


def _env_layers(env: dict[str, str], stage: int) -> tuple[int, int] | None:
    """PP_LAYERS=START:END, checked as far as it can be before the model's block count is known (`Shard.of`)."""
    raw = env.get("PP_LAYERS")
    if raw is None:
        return None
    try:
        layers = parse_layers(raw)
    except ValueError as e:
        raise ConfigError(f"PP_LAYERS={raw!r} is invalid: {e}") from None
    if stage == 0 and layers[0] != 0:
        raise ConfigError(f"PP_LAYERS={raw!r} is invalid: stage 0 must start at block 0")
    return layers


def default_threads(env: dict[str, str]) -> int:
    """PP_THREADS, else every CPU this process may use, even where other stages share them (PP_HOST_STAGES): a
    single stream keeps one stage busy at a time, and the runner never waits for a helper that is not scheduled
    (measured, docs/internals.md "Threads")."""
    threads = _env_int(env, "PP_THREADS", low=1)
    if threads is not None:
        return threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_engine(cfg: Config, events: Events) -> Engine:
    """The stub, or the tinygrad engine (imported only here, so stub mode never loads tinygrad)."""
    if cfg.stub:
        from pp_worker.worker.engines.stub import StubEngine

        return StubEngine(cfg.stage, cfg.num_stages, delay_s=cfg.stub_delay_ms / 1000, max_sessions=cfg.max_sessions,
                          max_batch=cfg.max_batch, busy_file=cfg.stub_busy_file, layers=cfg.layers,
                          max_context=cfg.max_context)
    from pp_worker.worker import device as device_pick

    operators = bool(os.environ.get("DEV"))
    recalled = not operators and device_pick.recall()  # before tinygrad's import, which reads DEV
    os.environ["CPU_COUNT"] = str(cfg.threads)  # read by tinygrad's import too
    try:
        from tinygrad import Device

        from pp_worker.worker.engines.tinygrad_engine import TinygradEngine

        # What the imports and the device make lives as long as the process: frozen out of the collector, the full
        # collections the load and the warm-up ask for (to hand freed memory back) walk only what came since, ~1 ms
        # each instead of 30-70. Once before opening the device too, or its imports' ~90K objects set off an
        # automatic full collection of their own.
        gc.freeze()
        Device[Device.DEFAULT]
        gc.freeze()
        engine = TinygradEngine(cfg.model, cfg.stage, cfg.num_stages, max_context=cfg.max_context,
                                max_sessions=cfg.max_sessions, max_batch=cfg.max_batch,
                                prefill_chunk=cfg.prefill_chunk, kv_dtype=cfg.kv_dtype, beam=cfg.beam,
                                kernels=cfg.kernels, pinned_host=cfg.pinned_host, lean=True, threads=cfg.threads,
                                kv_bytes=cfg.kv_bytes, host_stages=cfg.host_stages, emit=events.emit,
                                layers=cfg.layers)
    except Exception:
        if recalled:  # perhaps the device, not the model: the next start lets tinygrad pick again
            device_pick.forget()
        raise
    if not operators and not recalled:
        device_pick.remember(engine.device)
    # PP_WARMUP=1: every JIT before ready; else the decode JIT only (TinygradEngine.warmup), the rest compiled at
    # first use or, with "background", by a child process into the cache (start_background)
    engine.warmup(full=cfg.warmup == "1" or cfg.precompile)
    return engine


def start_background(engine: Engine, cfg: Config,
                     settings: dict[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    """PP_WARMUP=background: the JITs not compiled yet are compiled by a child process into the compiled-forward
    cache (this stage's settings, at a lower priority), and until a size is there this stage runs without it
    (prefills in the sizes it has, batches split into smaller ones, down to the decode JIT): no request waits on a
    compile, and each size is restored from the cache at its next use. None when there is nothing to compile or no
    cache to compile into (then sizes compile at their first use, as with PP_WARMUP=0). ``settings``: what the stage
    was told besides this process's environment (an in-process draft model's)."""
    if not engine.defer_compiles():
        return None
    # PP_PARENT_PID: a stage that dies before the child's watchdog starts is still its parent gone (not whoever
    # adopted the child by then)
    env = {**os.environ, **(settings or {}), "PP_PRECOMPILE": "1", "PP_PARENT_PID": str(os.getpid()),
           "PP_WARMUP": "1", "MODEL": cfg.model,
           "STAGE": str(cfg.stage), "NUM_STAGES": str(cfg.num_stages), "MAX_CONTEXT": str(engine.info.max_context),
           "PP_THREADS": str(cfg.threads), **engine.cache_settings()}
    return subprocess.Popen([sys.executable, "-m", "pp_worker"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))


def ready_line(engine: Engine, cfg: Config, clock: Clock) -> dict[str, object]:
    info, shard = engine.info, engine.shard
    return {"status": "ready", "pid": os.getpid(), "stage": shard.stage, "stage_index": shard.stage,
            "num_stages": shard.num_stages, "stub": cfg.stub, "model": model_given(cfg),
            "hidden_dim": info.hidden_dim,
            "vocab_size": info.vocab_size, "total_blocks": info.total_blocks, "layer_range": [shard.start, shard.end],
            "eos_token_ids": info.eos_token_ids, "max_context": info.max_context,
            **model_fields(engine, cfg.wire_dtype), "uptime_ms": clock.uptime_ms()}


def model_given(cfg: Config) -> str:
    """The model as the stage was given it (a path, URL or name; "stub" in stub mode): `model` on the starting and
    ready lines and in status, where ``model_name`` is the GGUF's own name."""
    return "stub" if cfg.stub else cfg.model


def _install_signals(state: LoopState, events: Events) -> tuple[int, int]:
    """SIGTERM/SIGINT: finish the request in flight, then exit 0; a second signal meanwhile exits at once (128 +
    signum); before the loop runs (loading) there is nothing to finish, so a signal exits at once with status 0.
    The handler raises nothing, so no signal can escape as an exception wherever it lands, and it never cuts a
    line in two (``Out.exit_between_lines``). Returns the wake-up pipe (read end, write end) that a signal writes
    to, so a blocked read wakes."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name, uptime_ms = signal.Signals(signum).name, events.clock.uptime_ms()
        if state.loading:
            events.out.exit_between_lines(0, [
                events.event("signal_received", signum=signum, name=name, uptime_ms=uptime_ms),
                events.event("exiting", reason="signal", uptime_ms=uptime_ms,
                             requests_served=events.clock.requests_served)])
        elif state.signum is not None and state.busy:  # a second signal while draining: leave now
            events.out.exit_between_lines(128 + signum, [
                events.event("signal_received", signum=signum, name=name, draining=True)])
        else:
            state.signum = signum

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    return wake_r, wake_w


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv, dict(os.environ))
    except ConfigError as e:
        print(f"pp_worker: {e}", file=sys.stderr, flush=True)
        return 2
    stdout = protect_stdout()
    out = Out(stdout)
    if cfg.probe:
        return _probe(cfg, out)
    clock = Clock()
    events = Events(out, cfg.stage, clock)
    install_excepthook(events)
    state = LoopState()
    wake_r, wake_w = _install_signals(state, events)
    events.emit("starting", pid=os.getpid(), stage=cfg.stage, num_stages=cfg.num_stages, stub=cfg.stub,
                model=model_given(cfg), python_version=sys.version.split()[0])
    stop_heartbeat = start_heartbeat(events, cfg.heartbeat_s, on_closed=lambda: _poke(wake_w))
    who = f"stage {cfg.stage}'s background compile" if cfg.precompile else ""
    stop_watchdog = start_watchdog(events, state, stdout.fileno(), cfg.exit_on_eof, who, cfg.parent_pid)
    try:
        return _run(cfg, out, clock, events, state, wake_r, stop_watchdog)
    finally:
        stop_heartbeat.set()
        stop_watchdog.set()


def _probe(cfg: Config, out: Out) -> int:
    """PP_PROBE=1: one ``probe`` line (worker.probe: free memory, block sizes) and exit, loading nothing."""
    from pp_worker.worker.probe import probe_line

    try:
        out.write(probe_line(cfg.stage, cfg.model, cfg.stub))
    except Exception as e:  # a missing model, a bad PP_FREE_BYTES: one line, as at a load
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"pp_worker: stage {cfg.stage}: cannot probe model {cfg.model!r}: {message}", file=sys.stderr, flush=True)
        return 2
    return 0


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:
        pass


def _exit_event(events: Events, clock: Clock, reason: str, signum: int | None = None) -> None:
    if signum is not None:
        events.emit("signal_received", signum=signum, name=signal.Signals(signum).name, uptime_ms=clock.uptime_ms())
    events.emit("exiting", reason=reason, uptime_ms=clock.uptime_ms(), requests_served=clock.requests_served)


def _load(cfg: Config, events: Events) -> Engine | None:
    """The engine, or None after reporting why it could not be loaded (event + one stderr line)."""
    try:
        return build_engine(cfg, events)
    except Exception as e:  # any load failure is reported the same way
        from pp_worker.worker.gguf.header import ModelLoadError

        # unexpected: the traceback helps; an expected one says it
        if not isinstance(e, (ModelLoadError, PoolError, SplitError)):
            import traceback

            traceback.print_exc(file=sys.stderr)
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        events.emit("model_load_failed", model=cfg.model, type=type(e).__name__, value=message)
        print(f"pp_worker: stage {cfg.stage}: cannot load model {cfg.model!r}: {message}", file=sys.stderr, flush=True)
        return None


def _run(cfg: Config, out: Out, clock: Clock, events: Events, state: LoopState, wake_r: int,
         stop_watchdog: threading.Event) -> int:
    engine = _load(cfg, events)
    if engine is None:
        return 2
    if cfg.wire_dtype == "q8" and engine.info.hidden_dim == SCALE_BYTES:
        print(f"pp_worker: PP_WIRE_DTYPE=q8 is invalid for hidden_dim {SCALE_BYTES}: a q8 payload would be as long "
              "as an f16 one, so a receiver could not tell them apart", file=sys.stderr, flush=True)
        return 2
    if cfg.precompile:
        return 0  # the background child: every JIT is compiled and kept on disk (build_engine's warm-up)
    worker = Worker(engine, clock, model_given(cfg), cfg.wire_dtype, cfg.strict_finite, events.emit)
    child = start_background(engine, cfg) if cfg.warmup == "background" else None
    info = engine.info
    # a whole context's hidden state in one request, as float32 (the widest dtype a stage accepts)
    cap = cfg.max_line_bytes or b64_len(info.max_context * info.hidden_dim * 4) + _LINE_HEADROOM
    out.write(ready_line(engine, cfg, clock))
    events.emit("ready", pid=os.getpid(), stage=cfg.stage, uptime_ms=clock.uptime_ms(), rss_mb=rss_mb())
    events.emit("pp_worker_ready", pid=os.getpid(), uptime_ms=clock.uptime_ms())
    state.loading = False
    try:
        reason = serve(LineReader(sys.stdin.buffer, cap, wake_fd=wake_r), out, worker, state)
    finally:
        if child is not None and child.poll() is None:
            child.kill()  # what it compiled so far is on disk; the rest is for the next start
    stop_watchdog.set()  # from here this thread writes the last line and exits
    if reason == "stdout_closed":
        print(f"pp_worker: stage {cfg.stage}: stdout closed by the reader; exiting", file=sys.stderr, flush=True)
        return 0
    _exit_event(events, clock, reason, state.signum)
    return 0
