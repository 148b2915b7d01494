"""The one-process baseline: tinygrad's own ``Transformer.from_gguf`` + ``Transformer.generate`` on the same GGUF.

Run as a subprocess (``python -m bench.solo``) so its memory and JIT state never mix with the pipeline's; it
prints one JSON object on stdout. ``--idle`` instead measures tinygrad's own floor: a process that imported
tinygrad and ran one tiny kernel (then, given a model, built its tokenizer as the first and last stage do).

    python -m bench.solo MODEL --prompt-file P.json --decode 64 --max-context 1024 [--mode MODE]  (MODES, below)
    python -m bench.solo MODEL --serve --prompt-file P.json --max-context 1024 --mode MODE

``--serve`` keeps one warm process for measurements interleaved with a pipeline's (`Solo`): after the warm-up
prompts it prints ``{"ready": true}``, then answers each line ``{"prompt": [ids], "decode": n}`` with the arrival
times of its tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # so ``-m bench.solo`` resolves from anywhere


def vmhwm_mb(pid: int | str = "self") -> float | None:
    """Peak resident set (VmHWM) of a live process in MB, from /proc; None when it is gone or not Linux."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def idle(model: str | None) -> dict[str, float | None]:
    """tinygrad's floor; then, with a model, the floor plus the tokenizer the first and last stages build."""
    from tinygrad import Tensor

    (Tensor.ones(4).contiguous() + 1).realize().numpy()
    out = {"peak_rss_mb": vmhwm_mb()}
    if model:
        from tinygrad.llm.cli import SimpleTokenizer

        from pp_worker.worker.gguf.header import read_header

        SimpleTokenizer.from_gguf_kv(read_header(Path(model)).kv)
        out["with_tokenizer_peak_rss_mb"] = vmhwm_mb()
    return out


