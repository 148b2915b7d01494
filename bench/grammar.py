"""Section 16: what constrained decoding (worker.grammar) adds to a decode step at a 150K vocabulary.

A vocabulary of Qwen 2.5's size (151,936 logits: 256 byte tokens and ~151K word-like pieces, made up here: no model
file is needed) and a JSON schema with nesting, enums, arrays, strings and numbers; each step of a generated answer
computes the matcher's mask, applies it to the logits and advances the matcher, timed as the last stage runs them
(`Constraints.mask` and `advance`). The reference is a lower bound of a decode step of the smallest model with that
vocabulary (Qwen 2.5 0.5B, hidden size 896): reading its output head once at Q8_0 (151,936 x 896 x 34/32 bytes,
145 MB) at this machine's memory rate, so mask / head bounds the mask's share of any such step from above.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.rows import Row
from pp_worker.worker.grammar import Constraints, Grammar
from pp_worker.worker.text.vocabulary import Vocabulary

S16 = "16 constrained decoding (llguidance) at a 150K vocabulary"
TARGET_SHARE = 0.10  # issue 53: masking costs a decode step at most 10%
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


@dataclass(frozen=True)
class GrammarPlan:
    vocab: int = 151_936
    dim: int = 896  # Qwen 2.5 0.5B's hidden size: the cheapest head of that vocabulary
    answers: int = 8  # generated answers, each a fresh matcher
    head_reps: int = 7


def vocabulary(n: int, seed: int = 0) -> Vocabulary:
    """``n`` - 1 distinct tokens (the 256 bytes, then random pieces of 2-10 JSON-ish characters) and an EOS."""
    rng, alphabet = np.random.default_rng(seed), np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789"
                                                               b'{}[]":,.-_', dtype=np.uint8)
    tokens, seen = [bytes([b]) for b in range(256)], set()
    while len(tokens) < n - 1:
        piece = alphabet[rng.integers(0, alphabet.size, rng.integers(2, 11))].tobytes()
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
    return Vocabulary([*tokens, b"\xff<|endoftext|>"], [n - 1], [n - 1], lambda text: list(text.encode()))


def measure(plan: GrammarPlan) -> dict[str, Any]:
    vocab = vocabulary(plan.vocab)
    constraints = Constraints(lambda: vocab, plan.vocab)
    grammar, rng = Grammar.parse({"type": "json_schema", "schema": SCHEMA}), np.random.default_rng(1)
    steps: list[float] = []
    first: list[float] = []  # each answer's first step (the first answer's builds llguidance's tokenizer too)
    for session in range(plan.answers):
        fields: dict[str, Any] = {"position": 0, "seq_len": 8, "grammar": grammar}
        for n in range(400):
            logits = rng.standard_normal(plan.vocab).astype(np.float32)
            t = time.perf_counter()
            token = int(np.argmax(constraints.mask(session, fields, logits)))
            constraints.advance(session, fields, token)
            (first if n == 0 else steps).append(time.perf_counter() - t)
            if token == plan.vocab - 1:
                break
            fields = {"position": fields["position"] + fields["seq_len"], "seq_len": 1}
    return {"vocab": plan.vocab, "step_s": steps, "first_s": first, "head_s": _head_seconds(plan)}


def _head_seconds(plan: GrammarPlan) -> float:
    """The median time to read a Q8_0 head's bytes once (a sum over them: memory-bound, no arithmetic to speak of)."""
    head = np.ones(plan.vocab * plan.dim * 34 // 32 // 8, dtype=np.uint64)
    times = []
    for _ in range(plan.head_reps):
        t = time.perf_counter()
        head.sum()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rows(m: dict[str, Any] | None) -> list[Row]:
    if not m or not m.get("step_s"):
        return [Row(S16, "mask per step", None, "ms", note="not measured (section grammar not run, or it failed)")]
    steps, head = m["step_s"], m["head_s"]
    mean = statistics.fmean(steps)
    return [Row(S16, f"mask + advance per step, {m['vocab']:,} ids", mean * 1e3, "ms",
                note=f"mean of {len(steps)} steps of {len(m['first_s'])} JSON answers; median "
                     f"{statistics.median(steps) * 1e3:.2f}, p95 {np.percentile(steps, 95) * 1e3:.2f} ms"),
            Row(S16, "  an answer's first step (a new matcher)", statistics.median(m["first_s"][1:]) * 1e3, "ms",
                note=f"the stage's first grammar also builds llguidance's tokenizer: {m['first_s'][0]:.2f} s"),
            Row(S16, "  reading a Q8_0 head of 151,936 x 896 once", head * 1e3, "ms",
                note="a lower bound of a decode step of the smallest model with this vocabulary"),
            Row(S16, "  mask / head", mean / head, "x", TARGET_SHARE, at_most=True,
                note="an upper bound of the mask's share of such a decode step")]


if __name__ == "__main__":
    from bench.rows import render

    print(render(rows(measure(GrammarPlan()))))
