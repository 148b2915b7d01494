"""``pp-pipeline``: start N stage workers, chain them over the wire protocol and stream the text.

stdout carries the generated text only; progress, headers and the summary go to stderr.

    pp-pipeline "Beautiful is better than"                      # 2 local stages, the embedded model
    pp-pipeline --stages 3 --model my.gguf --max-tokens 128 "Once upon a time"
    pp-pipeline --stub --concurrency 4 "a b" "c d" "e f" "g h"  # 4 generations in flight, printed in order
    pp-pipeline --launcher 'ssh node{stage} python3 -m pp_worker' --model /models/m.gguf "Hello"
    pp-pipeline --launcher ray --ray-num-gpus 1 --model /models/m.gguf "Hello"   # stages placed by Ray
    pp-pipeline --chat                                          # interactive, one KV session per conversation

Launcher placeholders: {stage}, {num_stages}, {python} (this interpreter) and {env}, where the
``env STAGE=.. NUM_STAGES=.. MODEL=..`` words go; without {env} they go right after ssh's destination, or in
front of the whole command. Exit status: 0; 1 when a stage dies, answers an error or times out (stderr names
the stage, its exit code and its stderr tail), or when a generation could not run (its prompt does not fit in
max_context; the other prompts still run); 2 for bad arguments (an empty prompt among them, or a --logit-bias
token the vocabulary lacks); 128 + the signal (130 for Ctrl-C) when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from pp_worker.driver.chat import chat
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
from pp_worker.driver.generation import Generation
from pp_worker.driver.pipeline import Cancel, Pipeline, PipelineError, RunStats, make_generations


class Output:
    """Streams generations' text to stdout in prompt order: the earliest unfinished one streams live, later ones
    are held until it is done. The stages hold back a character split across tokens (partial detokenize); a
    trailing U+FFFD still waits for the next token, in case a worker without that field sent half of one."""

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
    """Per generation: its tokens, why it stopped (eos, max_tokens, length, stop) or why it could not run."""
    lines = []
    for g in stats.generations:
        if g.stop_reason == "error":
            lines.append(f"[{g.index + 1}] error: {g.error}")
            continue
        lines.append(f"[{g.index + 1}] prompt {len(g.prompt_tokens)} tokens, generated {len(g.tokens)} "
                     f"(stopped: {g.stop_reason}), time to first token {g.ttft_s * 1000:.1f} ms, "
                     f"decode {g.decode_tps:.1f} tok/s{_drafts(g)}")
    lines.append(f"total: {len(stats.generations)} generation(s), {stats.tokens} tokens in {stats.wall_s:.2f} s "
                 f"({stats.tokens / stats.wall_s if stats.wall_s else 0:.1f} tok/s aggregate)")
    for i, (busy, n) in enumerate(zip(stats.stage_busy_s, stats.stage_requests, strict=True)):
        share = busy / stats.wall_s * 100 if stats.wall_s else 0.0
        lines.append(f"stage {i}: busy {busy:.3f} s ({share:.0f}% of wall), {n} requests")
    return "\n".join(lines)


def _drafts(g: Generation) -> str:
    return f", drafted {g.draft.proposed} tokens, kept {g.draft.accepted}" if g.draft else ""


# --- the command line ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pp-pipeline", description="run a pipeline of pp_worker stages and generate "
                                 "text; stdout gets the text only, stderr the progress and the summary")
    ap.add_argument("prompts", nargs="*", help="prompts (also --prompt)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--chat", action="store_true", help="interactive chat on stdin")
    add_pipeline_flags(ap, concurrency=1, max_tokens_help="tokens to generate per prompt (default 64)")
    args = ap.parse_args(argv)
    args.prompts = args.prompt + args.prompts
    if not args.chat and not args.prompts:
        ap.error("give a prompt (positional or --prompt), or --chat")
    empty = next((i for i, prompt in enumerate(args.prompts, start=1) if not prompt), None)
    if empty is not None:  # refused before any worker starts: a generation needs something to continue
        ap.error(f"prompt {empty} is empty")
    check_pipeline_flags(ap, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cancel = Cancel()
    try:
        with Pipeline(launch_from(args), load_timeout=args.load_timeout, step_timeout=args.step_timeout,
                      cancel=cancel, echo_stderr=args.verbose, prefill_chunk=args.prefill_chunk,
                      schedule=args.schedule, draft=draft_from(args)) as p:
            if problem := logit_bias_problem(sampling_from(args), p.vocab_size) or draft_problem(p.draft,
                                                                                                  p.vocab_size):
                print(f"pp-pipeline: {problem}", file=sys.stderr, flush=True)
                return 2
            if args.chat:
                chat(p, args.max_tokens, sampling_from(args), cancel)
                return 0
            gens = make_generations(p, args.prompts, args.max_tokens, sampling_from(args))
            output = Output(gens, sys.stdout, sys.stderr)
            for g in gens:
                g.on_text = output
            stats = p.run(gens, args.concurrency)
        print(summary(stats), file=sys.stderr, flush=True)
        return 1 if any(g.stop_reason == "error" for g in stats.generations) else 0
    except PipelineError as e:
        sys.stdout.flush()
        print(f"\npp-pipeline: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except DraftModelError as e:  # it did not load, or failed later
        print(f"\npp-pipeline: {e}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:  # stdout's reader left (`| head`); the stages were stopped on the way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
