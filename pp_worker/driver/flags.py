"""The command-line flags ``pp-pipeline`` and ``pp-serve`` share: how the stages start and how they sample."""

from __future__ import annotations

import argparse
import atexit
import os

from pp_worker.driver.draft import DRAFTS, Draft
from pp_worker.driver.draft_model import DraftWorker
from pp_worker.driver.generation import RECENT_TOKENS, Sampling
from pp_worker.driver.pipeline import SCHEDULES
from pp_worker.driver.ray_launch import RAY_LAUNCHER, RayPlacement
from pp_worker.driver.split import parse_split
from pp_worker.driver.stage_proc import Launch
from pp_worker.worker.engines.pool import parse_bytes

WIRE_DTYPES = ("f16", "auto", "f32", "q8")  # worker.q8.WIRE_DTYPES; the driver imports nothing of the worker
MAX_LOGIT_BIAS = 100.0  # worker.protocol.MAX_LOGIT_BIAS, as OpenAI
# --draft-max's default: a draft model's guesses cost a forward each, and a good one's are nearly all kept, so a check
# of 7 (8 rows, one call of each stage's ladder) beat 3 on the embedded model with the Zen draft, 1 and 8 streams;
# prompt lookup too once 8 streams compute their prompt once (fewer trips where every row costs compute: smol's
# 8 streams 1.46-1.52x of plain against 1.28-1.36x; free text drafts nothing either way; bench/NOTES.md, Prompts
# that begin alike). k adapts down on misses either way.
DRAFT_MAX = {"ngram": 7, "model": 7}


