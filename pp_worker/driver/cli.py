"""``pp-pipeline``: start N stage workers, chain them over the wire protocol and stream the text.

stdout carries the generated text only; progress, headers and the summary go to stderr.

    pp-pipeline "Beautiful is better than"                      # 2 local stages, the embedded model
    pp-pipeline --stages 3 --model my.gguf --max-tokens 128 "Once upon a time"
    pp-pipeline --stub --concurrency 4 "a b" "c d" "e f" "g h"  # 4 generations in flight, printed in order
    pp-pipeline --launcher 'ssh node{stage} python3 -m pp_worker' --model /models/m.gguf "Hello"
    pp-pipeline --chat                                          # interactive, one KV session per conversation

Launcher placeholders: {stage}, {num_stages}, {python} (this interpreter) and {env}, where the
``env STAGE=.. NUM_STAGES=.. MODEL=..`` words go; without {env} they go right after ssh's destination, or in
front of the whole command. Exit status: 0; 1 when a stage dies, answers an error or times out (stderr names
the stage, its exit code and its stderr tail); 128 + the signal (130 for Ctrl-C) when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from pp_worker.driver.chat import chat, chat_format
from pp_worker.driver.generation import RECENT_TOKENS, Generation, Sampling
from pp_worker.driver.pipeline import Cancel, Pipeline, PipelineError, RunStats, make_generations
from pp_worker.driver.stage_proc import Launch


class Output:
    """Streams generations' text to stdout in prompt order: the earliest unfinished one streams live, later ones
    are held until it is done. A trailing U+FFFD (half a UTF-8 character) waits for the next token."""

    def __init__(self, gens: list[Generation], out: TextIO = sys.stdout, headers: TextIO | None = None):
        self.gens, self.out, self.headers = gens, out, headers
        self.texts = ["" for _ in gens]
        self.done = [False for _ in gens]
        self.shown = [0 for _ in gens]
        self.head = -1
        self._next_head()

    def __call__(self, g: Generation, text: str, finished: bool) -> None:
        self.texts[g.index], self.done[g.index] = text, finished
        while self.head < len(self.gens):
            i = self.head
            safe = self.texts[i] if self.done[i] else self.texts[i].rstrip("\ufffd")
            if len(safe) > self.shown[i]:
                self.out.write(safe[self.shown[i]:])
                self.shown[i] = len(safe)
            if not self.done[i]:
                break
            self.out.write("\n")
            self._next_head()
        self.out.flush()

    def _next_head(self) -> None:
        self.head += 1
        if self.headers and self.head < len(self.gens) and len(self.gens) > 1:
            self.out.flush()
            print(f"--- [{self.head + 1}/{len(self.gens)}] {self.gens[self.head].prompt!r}", file=self.headers,
                  flush=True)


def summary(stats: RunStats) -> str:
    lines = []
    for g in stats.generations:
        lines.append(f"[{g.index + 1}] prompt {len(g.prompt_tokens)} tokens, generated {len(g.tokens)} "
                     f"({g.stop_reason}), time to first token {g.ttft_s * 1000:.1f} ms, "
                     f"decode {g.decode_tps:.1f} tok/s")
    lines.append(f"total: {len(stats.generations)} generation(s), {stats.tokens} tokens in {stats.wall_s:.2f} s "
                 f"({stats.tokens / stats.wall_s if stats.wall_s else 0:.1f} tok/s aggregate)")
    for i, (busy, n) in enumerate(zip(stats.stage_busy_s, stats.stage_requests, strict=True)):
        share = busy / stats.wall_s * 100 if stats.wall_s else 0.0
        lines.append(f"stage {i}: busy {busy:.3f} s ({share:.0f}% of wall), {n} requests")
    return "\n".join(lines)


# --- the command line ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pp-pipeline", description="run a pipeline of pp_worker stages and generate "
                                 "text; stdout gets the text only, stderr the progress and the summary")
    ap.add_argument("prompts", nargs="*", help="prompts (also --prompt)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--stages", type=int, default=2, help="number of stages (default 2)")
    ap.add_argument("--model", help="GGUF path or tinygrad model name (default: the worker's embedded model)")
    ap.add_argument("--stub", action="store_true", help="stub workers (PP_WORKER_STUB=1): no model, fake tensors")
    ap.add_argument("--launcher", help="command template per stage, e.g. 'ssh node{stage} python3 -m pp_worker'; "
                    "placeholders {stage} {num_stages} {python} {env} (where the env K=V words go)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra variable for every worker; {stage} in V is the stage's index "
                    "(e.g. CUDA_VISIBLE_DEVICES={stage}: one GPU per stage)")
    ap.add_argument("--max-context", type=int, help="KV positions per session (MAX_CONTEXT for the workers)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    ap.add_argument("--concurrency", type=int, default=1, help="generations in flight at once (default 1)")
    ap.add_argument("--chat", action="store_true", help="interactive chat on stdin")
    ap.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for ready (default 600)")
    ap.add_argument("--step-timeout", type=float, default=120.0, help="seconds per request (default 120)")
    ap.add_argument("--verbose", "-v", action="store_true", help="echo the workers' stderr")
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--min-p", type=float)
    ap.add_argument("--repetition-penalty", type=float, help=f"over the last {RECENT_TOKENS} tokens")
    ap.add_argument("--seed", type=int)
    args = ap.parse_args(argv)
    args.prompts = args.prompt + args.prompts
    if not args.chat and not args.prompts:
        ap.error("give a prompt (positional or --prompt), or --chat")
    if args.stages < 2 or args.max_tokens < 1 or args.concurrency < 1:
        ap.error("--stages must be >= 2, --max-tokens and --concurrency >= 1")
    if any("=" not in kv for kv in args.env):
        ap.error("--env takes K=V")
    return args


def _launch(args: argparse.Namespace) -> Launch:
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.max_context:
        env["MAX_CONTEXT"] = str(args.max_context)
    return Launch(args.stages, model=args.model, stub=args.stub, launcher=args.launcher, env=env)


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cancel = Cancel()
    try:
        with Pipeline(_launch(args), load_timeout=args.load_timeout, step_timeout=args.step_timeout,
                      cancel=cancel, echo_stderr=args.verbose) as p:
            if args.chat:
                chat(p, chat_format(args.model), args.max_tokens, _sampling(args), cancel)
                return 0
            gens = make_generations(p, args.prompts, args.max_tokens, _sampling(args))
            output = Output(gens, sys.stdout, sys.stderr)
            for g in gens:
                g.on_text = output
            stats = p.run(gens, args.concurrency)
        print(summary(stats), file=sys.stderr, flush=True)
        return 0
    except PipelineError as e:
        sys.stdout.flush()
        print(f"\npp-pipeline: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except BrokenPipeError:  # stdout's reader left (`| head`); the stages were stopped on the way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