def run_json(args: list[str]) -> dict[str, Any]:
    """Run ``python -m bench.solo ARGS`` in a child (its memory and JIT state apart); its JSON line."""
    proc = subprocess.run([sys.executable, "-m", "bench.solo", *args], capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.solo {' '.join(args[:1])} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def timed_tokens(gen: Iterator[int], n: int) -> tuple[float, list[float]]:
    """Draw ``n`` tokens; (time of the first one after the call, arrival time of each token)."""
    t0, times = time.perf_counter(), []
    for _ in range(n):
        next(gen)
        times.append(time.perf_counter())
    return times[0] - t0, times


MODES = ("lazy", "lazy-tuned", "realize", "tuned")


def load(model: str, max_context: int, mode: str):
    """``lazy``: as tinygrad's CLI loads (REALIZE unset), weights stay views of the file (uint8 bitcast to fp16:
    tinygrad's fast mode on the CPU, bench/NOTES.md); ``realize``: each weight copied out into its own fp16 buffer;
    ``-tuned``: also each block's rope table and KV cache realized up front, as pp_worker's engine does. Left to
    ``_init_state``, the table stays lazy and the JIT recomputes it (cos/sin over max_context positions) in every
    block on every call."""
    from tinygrad import Device, Tensor
    from tinygrad.llm.cli import SimpleTokenizer
    from tinygrad.llm.model import Transformer, precompute_freqs_cis

    m, kv = Transformer.from_gguf(model, max_context, realize=mode in ("realize", "tuned"))
    SimpleTokenizer.from_gguf_kv(kv)  # held by a real one-process app (tinygrad's CLI): counts in its peak RSS
    if Device.DEFAULT.split(":")[0] == "CUDA":
        m.prefill_jit = _without_graph(m.prefill_jit)
    if mode.endswith("tuned"):
        c = m.blk[0].config
        freqs = precompute_freqs_cis(c.rope_dim, c.max_context, c.rope_theta).realize()
        for b in m.blk:  # with cache_kv set, _init_state leaves both alone
            b.cache_kv = Tensor.zeros(2, 1, c.n_kv_heads, c.max_context, c.head_dim).contiguous().realize()
            b.freqs_cis = freqs
    return m


def _without_graph(jit: Any) -> Any:
    """tinygrad's prefill JIT, captured with JIT=2 (no device graph). Its token count is symbolic, and on CUDA
    tinygrad 0.13.0 builds graphs with every variable at 0: the second prompt would fail with "CUDA Error 1" (the
    bug pp_worker avoids with fixed-size prefill JITs; pp_worker.testing.cudagraph shows it without a GPU).
    Decode (tinygrad's rollout JIT) keeps its graph, so the decode baseline is unchanged."""
    from tinygrad import Context

    def call(*args: Any, **kwargs: Any) -> Any:
        with Context(JIT=2):  # read when the JIT captures (its second call); replays use what was captured
            return jit(*args, **kwargs)

    return call


def _cold_ttft(m: Any, prompt: list[int]) -> float:
    """Time to first token with nothing reused: generate() would otherwise skip the prefix it shares with the
    previous prompt (its prefix cache), which the pipeline's fresh sessions cannot."""
    m._cached_tokens = []
    return timed_tokens(m.generate(list(prompt)), 1)[0]


def baseline(model: str, prompts: dict[str, list[list[int]]], decode: int, max_context: int, mode: str) -> dict:
    t0 = time.perf_counter()
    m = load(model, max_context, mode)
    out: dict = {"load_s": time.perf_counter() - t0}
    for p in prompts["warmup"]:  # the JITs capture on their second call: two short runs, then steady state
        timed_tokens(m.generate(list(p)), 4)
    ttft, times = timed_tokens(m.generate(list(prompts["decode"][0])), decode + 1)
    out |= {"decode_token_times": times, "decode_ttft_s": ttft}
    out["ttft_s"] = {str(len(p)): _cold_ttft(m, p) for p in prompts.get("ttft", [])}
    out["peak_rss_mb"] = vmhwm_mb()
    return out


def cold(model: str, prompt: list[int], decode: int, max_context: int, mode: str) -> dict:
    """A cold start as tinygrad's CLI makes one: load, a first generation of ``decode`` tokens after its first one
    (their wall-clock times, ``time.time()``, so a parent can count from before it started this process), then the
    same again, warm: the steady rate."""
    m = load(model, max_context, mode)
    to_epoch = time.time() - time.perf_counter()  # timed_tokens' perf_counter times -> the wall clock
    first = [t + to_epoch for t in timed_tokens(m.generate(list(prompt)), decode + 1)[1]]
    m._cached_tokens = []
    _, steady = timed_tokens(m.generate(list(prompt)), decode + 1)
    return {"first_times": first, "steady_times": steady}


def serve(model: str, prompts: dict[str, list[list[int]]], max_context: int, mode: str, out: Any) -> None:
    m = load(model, max_context, mode)
    for p in prompts["warmup"]:
        timed_tokens(m.generate(list(p)), 4)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        m._cached_tokens = []  # a fresh prefill each time, as the pipeline's fresh sessions
        _, times = timed_tokens(m.generate(list(ask["prompt"])), ask["decode"] + 1)
        print(json.dumps({"decode_token_times": times}), file=out, flush=True)


class Solo:
    """A warm one-process baseline in a child (``--serve``), asked for one generation at a time. ``command``: another
    child speaking the same protocol (`bench.peer`, llama.cpp), named ``mode``."""

    def __init__(self, model: str, prompt_file: str, max_context: int, mode: str, command: list[str] | None = None):
        self.mode = mode
        command = command or [sys.executable, "-m", "bench.solo", model, "--serve", "--prompt-file", prompt_file,
                              "--max-context", str(max_context), "--mode", mode]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.ready = self._read()

    def decode_times(self, prompt: list[int], decode: int) -> list[float]:
        """Arrival times of a generation's tokens: its first (which ends the prefill), then ``decode`` more."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "decode": decode}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        self.last_tokens: list[int] | None = reply.get("tokens")  # the generation's tokens, where the child says
        return reply["decode_token_times"]

    def tokenize(self, text: str) -> list[int]:
        """The child's own ids of ``text`` (`bench.peer`: llama.cpp's tokenizer)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tokenize": text}) + "\n")
        self.proc.stdin.flush()
        return self._read()["tokens"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench.solo --serve ({self.mode}) exited {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.solo")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--idle", action="store_true", help="tinygrad's own RSS floor: import + one tiny kernel")
    ap.add_argument("--prompt-file", help="JSON {warmup: [[ids]], decode: [[ids]], ttft: [[ids]]}")
    ap.add_argument("--decode", type=int, default=64, help="decode tokens to time after the first")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--mode", choices=MODES, default="lazy", help="how the weights and rope tables are held (see load)")
    ap.add_argument("--serve", action="store_true", help="stay up: one generation per request line (see Solo)")
    ap.add_argument("--cold", action="store_true", help="a cold start: the first generation, then a warm one (cold)")
    args = ap.parse_args(argv)
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # tinygrad's prints (DEBUG) must not spoil the JSON line
    if args.serve:
        with open(args.prompt_file) as f:
            serve(args.model, json.load(f), args.max_context, args.mode, real_stdout)
        return 0
    if args.idle:
        result = idle(args.model)
    elif args.cold:
        with open(args.prompt_file) as f:
            result = cold(args.model, json.load(f)["decode"][0], args.decode, args.max_context, args.mode)
    else:
        with open(args.prompt_file) as f:
            prompts = json.load(f)
        result = baseline(args.model, prompts, args.decode, args.max_context, args.mode)
    print(json.dumps(result), file=real_stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