def add_pipeline_flags(ap: argparse.ArgumentParser, *, concurrency: int, max_tokens_help: str) -> None:
    """The stages (how many, which model, how started), the limits, and the sampling defaults."""
    ap.add_argument("--stages", type=int, default=2, help="number of stages (default 2)")
    ap.add_argument("--model", help="GGUF path, http(s) URL (each stage fetches only its own tensors' bytes) or "
                    "tinygrad model name (default: the worker's embedded model)")
    ap.add_argument("--stub", action="store_true", help="stub workers (PP_WORKER_STUB=1): no model, fake tensors")
    ap.add_argument("--launcher", help="command template per stage, e.g. 'ssh node{stage} python3 -m pp_worker'; "
                    "placeholders {stage} {num_stages} {python} {env} (where the env K=V words go); "
                    f"'{RAY_LAUNCHER}': each stage in a Ray actor (pip install pp_worker[ray])")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra variable for every worker; {stage} in V is the stage's index "
                    "(e.g. CUDA_VISIBLE_DEVICES={stage}: one GPU per stage)")
    ap.add_argument("--wire-dtype", choices=WIRE_DTYPES,
                    help="hidden states between stages: auto (the default: float16, and float32 for a state past "
                    "float16's range), f16 (float16 only: such a state is an error), f32 (float32 always: twice the "
                    "bytes, no rounding between stages) or q8 (int8 with a scale per token: about half the bytes, not "
                    "bit-exact); sets PP_WIRE_DTYPE for the workers")
    ap.add_argument("--split", metavar="N1,N2,...|auto",
                    help="blocks per stage (an uneven split, e.g. 20,8 for a 28-block model: a bigger host more), "
                    "or 'auto': each stage's host reports its free memory before the load and blocks go out in "
                    "proportion (the head counted with the last stage, the embedding with the first); default: the "
                    "even split")
    ap.add_argument("--max-context", type=int, help="KV positions per session (MAX_CONTEXT for the workers)")
    ap.add_argument("--kv-memory", metavar="BYTES", help="each stage's KV pool cap, e.g. 512M or 2G (PP_KV_BYTES; "
                    "default: a share of the memory free once the stage's weights are in)")
    ap.add_argument("--max-tokens", type=int, default=64, help=max_tokens_help)
    ap.add_argument("--prefill-chunk", type=int, metavar="N",
                    help="pipeline a longer prompt through the stages in chunks of N tokens, so stage s+1 works while "
                    "stage s prefills the next chunk (default: the stages' own prefill_chunk; 0: send prompts whole)")
    ap.add_argument("--concurrency", type=int, default=concurrency,
                    help=f"generations in flight at once (default {concurrency})")
    ap.add_argument("--schedule", choices=SCHEDULES, default="auto",
                    help="how the generations in flight share the stages: lockstep (they all take each token together, "
                    "one batch passed from stage to stage: best where the stages share the same cores), groups (as "
                    "many groups as stages, each in lock-step, so each stage works on one group's batch while the next "
                    "works on another's: for a device or machine per stage), overlap (each goes on alone as soon as "
                    "its token is back); auto (default): lockstep when every stage is a local process on the CPU, "
                    "groups otherwise")
    ap.add_argument("--draft", choices=DRAFTS,
                    help="speculative decoding: 'ngram' guesses the next tokens from earlier text (prompt lookup) and "
                    "the stages check them in one pass, so one trip through the pipeline can yield several tokens; "
                    "the output is exactly the model's (default: off)")
    ap.add_argument("--draft-model", metavar="PATH",
                    help="speculative decoding with a small GGUF of the same vocabulary as the model: it runs on this "
                    "host, in this process (see --draft-processes), and guesses the next tokens greedily; the output "
                    "is exactly the model's (instead of --draft)")
    ap.add_argument("--draft-processes", action="store_true",
                    help="run --draft-model as two local worker processes instead of in this process: isolation (a "
                    "draft that crashes, hangs or runs out of memory is killed and restarted, --step-timeout bounds "
                    "each call) for ~1 ms more a guessed token")
    ap.add_argument("--draft-max", type=int, metavar="K",
                    help=f"the most tokens guessed at a step where a trip is all compute (default {DRAFT_MAX['ngram']} "
                    f"with --draft ngram, {DRAFT_MAX['model']} with --draft-model; fewer while guesses miss; a check "
                    "of 1, 3, 7... guesses is whole calls of the stages); where a slow link or waits for other "
                    "generations make trips longer, up to K x a trip over its compute, at most 16")
    ap.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for ready (default 600)")
    ap.add_argument("--step-timeout", type=float, default=120.0, help="seconds per request (default 120)")
    ap.add_argument("--verbose", "-v", action="store_true", help="echo the workers' stderr")
    ray = ap.add_argument_group(f"Ray placement (--launcher {RAY_LAUNCHER})")
    ray.add_argument("--ray-address", help="a running cluster (ray start --head prints it); default: RAY_ADDRESS, "
                     "else a new local cluster")
    ray.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs each stage asks for (default 1)")
    ray.add_argument("--ray-num-gpus", type=float, default=0.0, help="GPUs each stage asks for (default 0)")
    sampling = ap.add_argument_group("sampling (default: argmax)")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float, help=f"over the last {RECENT_TOKENS} tokens")
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--logit-bias", action="append", default=[], type=_bias_entry, metavar="ID=BIAS",
                          help="add BIAS, in [-100, 100], to token ID's logit before sampling (repeatable; -100 all "
                          "but bans the token, 100 all but forces it)")


