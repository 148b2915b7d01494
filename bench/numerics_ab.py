"""Decode speed of the two numerics side by side: 2-stage chains of one GGUF in this process, one on the float path
(PP_EXACT=1), one on the integer path, tokens/s in alternating rounds (the order reversed every other round).

    python -m bench.numerics_ab FILE.gguf [--rounds 6] [--tokens 12]

The stages run in turn (each on all of `PP_THREADS`' threads), so a rate is one token through both stages, not a
pipelined rate. Each chain's kernels are built under its own PP_EXACT (`cpu.kernels.numerics` is read when a kernel
is built), then its JITs replay the compiled code whatever the environment says.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pp_worker.testing.chain import Chain

PROMPT = list(range(10, 18))


def build(path: str, exact: str) -> Chain:
    os.environ["PP_EXACT"] = exact
    chain = Chain(path, 2, 256, every_size=False)
    chain.generate(0, PROMPT, 3)  # compiles decode and the prompt's prefill under this PP_EXACT
    chain.release(0)
    return chain


def decode_rate(chain: Chain, rid: int, n: int) -> float:
    """Tokens/s of ``n`` greedy decode steps after the prompt's prefill."""
    chain.step(rid, PROMPT, 0)
    t0, tok = time.perf_counter(), 5
    for i in range(n):
        tok = int(chain.step(rid, [tok], len(PROMPT) + i).argmax())
    rate = n / (time.perf_counter() - t0)
    chain.release(rid)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=12)
    a = ap.parse_args()
    chains = {"float": build(a.path, "1"), "int8": build(a.path, "0")}
    rates: dict[str, list[float]] = {name: [] for name in chains}
    for r in range(a.rounds):
        for name in list(chains) if r % 2 == 0 else list(chains)[::-1]:
            rates[name].append(decode_rate(chains[name], r + 1, a.tokens))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.2f} tok/s" for n, v in rates.items()), flush=True)
    ratios = [i / f for i, f in zip(rates["int8"], rates["float"], strict=True)]
    print(f"int8/float per round {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