def _bias_entry(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        entry = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {text!r}") from None
    if entry[0] < 0 or not abs(entry[1]) <= MAX_LOGIT_BIAS:
        raise argparse.ArgumentTypeError(f"expected a token id >= 0 and a bias in [-100, 100], got {text!r}")
    return entry


def check_pipeline_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (through ``ap.error``, exit 2) what would only fail later, once the workers are loading."""
    if args.stages < 2 or args.max_tokens < 1 or args.concurrency < 1:
        ap.error("--stages must be >= 2, --max-tokens and --concurrency >= 1")
    if args.draft_max is None:
        args.draft_max = DRAFT_MAX["model" if args.draft_model else "ngram"]
    if args.draft_max < 1:
        ap.error("--draft-max must be >= 1")
    if args.draft and args.draft_model:
        ap.error("--draft and --draft-model: give one")
    if args.draft_processes and not args.draft_model:
        ap.error("--draft-processes goes with --draft-model")
    if args.draft_model and not os.path.isfile(args.draft_model):
        ap.error(f"--draft-model {args.draft_model}: no such file")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        ap.error("--prefill-chunk must be >= 0")
    if any("=" not in kv for kv in args.env):
        ap.error("--env takes K=V")
    if any(kv.startswith("PP_LAYERS=") for kv in args.env):
        ap.error("--env PP_LAYERS: every stage needs a range of its own; give --split N1,N2,... instead")
    if args.split is not None:
        try:
            args.split = parse_split(args.split, args.stages)
        except ValueError as e:
            ap.error(f"--split: {e}")
    if args.ray_num_cpus < 0 or args.ray_num_gpus < 0:
        ap.error("--ray-num-cpus and --ray-num-gpus must be >= 0")
    if args.kv_memory is not None:
        try:
            parse_bytes(args.kv_memory)
        except ValueError as e:
            ap.error(f"--kv-memory: {e}")


def launch_from(args: argparse.Namespace) -> Launch:
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.max_context:
        env["MAX_CONTEXT"] = str(args.max_context)
    if args.wire_dtype:
        env["PP_WIRE_DTYPE"] = args.wire_dtype
    if args.kv_memory:
        env["PP_KV_BYTES"] = str(parse_bytes(args.kv_memory))
    ray = RayPlacement(args.ray_address, args.ray_num_cpus, args.ray_num_gpus) if args.launcher == RAY_LAUNCHER \
        else None
    return Launch(args.stages, model=args.model, stub=args.stub, launcher=args.launcher, env=env, ray=ray,
                  split=args.split)


def draft_from(args: argparse.Namespace, env: dict[str, str] | None = None) -> Draft | None:
    """The draft the flags ask for; ``--draft-model`` starts its worker here (closed at exit; a model that does not
    load is a DraftModelError), holding a session for each generation in flight (``--concurrency``) and no more;
    ``env``: more settings for its stages (pp-serve's warm-up)."""
    if args.draft_model:
        worker = DraftWorker(args.draft_model, env={"PP_MAX_SESSIONS": str(max(1, args.concurrency)), **(env or {})},
                             processes=args.draft_processes, step_timeout=args.step_timeout,
                             load_timeout=args.load_timeout)
        atexit.register(worker.close)
        return Draft("model", args.draft_max, worker)
    return Draft(args.draft, args.draft_max) if args.draft else None


def draft_problem(draft: Draft | None, vocab_size: int | None) -> str:
    """Why a draft model cannot guess for these stages (another vocabulary), "" when it can: checked once the
    stages' ready lines give ``vocab_size``."""
    if draft is None or draft.worker is None or vocab_size is None or vocab_size == draft.worker.vocab_size:
        return ""
    return (f"--draft-model {draft.worker.path}: a vocabulary of {draft.worker.vocab_size} tokens, the model's has "
            f"{vocab_size}: a draft model must share the model's vocabulary")


def sampling_from(args: argparse.Namespace) -> Sampling:
    return Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed,
                    tuple(dict(args.logit_bias).items()))  # a token given twice: the last bias counts


def logit_bias_problem(sampling: Sampling, vocab_size: int | None) -> str:
    """Why the stages would refuse ``--logit-bias`` (a token id outside the vocabulary), "" when they would not: an
    error reply fails the whole pipeline, so this is checked once the stages' ready lines give ``vocab_size``."""
    bad = [token for token, _ in sampling.logit_bias if vocab_size is not None and token >= vocab_size]
    return f"--logit-bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})" if bad else ""
